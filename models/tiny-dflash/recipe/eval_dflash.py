"""Evaluate `tiny-dflash` on the held-out tasks (models/tiny/eval.jsonl): the target's exact-match accuracy (greedy,
chat template), then DFlash with the trained draft at several block sizes — identical output checked, acceptance
length τ (tokens per verification step, the bonus token included), and tokens/s of DFlash vs the target alone,
measured side by side in this run (``localdiff bench --only dflash`` is the benchmark of record).

    python eval_dflash.py --model /work/train/out/dflash --per-family 20 --out eval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import localdiff

HERE = Path(__file__).resolve().parent
EVAL = HERE.parents[1] / "tiny" / "eval.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HERE.parent, help="folder with target/ and draft/")
    ap.add_argument("--per-family", type=int, default=20)
    ap.add_argument("--blocks", default="8,4,2", help="block sizes to evaluate")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    items, count = [], defaultdict(int)
    for line in EVAL.read_text().splitlines():
        it = json.loads(line)
        if count[it["family"]] < a.per_family:
            count[it["family"]] += 1
            items.append(it)
    alone = localdiff.load(str(a.model / "target"), device="cpu")
    spec = localdiff.load(str(a.model / "target"), device="cpu", draft=str(a.model / "draft"))
    eot = alone.tokenizer.encode("<end_of_turn>")[-1] if alone.tokenizer else None
    right, by_fam, want, t_alone = 0, defaultdict(lambda: [0, 0]), [], []
    for it in items:
        g = alone.generate(it["prompt"], max_new_tokens=a.max_new_tokens, temperature=0.0)
        ok = g.text.replace("<end_of_turn>", "").strip() == it["answer"].strip()
        right += ok
        by_fam[it["family"]][0] += ok
        by_fam[it["family"]][1] += 1
        want.append(g.token_ids)
        t_alone.append((g.stats.new_tokens, g.stats.seconds))
    res = {
        "items": len(items),
        "target_exact_match": right / len(items),
        "by_family": {f: r / n for f, (r, n) in by_fam.items()},
        "eot_id": eot,
        "blocks": {},
    }
    print(f"target exact match {right}/{len(items)} = {right / len(items):.3f}", flush=True)
    for bs in [int(b) for b in a.blocks.split(",")]:
        lengths, equal, rates = [], 0, []
        for it, w in zip(items, want):
            t0 = time.perf_counter()
            ga = alone.generate(it["prompt"], max_new_tokens=a.max_new_tokens, temperature=0.0)
            ta = time.perf_counter() - t0
            t0 = time.perf_counter()
            g = spec.generate(it["prompt"], max_new_tokens=a.max_new_tokens, temperature=0.0, block_size=bs)
            td = time.perf_counter() - t0
            equal += g.token_ids == w == ga.token_ids
            lengths += g.stats.acceptance_lengths
            rates.append(ta / td)
        tau = sum(lengths) / max(len(lengths), 1)
        res["blocks"][str(bs)] = {
            "tau": tau,
            "equal_output": equal,
            "speedup_median": statistics.median(rates),
            "speedup_range": [min(rates), max(rates)],
            "acceptance_histogram": {str(k): lengths.count(k) for k in sorted(set(lengths))},
        }
        print(
            f"block {bs}: τ {tau:.2f}, equal output {equal}/{len(items)}, wall-time speed-up per item median "
            f"{statistics.median(rates):.2f}× (range {min(rates):.2f}–{max(rates):.2f})",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
