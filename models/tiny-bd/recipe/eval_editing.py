"""Does LLaDA2.1's token editing help a small block-diffusion model? Held-out exact match and tokens per forward of
`tiny-bd` decoded with LLaDA2's decoder (policy ``llada2``, :mod:`localdiff.decoding.llada2`; the block runner runs
it on any block-family model), one token per step vs threshold decoding, each without and with token editing.

LLaDA2.1 learns editing from token-to-token examples as well as mask-to-token ones (arXiv 2602.08676); the first
tiny-bd (mask-to-token only) had untrained outputs at visible positions and editing broke it; train_bd.py now adds
token-to-token noise (its ``corrupt``). ``--diagnostic`` also reports, on the clean gold answers, how often the
model's top token at a visible position is the token itself, and how often another token has p > 0.7 (what
editing at threshold 0.7 would replace).

    python eval_editing.py --ckpt models/tiny-bd [--per-family 40] [--quick] [--diagnostic] [--out results.json]
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
ONE = {"threshold": 1.0}  # nothing exceeds 1: the step's quota of one token (steps = block size)
SETTINGS = [
    ("one token per step", ONE),
    ("one token per step + editing 0.9", {**ONE, "editing_threshold": 0.9}),
    ("one token per step + editing 0.7", {**ONE, "editing_threshold": 0.7}),
    ("threshold 0.9", {"threshold": 0.9}),
    ("threshold 0.7", {"threshold": 0.7}),
    ("threshold 0.5", {"threshold": 0.5}),
    ("threshold 0.7 + editing 0.9", {"threshold": 0.7, "editing_threshold": 0.9}),
    ("threshold 0.7 + editing 0.7", {"threshold": 0.7, "editing_threshold": 0.7}),
    ("threshold 0.7 + editing 0.5", {"threshold": 0.7, "editing_threshold": 0.5}),
    ("threshold 0.5 + editing 0.9", {"threshold": 0.5, "editing_threshold": 0.9}),
    ("threshold 0.5 + editing 0.7", {"threshold": 0.5, "editing_threshold": 0.7}),
]
QUICK = (
    "one token per step",
    "one token per step + editing 0.9",
    "threshold 0.7",
    "threshold 0.7 + editing 0.9",
    "threshold 0.7 + editing 0.7",
    "threshold 0.5",
    "threshold 0.5 + editing 0.7",
)


def visible_positions(m, items: list[dict], threshold: float = 0.7) -> dict:
    """On each item's chat-templated prompt + gold answer + ``<end_of_turn>`` (one uncached block-causal pass: every
    answer position visible, as a fully committed block), count the answer positions whose top token is the token
    itself and those where another token has probability > ``threshold``. Returns {positions, keeps, would_edit}."""
    keeps = edits = total = 0
    for it in items:
        p = m.encode_prompt(it["prompt"])[0]
        a = m.tokenizer.encode(it["answer"]) + [m.eos_token_ids[-1]]
        ids = torch.tensor([p + a])
        probs = torch.softmax(m.net.logits_full(ids)[0, len(p) :], -1)
        top_p, top = probs.max(-1)
        gold = ids[0, len(p) :]
        keeps += int((top == gold).sum())
        edits += int(((top != gold) & (top_p > threshold)).sum())
        total += len(a)
    return {"positions": total, "keeps": keeps, "would_edit": edits, "threshold": threshold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--per-family", type=int, default=None)
    ap.add_argument("--max-post-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="only the settings in QUICK")
    ap.add_argument("--diagnostic", action="store_true", help="only the visible-position diagnostic")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = localdiff.load(a.ckpt, dtype=torch.float32)
    m.options_cls = POLICIES["llada2"]  # LLaDA2's decoder on this block model (its own default is SDAR's)
    items = load_items(HERE.parents[1] / "tiny" / "eval.jsonl", a.per_family)
    if a.diagnostic:
        print(visible_positions(m, items))
        return
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
