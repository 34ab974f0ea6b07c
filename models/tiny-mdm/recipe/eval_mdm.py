"""Held-out exact match and tokens per forward of a tiny masked model under each decoder setting (#15 targets):
one token per step vs Fast-dLLM threshold decoding, each with kv_cache none / prefix / dual.

    python eval_mdm.py --ckpt /tmp/tiny_mdm [--per-family 50] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import localdiff
from localdiff.bench.eval_tasks import load_items
from localdiff.bench.masked import accuracy

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt)
    items = load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family)
    rows = accuracy(m, items, log=lambda s: print(s, flush=True))  # the bench's settings and table
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
