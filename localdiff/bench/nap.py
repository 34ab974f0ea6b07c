"""``localdiff bench --only nap``: how autoregressive each masked-family decoder really is (issue #21).

On the tiny trained masked models — ``tiny-mdm`` (LLaDA layout, trained on the plain task families) and
``tiny-nap`` (tiny-mdm fine-tuned on multi-trajectory canvases, ``models/tiny-nap/recipe``) — each decoder runs over
the held-out items of ``models/tiny/eval.jsonl`` (the ``list`` family is left out: its answers do not fit 32 tokens)
with the chat template, seed 0, batches of one family. Per decoder: exact-match **accuracy** (NAP rows: the
summary's text, :func:`localdiff.decoding.nap.summary_text`), **TPF** (answer tokens the model decoded ÷ forwards,
summed over rows; a token counts when its commit step is ≥ 1, so NAP's prefilled tags and its think-block ``<pad>``
filler are not counted; for LLaDA / Dream this is ``GenerationStats.tokens_per_forward``) and **Global / Local
ARness@1** (:mod:`localdiff.decoding.arness`, mean over rows).

Decoders: LLaDA low-confidence remasking at 1, 2 and 3 tokens per step (``steps`` = 32, 16, 11 over 32 tokens, block
8), Fast-dLLM threshold 0.9 (LLaDA), Dream's ``alg="entropy"`` at 1 and 2 tokens per step (Dream's decoder run on the
LLaDA-layout model: the masked loop shifts logits only for models that need it), and parallel-forced NAP with
m = 1, 2, 3 think blocks (think / summary 32 tokens, one token per think block per step, then one per step).

Also a decoding-order picture per model (PNG, matplotlib from the ``bench`` extra): for one prompt, position × step
heat maps of LLaDA, Fast-dLLM threshold and NAP m = 3 (which returned token is decoded by each step).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

MAX_NEW = 32
DECODERS = [  # (label, policy, options); every row names an option of its policy (tiny-nap defaults to NAP)
    ("LLaDA low-confidence, 1 tok/step", "llada", {"steps": 32, "remasking": "low_confidence"}),
    ("LLaDA low-confidence, 2 tok/step", "llada", {"steps": 16, "remasking": "low_confidence"}),
    ("LLaDA low-confidence, 3 tok/step", "llada", {"steps": 11, "remasking": "low_confidence"}),
    ("Fast-dLLM threshold 0.9", "llada", {"threshold": 0.9}),
    ("Dream entropy, 1 tok/step", "dream", {"alg": "entropy", "steps": 32}),
    ("Dream entropy, 2 tok/step", "dream", {"alg": "entropy", "steps": 16}),
    ("NAP parallel-forced, m = 1", "nap", {"trajectories": 1, "think_length": 32, "summary_length": 32}),
    ("NAP parallel-forced, m = 2", "nap", {"trajectories": 2, "think_length": 32, "summary_length": 32}),
    ("NAP parallel-forced, m = 3", "nap", {"trajectories": 3, "think_length": 32, "summary_length": 32}),
]
PICTURE = ["LLaDA low-confidence, 1 tok/step", "Fast-dLLM threshold 0.9", "NAP parallel-forced, m = 3"]


def find_models() -> dict:
    """name → checkpoint folder (or catalog name) of the tiny masked models that are installed; missing ones are
    reported by name with the reason."""
    from localdiff.paths import models_dir

    out = {}
    for name in ("tiny-mdm", "tiny-nap"):
        folder = models_dir() / name
        out[name] = str(folder) if (folder / "config.json").is_file() else None
    return out


@contextlib.contextmanager
def policy(model, name: str):
    """Run ``model`` with the masked family's decoder ``name`` as its default (Dream's decoder on a LLaDA-layout
    model: bench only; NAP's, which any masked model can also select with ``decoder``)."""
    from localdiff.decoding.options import POLICIES

    before = model.options_cls
    model.options_cls = POLICIES[name]
    try:
        yield model
    finally:
        model.options_cls = before


def run_decoder(model, items: list[dict], pol: str, opts: dict, batch: int = 16) -> dict:
    """Accuracy, TPF, ARness of one decoder over ``items`` (module docstring)."""
    from collections import defaultdict

    from localdiff.bench.eval_tasks import exact_match
    from localdiff.decoding import arness
    from localdiff.decoding.nap import summary_text

    by_fam = defaultdict(list)
    for it in items:
        by_fam[it["family"]].append(it)
    correct = decoded = forwards = 0
    glob, loc, t0, bi = [], [], time.perf_counter(), 0
    with policy(model, pol):
        for group in by_fam.values():
            for j in range(0, len(group), batch):
                part = group[j : j + batch]
                g = model.generate([it["prompt"] for it in part], max_new_tokens=MAX_NEW, seed=bi, **opts)
                bi += 1
                texts = g.text if isinstance(g.text, list) else [g.text]
                rows = g.stats.commit_step if len(part) > 1 else [g.stats.commit_step]
                forwards += g.stats.forwards
                for it, text, cs in zip(part, texts, rows):
                    correct += exact_match(summary_text(text) if pol == "nap" else text, it["answer"])
                    decoded += sum(1 for s in cs if s > 0)
                    s = arness.summary(cs, ks=(1,))
                    if s:
                        glob.append(s["global@1"])
                        loc.append(s["local@1"])
        sampler = model.sampler_options(**opts) if pol == "nap" else None
    n = len(items)
    return {
        "accuracy": correct / n,
        "correct": correct,
        "n": n,
        "tpf": decoded / max(forwards, 1),
        "forwards": forwards,
        "global_arness": sum(glob) / max(len(glob), 1),
        "local_arness": sum(loc) / max(len(loc), 1),
        "seconds": time.perf_counter() - t0,
        "sampler": sampler,
    }


