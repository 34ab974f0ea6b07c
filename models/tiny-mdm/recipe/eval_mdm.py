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
from localdiff.bench.eval_tasks import evaluate, load_items

HERE = Path(__file__).resolve().parent
SETTINGS = [("one token per step", {}), ("threshold 0.9", {"threshold": 0.9}),
            ("threshold 0.7", {"threshold": 0.7}),
            ("one token per step, prefix cache", {"kv_cache": "prefix"}),
            ("one token per step, dual cache", {"kv_cache": "dual"}),
            ("threshold 0.9, prefix cache", {"threshold": 0.9, "kv_cache": "prefix"}),
            ("threshold 0.9, dual cache", {"threshold": 0.9, "kv_cache": "dual"})]


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
    rows = []
    for name, opts in SETTINGS:
        r = evaluate(m, items, seed=0, batch_size=16, max_new_tokens=32, block_length=8, **opts)
        rows.append({"setting": name, "options": opts, "accuracy": r["accuracy"], "correct": r["correct"],
                     "n": r["n"], "tpf": r["tpf"], "seconds": r["seconds"],
                     "per_family": {f: v["accuracy"] for f, v in r["per_family"].items()}})
        print(f"{name:36s} accuracy {r['accuracy']:.3f} ({r['correct']}/{r['n']})  TPF {r['tpf']:.2f}  "
              f"{r['seconds']:.0f} s", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
