"""Held-out exact match (the summary's text), TPF and Global ARness@1 of `tiny-nap` (or any masked checkpoint) under
parallel-forced decoding with m = 1, 2, 3 think blocks and under LLaDA's decoder (the rows of
``localdiff bench --only nap``, :mod:`localdiff.bench.nap`).

    python eval_nap.py --ckpt /tmp/tiny_nap [--per-family 10] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import localdiff
from localdiff.bench import nap as bench_nap
from localdiff.bench.eval_tasks import load_items

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt)
    items = [it for it in load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family) if it["family"] != "list"]
    rows = []
    for label, pol, opts in bench_nap.DECODERS:
        r = bench_nap.run_decoder(m, items, pol, opts)
        rows.append({"decoder": label, "options": opts, **{k: v for k, v in r.items() if k != "sampler"}})
        print(
            f"{label:36s} accuracy {r['accuracy']:.3f} ({r['correct']}/{r['n']})  TPF {r['tpf']:.2f}  "
            f"Global ARness@1 {r['global_arness']:.3f}  {r['seconds']:.0f} s",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
