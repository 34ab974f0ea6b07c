"""Does LLaDA2.1's token editing help a small block-diffusion model? Held-out exact match and tokens per forward of
`tiny-bd` decoded with LLaDA2's decoder (policy ``llada2``, :mod:`localdiff.decoding.llada2`; the block runner runs
it on any block-family model), one token per step vs threshold decoding, each without and with token editing.

tiny-bd is trained by mask-to-token denoising only (train_bd.py); LLaDA2.1 learns editing from token-to-token
examples as well (random token perturbations in training, arXiv 2602.08676). So this measures what editing does to a
model that never saw a corrupted token — the honest case for applying it to other block models.

    python eval_editing.py --ckpt models/tiny-bd [--per-family 40] [--quick] [--out results.json]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import localdiff
from localdiff.bench.eval_tasks import load_items
from localdiff.decoding.options import POLICIES

from eval_bd import run_settings  # noqa: E402  (this folder: the shared evaluation loop)

HERE = Path(__file__).resolve().parent
ONE = {"threshold": 1.0}                 # nothing exceeds 1: the step's quota of one token (steps = block size)
SETTINGS = [("one token per step", ONE),
            ("one token per step + editing 0.9", {**ONE, "editing_threshold": 0.9}),
            ("one token per step + editing 0.7", {**ONE, "editing_threshold": 0.7}),
            ("threshold 0.9", {"threshold": 0.9}),
            ("threshold 0.7", {"threshold": 0.7}),
            ("threshold 0.5", {"threshold": 0.5}),
            ("threshold 0.7 + editing 0.9", {"threshold": 0.7, "editing_threshold": 0.9}),
            ("threshold 0.7 + editing 0.7", {"threshold": 0.7, "editing_threshold": 0.7}),
            ("threshold 0.7 + editing 0.5", {"threshold": 0.7, "editing_threshold": 0.5}),
            ("threshold 0.5 + editing 0.9", {"threshold": 0.5, "editing_threshold": 0.9}),
            ("threshold 0.5 + editing 0.7", {"threshold": 0.5, "editing_threshold": 0.7})]
QUICK = ("one token per step", "one token per step + editing 0.9", "threshold 0.7", "threshold 0.7 + editing 0.9",
         "threshold 0.7 + editing 0.7", "threshold 0.5", "threshold 0.5 + editing 0.7")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--max-post-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="only the settings in QUICK")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt, dtype=torch.float32)
    m.options_cls = POLICIES["llada2"]   # LLaDA2's decoder on this block model (its own default is SDAR's)
    items = load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family)
    settings = []
    for name, opts in SETTINGS:
        if a.quick and name not in QUICK:
            continue
        opts = {**opts, "temperature": 0.0}
        if "editing_threshold" in opts:
            opts["max_post_steps"] = a.max_post_steps
        settings.append((name, opts))
    run_settings(m, items, settings, 16, a.out, width=34)


if __name__ == "__main__":
    main()
