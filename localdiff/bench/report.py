"""`localdiff bench` output: the Markdown report from the results dict, and the README section between markers."""

from __future__ import annotations

from pathlib import Path

from localdiff.errors import UsageError

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _mb(b) -> str:
    return "—" if b is None else f"{b / 2**20:.1f}"


def _sp(d: dict | None, fmt: str = "{:.1f}") -> str:
    if not d:
        return "—"
    return (fmt + " (" + fmt + "–" + fmt + ")").format(d["median"], d["min"], d["max"])


def _ref_md(sec: dict) -> list[str]:
    out = ["### Reference comparison (localdiff vs transformers `generate`, same weights, settings and seeds)", ""]
    out += [f"- {n}" for n in sec.get("notes", [])]
    for run in sec.get("runs", []):
        s, st = run["summary"], run["settings"]
        out += [
            "",
            f"**{run['model']}** ({run['parameters'] / 1e6:.1f} M parameters, canvas {run['canvas_length']}, "
            f"max_new_tokens {st['max_new_tokens']}, {st['max_denoising_steps']} steps max, "
            f"entropy bound {st['entropy_bound']}, {st['reps']} repetitions, localdiff "
            f"{st.get('localdiff_dtype', 'float32')} vs reference float32): identical tokens on "
            f"{s['identical_seeds']}/{s['seeds']} seeds; speed ratio (identical seeds, median and range) "
            f"**{_sp(s['speed_ratio'], '{:.2f}')}×**",
            "",
            "| seed | identical | forwards ref / ld | TPF ref / ld | tokens/s ref | tokens/s localdiff "
            "| ms/step ref | ms/step localdiff | ratio |",
            "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in run["seeds"]:
            out.append(
                f"| {r['seed']} | {'yes' if r['identical'] else 'no (from token %d)' % r['first_difference']} "
                f"| {r['forwards']['ref']} / {r['forwards']['localdiff']} "
                f"| {r['tpf']['ref']:.2f} / {r['tpf']['localdiff']:.2f} "
                f"| {_sp(r['tokens_per_s']['ref'])} | {_sp(r['tokens_per_s']['localdiff'])} "
                f"| {_sp(r['ms_per_step']['ref'])} | {_sp(r['ms_per_step']['localdiff'])} "
                f"| {_sp(r['speed_ratio'], '{:.2f}')} |"
            )
    return out


def _eval_md(sec: dict) -> list[str]:
    d = sec["default"]
    out = [
        "### Embedded model: exact match on held-out items (default sampler)",
        "",
        f"Overall **{d['accuracy']:.1%}** ({d['correct']}/{d['n']}), TPF **{d['tpf']:.2f}**, "
        f"{d['seconds']:.1f} s. Sampler: " + ", ".join(f"{k}={v}" for k, v in d["sampler"].items()),
        "",
        "| family | exact match | n | TPF |",
        "|---|---:|---:|---:|",
    ]
    for fam, v in d["per_family"].items():
        out.append(f"| {fam} | {v['accuracy']:.1%} | {v['n']} | {v['tpf']:.2f} |")
    return out


def _sweep_md(sec: dict) -> list[str]:
    out = [
        "### Quality vs speed (acceptance settings; other settings = the model's defaults)",
        "",
        f"{sec['items']} items ({sec['per_family']} per family).",
        "",
        "| setting | accuracy | TPF | seconds |",
        "|---|---:|---:|---:|",
    ]
    for r in sorted(sec["rows"], key=lambda r: (-r["accuracy"], -r["tpf"])):
        out.append(f"| {r['label']} | {r['accuracy']:.1%} | {r['tpf']:.2f} | {r['seconds']:.1f} |")
    b = sec.get("best")
    if b:
        out += [
            "",
            f"Best accuracy-per-TPF point: **{b['label']}** (accuracy {b['accuracy']:.1%}, TPF {b['tpf']:.2f}; "
            f"rule: {b['rule']}). Pareto frontier: {', '.join(b['pareto'])}.",
        ]
    if sec.get("plot"):
        out += ["", f"Plot: `{sec['plot']}`"]
    return out


def _history_md(sec: dict, level: str = "###") -> list[str]:
    budgets = sorted({k for r in sec["rows"] for k in r["cached_ms"]}, key=lambda k: (k != "unlimited", k))
    model = f"{sec['model']}, " if sec.get("model") else ""
    out = [
        f"{level} Denoising step vs history length ({model}canvas {sec['canvas_length']}; ms, best of N / median)",
        "",
        "| history tokens | "
        + " | ".join(f"block cache, device budget {b}" for b in budgets)
        + " | recompute prefix every step | recompute ÷ cache | attention alone (best) |",
        "|---:|" + "---:|" * (len(budgets) + 3),
    ]
    for r in sec["rows"]:
        cells = [
            f"{r['cached_min_ms'][b]:.1f} / {r['cached_ms'][b]:.1f}" if b in r["cached_ms"] else "—" for b in budgets
        ]
        out.append(
            f"| {r['history']} | "
            + " | ".join(cells)
            + f" | {r['recompute_min_ms']:.1f} / {r['recompute_ms']:.1f} | {r['recompute_vs_cached']:.1f}× | "
            + (f"{r['attention_min_ms']:.1f} |" if "attention_min_ms" in r else "— |")
        )
    for k, v in sec.items():
        if k.startswith("rest_ratio_"):
            lo, hi = k.split("_")[4], k.split("_")[2]
            out += [
                "",
                f"The same {hi} ÷ {lo} ratio without the step's attention (cached step − attention alone): "
                f"**{v:.2f}×** — "
                "what the cache itself adds with history; attention FLOPs grow linearly with history.",
            ]
        elif k.startswith("ratio_"):
            lo, hi = k.split("_")[3], k.split("_")[1]
            out += [
                "",
                f"Cached step time (best of N, unlimited budget), {hi} ÷ {lo} tokens of history: "
                f"**{v:.2f}×** (target ≤ 1.5×).",
            ]
    out += [f"- {n}" for n in sec.get("notes", [])]
    for other in sec.get("others", []):
        if other.get("rows"):
            out += [""] + _history_md(other, "####")
    return out


def _memory_md(sec: dict) -> list[str]:
    out = [
        "### Memory (each load in a fresh process)",
        "",
        "| load | weights (MiB) | RSS growth: load (MiB) | load + generation (MiB) | peak RSS (MiB) "
        "| CUDA peak (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        name = f"{r['dtype']}" + ("" if r.get("quant") in (None, "none") else f" + {r['quant']}") + f" ({r['device']})"
        if "skipped" in r:
            out.append(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        out.append(
            f"| {name} | {_mb(r['weight_bytes'])} | {_mb(r.get('rss_growth_load'))} "
            f"| {_mb(r.get('rss_growth_total'))} | {_mb(r['peak_rss_after_generate'])} "
            f"| {_mb(r.get('cuda_peak_allocated'))} |"
        )
    return out


def _profile_md(sec: dict) -> list[str]:
    sp = sec["split_ms"]
    out = [
        "### Profile of one generation (embedded model)",
        "",
        f"{sec['forwards']} forwards, {sec['wall_ms']:.1f} ms: plain denoising steps {sp['denoise']:.1f} ms, fused "
        f"prefill + first step {sp['prefill']:.1f} ms, sampler loop {sp['loop']:.1f} ms "
        f"({sec['ms_per_step']:.1f} ms per step).",
        "",
        "| op | self CPU (ms) | share | calls |",
        "|---|---:|---:|---:|",
    ]
    for r in sec["top"][:10]:
        out.append(f"| `{r['op']}` | {r['self_cpu_ms']:.1f} | {r['share']:.1%} | {r['calls']} |")
    return out


def _targets_md(secs: dict, quick: bool = False) -> list[str]:
    """#9's targets with the measured values of this run (only those whose sections ran). A quick run's figures
    (shorter histories, a 27-item sweep) are shown but do not decide a target ("—")."""
    rows = []
    for run in (secs.get("ref") or {}).get("runs", []):
        r = run["summary"].get("speed_ratio")
        if run["model"].startswith("embedded") and r:
            rows.append(
                (
                    "speed vs the reference, embedded model, identical tokens",
                    "≥ 2× (goal 3×)",
                    f"{r['median']:.2f}× on {run['summary']['identical_seeds']}/{run['summary']['seeds']} seeds",
                    r["median"] >= 2,
                )
            )
    hist = secs.get("history") or {}
    for sec in [hist, *hist.get("others", [])]:
        for k, v in sec.items():
            if k.startswith("ratio_"):
                rest = sec.get("rest_" + k)
                got = f"{v:.2f}×" + (f" ({rest:.2f}× without the step's attention)" if rest else "")
                hi, lo = k.split("_")[1], k.split("_")[3]
                rows.append(
                    (
                        f"step time, {hi} ÷ {lo} tokens of history ({sec.get('model', 'embedded')})",
                        "≤ 1.5× at 8192 ÷ 256",
                        got,
                        (v <= 1.5) if (hi, lo) == ("8192", "256") else None,
                    )
                )
    best = (secs.get("sweep") or {}).get("best")
    if best:
        rows.append(
            (
                "generation_config defaults = best accuracy-per-TPF point",
                "the default wins",
                best["label"],
                None if quick else best["label"] == "default",
            )
        )
    if not rows:
        return []
    met = {True: "yes", False: "no", None: "— (not this run's sizes)"}
    return (
        ["| target | wanted | this run | met |", "|---|---|---|:---:|"]
        + [f"| {a} | {b} | {c} | {met[ok]} |" for a, b, c, ok in rows]
        + [""]
    )


def _own_md(name: str):
    """The Markdown renderer of a section in its own file: ``localdiff.bench.<name>.render_md(sec) -> [lines]``."""
    from importlib import import_module

    return import_module(f"localdiff.bench.{name.replace('-', '_')}").render_md


def render(res: dict) -> str:
    """Markdown for a results dict (sections that did not run are listed with their reason)."""
    env = res["environment"]
    n = env["threads"]
    lines = [
        f"## `localdiff bench{' --quick' if res['quick'] else ''}` results",
        "",
        f"{env['date']} · torch {env['torch']} · {n} thread{'s' if n != 1 else ''} (torch.set_num_threads) · "
        f"{env['cpu']} · device {env['device']} · duration {res['duration_s']:.0f} s",
        "",
    ]
    load, cores = env.get("load_average_1min"), env.get("cpu_count") or 1
    if load is not None and load > 0.75 * cores:
        lines += [
            f"> Warning: the machine was busy (1-min load average {load:.1f} on {cores} cores) — absolute "
            "times are inflated and noisy, most with more than one thread; compare the interleaved ratios.",
            "",
        ]
    lines += _targets_md(res["sections"], bool(res.get("quick")))
    render_fns = {
        "ref": _ref_md,
        "eval": _eval_md,
        "sweep": _sweep_md,
        "history": _history_md,
        "memory": _memory_md,
        "profile": _profile_md,
    }
    for name in list(render_fns) + [n for n in res["sections"] if n not in render_fns]:
        fn = render_fns.get(name) or _own_md(name)
        sec = res["sections"].get(name)
        if sec is None:
            continue
        if "skipped" in sec:
            lines += [f"- {name}: skipped ({sec['skipped']})", ""]
            continue
        lines += fn(sec) + [""]
    return "\n".join(lines).rstrip() + "\n"


def replace_readme_section(readme: Path, md: str) -> bool:
    """Replace the text between the bench markers of ``readme`` with ``md``. Returns False when the markers were
    missing and the section was appended at the end instead.

    Raises:
        UsageError: the file does not exist, has only one of the two markers, or has them out of order.
    """
    if not readme.is_file():
        raise UsageError(f"--readme: {readme} does not exist")
    text = readme.read_text(encoding="utf-8")
    block = f"{START}\n{md.rstrip()}\n{END}"
    if (START in text) != (END in text):  # half a pair: appending would leave a third marker
        have, lack = (START, END) if START in text else (END, START)
        raise UsageError(f"--readme: {readme} has {have} but no {lack}; add it where the section ends")
    if START in text and END in text:
        a, b = text.index(START), text.index(END)
        if b < a:
            raise UsageError(f"--readme: {END} comes before {START} in {readme}")
        readme.write_text(text[:a] + block + text[b + len(END) :], encoding="utf-8")
        return True
    readme.write_text(text.rstrip("\n") + "\n\n## Benchmarks\n\n" + block + "\n", encoding="utf-8")
    return False
