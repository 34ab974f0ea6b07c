"""Exact-match accuracy of a tiny checkpoint on the held-out eval set, using transformers' own `generate`.

This is the recipe's check against the reference implementation (transformers' DiffusionGemma); the product's
own eval is `localdiff bench --eval`. Per family: exact match of the stripped decoded answer, mean tokens per
forward (reference definition: non-pad new tokens / decoder forwards).

    python eval_reference.py --ckpt ../ --per-family 10 [--set max_denoising_steps=16 ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import jinja2
import torch
from tokenizers import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--eval", type=Path, default=Path(__file__).resolve().parent.parent / "eval.jsonl")
    ap.add_argument("--per-family", type=int, default=10)
    ap.add_argument("--families", default="", help="comma-separated subset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="generation override key=value (float/int)")
    ap.add_argument("--verbose", action="store_true", help="print every item")
    ap.add_argument("--show", type=int, default=2, help="print this many wrong answers per family")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.ckpt).eval()
    tok = Tokenizer.from_file(str(args.ckpt / "tokenizer.json"))
    tpl = jinja2.Environment().from_string((args.ckpt / "chat_template.jinja").read_text())
    eos = set(model.generation_config.eos_token_id)
    overrides = {}
    for kv in args.set:
        k, v = kv.split("=")
        overrides[k] = float(v) if "." in v else int(v)
    if "entropy_bound" in overrides:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        overrides["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=overrides.pop("entropy_bound"))
    items = [json.loads(x) for x in args.eval.read_text().splitlines()]
    fams = [f for f in args.families.split(",") if f]
    count: dict[str, int] = collections.Counter()
    picked = []
    for it in items:
        if (not fams or it["family"] in fams) and count[it["family"]] < args.per_family:
            count[it["family"]] += 1
            picked.append(it)
    res: dict[str, list] = collections.defaultdict(list)
    shown: dict[str, int] = collections.Counter()
    t0 = time.time()
    for i, it in enumerate(picked):
        prompt = tpl.render(
            messages=[{"role": "user", "content": it["prompt"]}], add_generation_prompt=True, bos_token="<bos>"
        )
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
        torch.manual_seed(args.seed + i)
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=128, **overrides)
        new = out.sequences[0, ids.shape[1] :].tolist()
        cut = next((j for j, t in enumerate(new) if t in eos), None)
        ended = cut is not None
        text = tok.decode(new[:cut] if ended else new).strip()
        ok = ended and text == it["answer"]
        res[it["family"]].append((ok, float(out.tokens_per_forward[0])))
        if args.verbose:
            print(f"{i} {it['family']} {ok} {text!r}", flush=True)
        if not ok and shown[it["family"]] < args.show:
            shown[it["family"]] += 1
            print(f"  [{it['family']}] {it['prompt']!r} -> {text!r} (want {it['answer']!r}, eos={ended})", flush=True)
    allok = []
    for fam, r in res.items():
        acc = sum(o for o, _ in r) / len(r)
        tpf = sum(t for _, t in r) / len(r)
        allok += [o for o, _ in r]
        print(f"{fam:14s} exact {acc * 100:5.1f}% ({sum(o for o, _ in r)}/{len(r)})  TPF {tpf:.2f}")
    print(
        f"overall exact {100 * sum(allok) / max(1, len(allok)):.1f}% on {len(allok)} items in {time.time() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
