"""`localdiff bench` section 2: quality vs speed on the embedded model's held-out set (``eval.jsonl``).

Exact match per task family (generated text, EOS stripped, whitespace-normalised == the item's answer) and tokens
per forward (TPF = new tokens / decoder forwards, summed over the items), with the default sampler (``--eval``) and
across acceptance settings (the sweep), plus the best accuracy-per-TPF point and an optional PNG plot.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from pathlib import Path

from localdiff.errors import UsageError

EB_VALUES = (0.01, 0.1, 0.3, 1.0)
TAU_VALUES = (None, 0.7, 0.9, 0.95, 0.99)
STEP_CAPS = (4, 8, 32)


def load_items(path: Path, per_family: int | None = None) -> list[dict]:
    """Held-out items {family, prompt, answer} from a JSONL file; the first ``per_family`` of each family (None = all).

    Raises:
        UsageError: the file is missing or a line is not an item.
    """
    if not path.is_file():
        raise UsageError(f"eval set not found: {path}")
    items, seen = [], defaultdict(int)
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            it = json.loads(line)
            fam, prompt, answer = str(it["family"]), str(it["prompt"]), str(it["answer"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{path}:{n}: not an eval item (need family, prompt, answer)") from None
        if per_family is not None and seen[fam] >= per_family:
            continue
        seen[fam] += 1
        items.append({"family": fam, "prompt": prompt, "answer": answer})
    if not items:
        raise UsageError(f"eval set {path} is empty")
    return items


def normalize_text(s: str) -> str:
    """Whitespace-normalised text used for exact match."""
    return " ".join(s.split())


def exact_match(generated: str, answer: str) -> bool:
    """True when the generated text equals the answer up to whitespace."""
    return normalize_text(generated) == normalize_text(answer)


def items_digest(items: list[dict]) -> str:
    """A short fingerprint of an item list (to tell whether two evaluations ran on the same items)."""
    return hashlib.sha1("\n".join(it["prompt"] for it in items).encode()).hexdigest()[:12]


def answer_budget(m, answers: list[str]) -> int:
    """max_new_tokens for a batch: the canvases the longest answer (+ EOS) needs, plus one canvas of slack, at most
    the model's default. An output that runs past it is a mismatch anyway; the cap only stops a model that never
    emits EOS from running to the default length."""
    c = m.config.canvas_length
    longest = max(len(m.tokenizer.encode(a)) for a in answers) + 1
    return min(c * (math.ceil(longest / c) + 1), max(m.default_max_new_tokens, c))


def evaluate(
    m, items: list[dict], seed: int = 0, batch_size: int = 16, max_new_tokens: int | None = None, **sampler
) -> dict:
    """Generate every item's answer (chat template; items batched within their family, ``batch_size`` at a time,
    seed ``seed + batch index``; ``max_new_tokens`` None = :func:`answer_budget`). TPF follows the reference's
    definition: non-pad new tokens up to EOS ÷ decoder forwards of the rows still denoising, summed over rows.

    Returns:
        {"accuracy", "correct", "n", "tpf", "forwards", "new_tokens", "seconds", "per_family": {fam: {"accuracy",
        "correct", "n", "tpf"}}, "sampler": effective settings, "failures": first few mismatches}.
    """
    opts = m.sampler_options(**sampler)
    fam = defaultdict(lambda: {"correct": 0, "n": 0, "forwards": 0, "new_tokens": 0})
    failures, t0 = [], time.perf_counter()
    by_fam = defaultdict(list)
    for it in items:
        by_fam[it["family"]].append(it)
    bi = 0
    for name, group in by_fam.items():  # one family per batch, so each family's forwards are exact
        for j in range(0, len(group), batch_size):
            batch = group[j : j + batch_size]
            cap = max_new_tokens or answer_budget(m, [it["answer"] for it in batch])
            g = m.generate([it["prompt"] for it in batch], max_new_tokens=cap, seed=seed + bi, chat=True, **sampler)
            bi += 1
            texts = g.text if isinstance(g.text, list) else [g.text]
            f = fam[name]
            f["forwards"] += g.stats.forwards
            f["new_tokens"] += g.stats.new_tokens
            for it, text in zip(batch, texts):
                ok = exact_match(text, it["answer"])
                f["correct"] += ok
                f["n"] += 1
                if not ok and len(failures) < 8:
                    failures.append({"family": name, "prompt": it["prompt"], "answer": it["answer"], "got": text})
    tot_fw = sum(f["forwards"] for f in fam.values())
    tot_tok = sum(f["new_tokens"] for f in fam.values())
    correct = sum(f["correct"] for f in fam.values())
    per_family = {
        k: {
            "accuracy": v["correct"] / v["n"],
            "correct": v["correct"],
            "n": v["n"],
            "tpf": v["new_tokens"] / v["forwards"] if v["forwards"] else 0.0,
        }
        for k, v in sorted(fam.items())
    }
    return {
        "accuracy": correct / len(items),
        "correct": correct,
        "n": len(items),
        "tpf": tot_tok / max(tot_fw, 1),
        "forwards": tot_fw,
        "new_tokens": tot_tok,
        "seconds": time.perf_counter() - t0,
        "per_family": per_family,
        "sampler": opts,
        "failures": failures,
        "items_digest": items_digest(items),
    }


def sweep_settings(quick: bool, default_steps: int) -> list[dict]:
    """Sampler overrides to sweep. Full: EB × τ grid (correction off), correction on for every τ, step caps at the
    default acceptance. Quick: a 2 × 2 corner of the grid plus correction at one τ."""
    if quick:
        grid = [dict(entropy_bound=eb, threshold=t, correction=False) for eb in (0.1, 1.0) for t in (None, 0.9)]
        return grid + [dict(entropy_bound=0.1, threshold=0.9, correction=True)]
    out = [dict(entropy_bound=eb, threshold=t, correction=False) for eb in EB_VALUES for t in TAU_VALUES]
    out += [dict(entropy_bound=eb, threshold=t, correction=True) for eb in EB_VALUES for t in TAU_VALUES if t]
    out += [dict(max_denoising_steps=s) for s in STEP_CAPS if s != default_steps]
    return out


def label(s: dict) -> str:
    """Short label of a sweep setting, e.g. ``eb=0.1 τ=0.9 corr`` or ``steps=8``."""
    parts = []
    if "entropy_bound" in s:
        parts.append(f"eb={s['entropy_bound']}")
    if "threshold" in s:
        parts.append("τ=off" if s["threshold"] is None else f"τ={s['threshold']}")
    if s.get("correction"):
        parts.append("corr")
    if "max_denoising_steps" in s:
        parts.append(f"steps={s['max_denoising_steps']}")
    return " ".join(parts) or "default"


def run_sweep(
    m, items, settings: list[dict], seed: int, batch_size: int, log=print, max_new_tokens: int | None = None
) -> list[dict]:
    """Evaluate each setting; rows {"setting", "label", "accuracy", "tpf", "seconds", "per_family", "effective"}."""
    rows = []
    for i, s in enumerate(settings):
        r = evaluate(m, items, seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens, **s)
        rows.append(
            {
                "setting": s,
                "label": label(s),
                "accuracy": r["accuracy"],
                "tpf": r["tpf"],
                "seconds": r["seconds"],
                "per_family": {k: v["accuracy"] for k, v in r["per_family"].items()},
                "effective": {
                    k: r["sampler"][k] for k in ("entropy_bound", "threshold", "correction", "max_denoising_steps")
                },
            }
        )
        log(f"  sweep {i + 1}/{len(settings)} {label(s)}: accuracy {r['accuracy']:.3f}, TPF {r['tpf']:.2f}")
    return rows


def best_point(
    rows: list[dict], n_items: int | None = None, tolerance: float = 0.01, tpf_tie: float = 0.01
) -> dict | None:
    """The best accuracy-per-TPF point: the highest TPF among settings whose accuracy is within the margin of the
    best accuracy — the larger of ``tolerance`` (absolute) and one standard error of the best accuracy over
    ``n_items`` items (``sqrt(p(1-p)/n)``; differences below it are noise). TPFs within ``tpf_tie`` (relative) of
    that highest TPF count as ties, won by the current default, then by a setting the reference sampler can express
    (no lock τ, no correction), then by accuracy. Also returns the Pareto frontier (no other row has both ≥ accuracy
    and ≥ TPF)."""
    if not rows:
        return None
    top = max(r["accuracy"] for r in rows)
    margin = max(tolerance, math.sqrt(top * (1 - top) / n_items) if n_items else 0.0)
    near = [r for r in rows if r["accuracy"] >= top - margin - 1e-12]
    fastest = max(r["tpf"] for r in near)
    tied = [r for r in near if r["tpf"] >= fastest * (1 - tpf_tie)]

    def plain(r):
        return r["label"] == "default" or (not r["setting"].get("threshold") and not r["setting"].get("correction"))

    best = max(tied, key=lambda r: (r["label"] == "default", plain(r), r["accuracy"], r["tpf"]))
    frontier = [
        r["label"]
        for r in rows
        if not any(
            o is not r
            and o["accuracy"] >= r["accuracy"]
            and o["tpf"] >= r["tpf"]
            and (o["accuracy"], o["tpf"]) != (r["accuracy"], r["tpf"])
            for o in rows
        )
    ]
    return {
        "label": best["label"],
        "setting": best["setting"],
        "accuracy": best["accuracy"],
        "tpf": best["tpf"],
        "rule": f"highest TPF (ties within {tpf_tie:.0%}: the default, then no τ/correction, then accuracy) "
        f"with accuracy within {margin:.1%} of the best ({top:.1%})",
        "pareto": frontier,
    }


def plot(rows: list[dict], default: dict | None, path: Path, labelled: set | None = None) -> str | None:
    """Accuracy vs TPF scatter (PNG at ``path``); only the rows in ``labelled`` (e.g. the Pareto frontier) get text
    labels, the rest are told apart by marker. Returns None on success, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'localdiff[bench]'); PNG plot skipped"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = {
        "o": ("entropy bound × τ", "tab:blue"),
        "s": ("… + correction", "tab:green"),
        "^": ("step cap", "tab:orange"),
    }
    seen = set()
    for r in rows:
        if r is default:
            continue
        marker = "s" if r["setting"].get("correction") else ("^" if "max_denoising_steps" in r["setting"] else "o")
        name, color = kinds[marker]
        ax.scatter(
            r["tpf"], r["accuracy"], marker=marker, color=color, alpha=0.7, label=None if marker in seen else name
        )
        seen.add(marker)
        if labelled is None or r["label"] in labelled:
            ax.annotate(r["label"], (r["tpf"], r["accuracy"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if default:
        ax.scatter(default["tpf"], default["accuracy"], marker="*", s=160, color="tab:red", label="default", zorder=3)
    ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_title("embedded model: accuracy vs tokens per forward")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