def order_of(model, prompt: str, pol: str, opts: dict) -> list[int]:
    """The commit steps of one generation (row 0)."""
    with policy(model, pol):
        return list(model.generate(prompt, max_new_tokens=MAX_NEW, seed=0, **opts).stats.commit_step)


def picture(orders: dict, path: Path, title: str) -> str | None:
    """Position × step heat maps (one panel per decoder) of ``orders`` (label → commit steps) into ``path`` (PNG).
    Returns None on success, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return "matplotlib is not installed (pip install 'localdiff[bench]'); PNG skipped"
    fig, axes = plt.subplots(1, len(orders), figsize=(4.2 * len(orders), 3.6), squeeze=False)
    for ax, (label, cs) in zip(axes[0], orders.items()):
        steps = max([s for s in cs if s > 0] or [1])
        img = np.zeros((steps, max(len(cs), 1)))
        for pos, s in enumerate(cs):
            if s <= 0:
                img[:, pos] = 0.35  # prefilled template (NAP's tags)
            else:
                img[s - 1, pos] = 1.0  # committed at this step
                img[s:, pos] = 0.6  # decoded from then on
        ax.imshow(img, aspect="auto", origin="upper", cmap="viridis", interpolation="nearest")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("position in the answer (returned tokens)", fontsize=7)
        ax.set_ylabel("denoising step", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def section(ctx, out: Path) -> dict:
    """The section's result dict: per installed model, one row per decoder (DECODERS) and the heat-map PNG."""
    import localdiff
    from localdiff.bench.eval_tasks import load_items
    from localdiff.paths import models_dir

    per_family = 3 if ctx.args.quick else 10
    items = [it for it in load_items(models_dir() / "tiny" / "eval.jsonl", per_family) if it["family"] != "list"]
    res = {"items": len(items), "per_family": per_family, "models": {}}
    for name, where in find_models().items():
        if where is None:
            res["models"][name] = {"skipped": f"{name} is not installed (models/{name}/ has no checkpoint)"}
            ctx.log(f"nap: {name} skipped (not installed)")
            continue
        model = localdiff.load(where)
        rows = []
        for label, pol, opts in DECODERS:
            r = run_decoder(model, items, pol, opts)
            rows.append({"decoder": label, "policy": pol, "options": opts, **r})
            ctx.log(
                f"nap: {name}: {label}: accuracy {r['accuracy']:.3f} TPF {r['tpf']:.2f} "
                f"Global ARness@1 {r['global_arness']:.3f} ({r['seconds']:.0f} s)"
            )
        entry = {"rows": rows}
        orders = {
            label: order_of(model, "What is 41 + 93?", pol, opts) for label, pol, opts in DECODERS if label in PICTURE
        }
        png = out.parent / f"{out.stem}-nap-order-{name}.png"
        why = picture(orders, png, f"{name}: decoding order for 'What is 41 + 93?' (bright = committed at that step)")
        entry["picture" if why is None else "picture_skipped"] = str(png) if why is None else why
        res["models"][name] = entry
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    lines = [
        "## Masked decoders: accuracy, TPF and ARness (issue #21)",
        "",
        f"{sec['items']} held-out items ({sec['per_family']} per family, `list` left out). TPF = answer tokens "
        "the model decoded ÷ forwards; Global / Local ARness@1 (DiffuCoder / NAP; 1 = strictly left to "
        "right), mean over rows.",
        "",
    ]
    for name, m in sec["models"].items():
        if "skipped" in m:
            lines += [f"{name}: skipped ({m['skipped']})", ""]
            continue
        lines += [
            f"### {name}",
            "",
            "| decoder | accuracy | TPF | Global ARness@1 | Local ARness@1 |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['decoder']} | {r['accuracy']:.1%} ({r['correct']}/{r['n']}) | {r['tpf']:.2f} | "
            f"{r['global_arness']:.3f} | {r['local_arness']:.3f} |"
            for r in m["rows"]
        ]
        lines.append("")
        if m.get("picture"):
            lines += [f"Decoding order (position × step): `{m['picture']}`", ""]
        elif m.get("picture_skipped"):
            lines += [f"Decoding order picture skipped: {m['picture_skipped']}", ""]
    return lines


def run(ctx) -> dict:
    """The section as ``localdiff bench`` runs it (the PNGs beside ``ctx.out``)."""
    return section(ctx, ctx.out)
