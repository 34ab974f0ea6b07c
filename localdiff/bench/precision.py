"""``localdiff bench --only precision``: is the bf16 fast path as accurate as the exact float32 path on the
embedded eval? Paired over many seeds, with float64 as the control that measures the eval's own chaos.

Why paired seeds: a diffusion decoder is chaotic — a one-ulp change in a logit can flip one token's lock order and
then a whole answer, so even float64 vs float32 (both "exact" arithmetic of the same math) disagree on single
seeds by several items. One seed's accuracy difference is therefore noise of about ±1 point on 436 items; the
question "within 1 point?" is answered by the mean of per-seed paired differences (same items, same seed, same
sampler; only the compute dtype differs) and its 95 % confidence interval (Student t, n − 1 degrees of freedom).

* rows: ``float32`` (the exact path, reference-exact runs use it), ``bfloat16`` (the default compute dtype on a
  bf16-native CPU for large models: :func:`localdiff.capability.choose_cpu_dtype`), ``float32 fast`` (fp32 with
  the fast sampler: the default for large models where bf16 is not fast, e.g. AVX2-only CPUs), ``float64``
  (control: more exact arithmetic; like every dtype but fp32 it runs the fast sampler, whose random stream differs).
* per seed base ``s`` (0, 1000, 2000, …; the eval seeds its batches ``s + batch index``): items correct per dtype.
* verdict: the bf16 − fp32 mean difference in points with its CI; "within 1 point" when the CI's lower end is
  above −1 point (with 95 % confidence bf16 loses less than 1 point), and the fp64 − fp32 control beside it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

# two-sided 95 % Student t quantiles t_{0.975, df} for df = 1..30; larger df use the normal 1.96
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
DTYPES = ("float32", "bfloat16", "float32 fast", "float64")
SEEDS = {True: 2, False: 10}  # quick, full (``--seeds`` overrides)


def t975(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` ≥ 1 degrees of freedom (table to 30, then 1.96)."""
    if df < 1:
        raise ValueError("t quantile needs df >= 1")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def paired(a: list[int], b: list[int], n_items: int) -> dict:
    """Mean and 95 % CI of the paired difference ``a[i] − b[i]`` (items correct per seed), in items and in
    accuracy points (percentage points of ``n_items``). One pair: the CI is unknown (None)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired() needs two equally long, non-empty lists")
    d = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(d)
    half = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
    pt = 100.0 / n_items
    return {
        "diffs": d,
        "mean_items": mean,
        "mean_pt": mean * pt,
        "sd_items": statistics.stdev(d) if len(d) > 1 else None,
        "ci_pt": None if half is None else [(mean - half) * pt, (mean + half) * pt],
    }


def summarize(rows: list[dict], n_items: int) -> dict:
    """``rows``: one per seed, ``{"seed", "float32", "bfloat16", "float64"}`` items correct. Returns per-dtype mean
    accuracy, the paired bf16 − fp32 and fp64 − fp32 differences and the verdict (see the module)."""
    out = {
        "n_items": n_items,
        "seeds": [r["seed"] for r in rows],
        "mean_accuracy": {
            d: statistics.fmean(r[d] for r in rows) / n_items for d in DTYPES if all(d in r for r in rows)
        },
    }
    for d in DTYPES[1:]:
        if all(d in r for r in rows):
            out[f"{d.replace(' ', '_')}_minus_float32"] = paired(
                [r[d] for r in rows], [r["float32"] for r in rows], n_items
            )
    for d in ("bfloat16", "float32 fast"):
        p = out.get(f"{d.replace(' ', '_')}_minus_float32")
        if p is not None:
            out[f"{d.replace(' ', '_')}_within_1pt"] = None if p["ci_pt"] is None else bool(p["ci_pt"][0] > -1.0)
    out["within_1pt"] = out.get("bfloat16_within_1pt")
    return out


def run(ctx) -> dict:
    import torch

    import localdiff
    from localdiff.bench.eval_tasks import evaluate

    a = ctx.args
    n_seeds = a.seeds or SEEDS[bool(a.quick)]
    items = ctx.items(a.per_family or (3 if a.quick else None))
    torch_dtypes = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float32 fast": torch.float32,
        "float64": torch.float64,
    }
    models = {d: localdiff.load(a.model, device="cpu", dtype=torch_dtypes[d]) for d in DTYPES}
    fast = models["float32 fast"]
    fast.precision = dataclasses.replace(fast.precision, sampler="fast")  # as the AVX2 default for large models
    rows = []
    for k in range(n_seeds):
        row = {"seed": 1000 * k}
        for d, m in models.items():
            row[d] = evaluate(m, items, seed=row["seed"], batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)[
                "correct"
            ]
        ctx.log(f"precision: seed {row['seed']}: " + ", ".join(f"{d} {row[d]}/{len(items)}" for d in DTYPES))
        rows.append(row)
    sec = summarize(rows, len(items))
    sec["rows"] = rows
    sec["model"] = a.model
    sec["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return sec


def _ci(p: dict) -> str:
    if p["ci_pt"] is None:
        return f"{p['mean_pt']:+.2f} pt (one seed: no interval)"
    lo, hi = p["ci_pt"]
    return f"{p['mean_pt']:+.2f} pt (95 % CI {lo:+.2f} … {hi:+.2f})"


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section (see the module docstring)."""
    n, seeds = sec["n_items"], sec["seeds"]
    acc = sec["mean_accuracy"]
    b, c, f = sec["bfloat16_minus_float32"], sec["float64_minus_float32"], sec.get("float32_fast_minus_float32")
    verdict = {True: "**within 1 point**", False: "**not shown within 1 point**", None: "undecided (one seed)"}[
        sec["within_1pt"]
    ]
    lines = [
        f"### Precision on the embedded eval: bf16 fast path vs exact float32, paired over {len(seeds)} seeds",
        "",
        f"{n} items; seed bases {seeds[0]}…{seeds[-1]}; CPU capability {sec.get('cpu_capability', '?')}; "
        "float64 is the control (same math, more exact arithmetic, the fast sampler's random stream).",
        "",
        "| dtype | mean accuracy | vs float32 (paired, points) |",
        "|---|---:|---:|",
        f"| float32 (exact) | {100 * acc['float32']:.2f} % | — |",
        f"| bfloat16 | {100 * acc['bfloat16']:.2f} % | {_ci(b)} |",
    ]
    if f is not None:
        lines.append(f"| float32, fast sampler | {100 * acc['float32 fast']:.2f} % | {_ci(f)} |")
    lines += [
        f"| float64 (control) | {100 * acc['float64']:.2f} % | {_ci(c)} |",
        "",
        f"bf16 vs float32: {verdict}. Single-seed differences ranged {min(b['diffs']):+d} … {max(b['diffs']):+d}"
        f" items (float64 vs float32: {min(c['diffs']):+d} … {max(c['diffs']):+d}): one seed cannot tell a"
        " 1-point change from the decoder's chaos.",
    ]
    if f is not None:
        fv = {True: "within 1 point", False: "not shown within 1 point", None: "undecided"}[
            sec["float32_fast_within_1pt"]
        ]
        lines.append(f"float32 with the fast sampler vs exact float32: {fv}.")
    return lines + [""]
