"""Held-out exact match and tokens per forward of a tiny ReFusion model: ReFusion decoding under a grid of settings vs
the same weights' greedy autoregressive decoding (#19 target: TPF ≥ 2 within 2 points of AR accuracy).

    python eval_refusion.py --ckpt /work/train/out/refusion [--per-family 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import localdiff
from localdiff.bench.eval_tasks import load_items
from localdiff.bench.slots import compare

HERE = Path(__file__).resolve().parent
GRID = {
    f"k{k} slot {s} token {t}": {"slot_size": k, "serial_num_blocks": 1, "slot_threshold": s, "token_threshold": t}
    for k in (4, 8, 16, 32)
    for s, t in ((0.9, 0.9), (0.7, 0.7), (0.5, 0.5), (0.3, 0.3), (0.9, 0.3))
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated GRID names (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt)
    items = load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family)
    grid = {k: v for k, v in GRID.items() if a.only is None or k in a.only.split(",")}
    res = compare(m, items, 32, grid, log=print)
    ar = res["autoregressive"]["accuracy"]
    for name, r in res.items():
        ok = r["tokens_per_forward"] >= 2 and r["accuracy"] >= ar - 0.02
        print(
            f"{name:28s} accuracy {r['accuracy']:.3f}  TPF {r['tokens_per_forward']:.2f}  "
            f"{r['tokens_per_second']:.0f} tok/s  {'target met' if ok and name != 'autoregressive' else ''}"
        )
    if a.out:
        a.out.write_text(json.dumps({"items": len(items), "decoders": res}, indent=1))


if __name__ == "__main__":
    main()
