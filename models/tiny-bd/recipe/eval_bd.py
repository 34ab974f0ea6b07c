"""Held-out exact match and tokens per forward (TPF) of tiny-bd under SDAR's decoders (#16 target: threshold decoding
at TPF ≥ 2 within 1 point of one-token-per-step accuracy): one token per step (``low_confidence_static``, steps =
block size) vs ``low_confidence_dynamic`` at several confidence thresholds, and the whole block in one step.
Temperature 0, one prompt per generate call (batch 1: no padding shifts the block boundaries).

    python eval_bd.py --ckpt /work/train/out/block [--per-family 50] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import localdiff
from localdiff.bench.eval_tasks import evaluate, load_items

HERE = Path(__file__).resolve().parent
SETTINGS = [
    ("one token per step", {"remasking_strategy": "low_confidence_static", "steps": 4}),
    ("threshold 0.9", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.9}),
    ("threshold 0.85 (sdar:1.7b's)", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.85}),
    ("threshold 0.8", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.8}),
    ("threshold 0.7", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.7}),
    ("threshold 0.5", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.5}),
    ("threshold 0.3", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.3}),
    ("threshold 0.1", {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.1}),
    ("whole block in one step", {"remasking_strategy": "low_confidence_static", "steps": 1}),
    ("entropy_bounded 0.35", {"remasking_strategy": "entropy_bounded", "eb_threshold": 0.35}),
    ("entropy_bounded 1.0", {"remasking_strategy": "entropy_bounded", "eb_threshold": 1.0}),
]


def run_settings(
    m, items: list[dict], settings, batch_size: int, out: Path | None, width: int = 30, **common
) -> list[dict]:
    """Evaluate ``m`` on ``items`` under each (name, options) of ``settings`` (``common`` options first, the
    setting's over them); prints one line per setting and writes the rows as JSON to ``out`` when given.
    Returns rows {setting, options, accuracy, correct, n, tpf (tokens per forward), seconds, per_family}."""
    rows = []
    for name, opts in settings:
        r = evaluate(m, items, seed=0, batch_size=batch_size, **{**common, **opts})
        rows.append(
            {
                "setting": name,
                "options": opts,
                "accuracy": r["accuracy"],
                "correct": r["correct"],
                "n": r["n"],
                "tpf": r["tpf"],
                "seconds": r["seconds"],
                "per_family": {f: v["accuracy"] for f, v in r["per_family"].items()},
            }
        )
        print(
            f"{name:{width}s} accuracy {r['accuracy']:.3f} ({r['correct']}/{r['n']})  TPF {r['tpf']:.2f}  "
            f"{r['seconds']:.0f} s",
            flush=True,
        )
    if out:
        out.write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt)
    items = load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family)
    run_settings(m, items, SETTINGS, a.batch_size, a.out, max_new_tokens=32, temperature=0.0, steps=4)


if __name__ == "__main__":
    main()
