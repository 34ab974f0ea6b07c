"""``localdiff bench --only scale``: DiffusionGemma at real model sizes — localdiff's default vs the reference
(transformers 5.23 ``DiffusionGemmaForBlockDiffusion.generate``) in bf16 and fp32, side by side in one run.

Random-weight checkpoints with the flagship's proportions (google/diffusiongemma-26B-A4B: 128 experts top-8, expert
width hidden/4, dense MLP 0.75·hidden, five sliding layers then one global, tied embeddings), stored in bf16 as the
real checkpoints are: ``150M`` (hidden 448, 6 layers) and ``1B`` (hidden 1024, 9 layers; full runs only), vocab
32,768, canvas 256. Per configuration (localdiff default = the dtype :mod:`localdiff.capability` picks; localdiff
fp32; reference bf16; reference fp32): ms per denoising step (wall time ÷ decoder forwards, prefill included) and
tokens/s of one canvas at the model's default sampler with the step cap of ``--random-steps`` (random weights never
converge, so every canvas runs the cap; both sides get the same settings and seed), median and range over
repetitions, interleaved (the order rotates every repetition). The 1B model's bf16 and fp32 pairs run one after the
other (all four copies would not fit in this machine's memory), each pair interleaved.

Also: FLOPs per canvas step from the shapes (at vocab 32,768 and at the real 262,144 for the head arithmetic), the
fraction of this CPU's measured GEMM peak in the precision used, resident weight bytes and the process's peak RSS;
the FLOPs every side actually executes, counted op by op by :mod:`localdiff.bench.scale_flops` (one more canvas per
side, untimed; in full runs also for the 150M shape at the real vocabulary); and for a bf16 default the roofline
of the step's components (:mod:`localdiff.bench.roofline`: what fraction of peak each reaches and could reach).
The models and their arithmetic: :mod:`localdiff.bench.scale_shapes`; the sides and this machine's measures (GEMM
peak, peak RSS): :mod:`localdiff.bench.scale_sides`.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch

from localdiff.bench.scale_shapes import (  # noqa: F401  (re-exported: the section's shapes, as other benches use them)
    CANVAS,
    PROMPT,
    REAL_VOCAB,
    SHAPES,
    VOCAB,
    build,
    expert_padding,
    flops_per_step,
    text_config,
)
from localdiff.bench.scale_sides import Side, gemm_peak, interleaved, peak_rss, reset_peak_rss, spread


def run(ctx) -> dict:
    """The section as ``localdiff bench`` runs it (``ctx.args``: ``--quick``, ``--random-steps``, ``--reps``)."""
    return measure(ctx.args.quick, steps=ctx.args.random_steps, reps=ctx.args.reps, log=ctx.log)


def measure(quick: bool, steps: int = 4, reps: int | None = None, sizes: list[str] | None = None, log=print) -> dict:
    """Run the section (module docstring). Returns {"sizes": [per size: config, parameters, FLOPs, runs, ratios],
    "peak_gflops", "notes"}. Raises LocaldiffError when transformers' DiffusionGemma is unavailable."""
    from localdiff.bench import roofline, scale_flops
    from localdiff.bench.ref import transformers_available
    from localdiff.capability import choose_cpu_dtype
    from localdiff.errors import LocaldiffError

    why = transformers_available()
    if why:
        raise LocaldiffError(why)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    reps = reps or (2 if quick else 3)
    sizes = sizes or (["150M"] if quick else ["150M", "1B"])
    peak = {"float32": gemm_peak(torch.float32), "bfloat16": gemm_peak(torch.bfloat16)}
    bw = roofline.bandwidth()
    res = {
        "bandwidth_gbs": bw / 1e9,
        "sizes": [],
        "canvas": CANVAS,
        "prompt_tokens": PROMPT,
        "steps": steps,
        "reps": reps,
        "precision_rule": choose_cpu_dtype("bfloat16", None).to_dict(),
        "notes": [
            "ms/step = wall time of one canvas generation ÷ decoder forwards (prefill and sampler "
            "included); CPU ms/step the same in this process's CPU time (what the fraction of GEMM peak "
            "divides); random weights: every canvas runs the step cap"
        ],
    }
    gen = torch.Generator().manual_seed(0)
    for name in sizes:
        text = text_config(*SHAPES[name])
        with tempfile.TemporaryDirectory(prefix="localdiff-scale-") as tmp:
            log(f"  [scale {name}] building the random checkpoint")
            path = build(Path(tmp), text)
            ids = torch.randint(10, VOCAB, (1, PROMPT), generator=gen)
            keys = ["localdiff default", "localdiff float32", "reference bfloat16", "reference float32"]
            groups = [keys] if name != "1B" else [[keys[0], keys[2]], [keys[1], keys[3]]]
            runs: dict = {}
            per_rep: list[dict] = [{} for _ in range(reps)]
            per_rep_cpu: list[dict] = [{} for _ in range(reps)]
            group_peaks = []
            for group in groups:
                gc.collect()
                reset_peak_rss()
                sides = [Side(k, path, steps) for k in group]
                got = interleaved(sides, ids, reps, log, name)
                for r, (tps, cps) in enumerate(zip(got.pop("__per_rep__"), got.pop("__per_rep_cpu__"))):
                    per_rep[r].update(tps)
                    per_rep_cpu[r].update(cps)
                runs.update(got)
                for s in sides:  # untimed: one more canvas per side under the FLOP counter
                    runs[s.key]["flops_check"] = scale_flops.cross_check(s, ids, text, flops_per_step(text), PROMPT)
                group_peaks.append({"sides": group, "peak_rss_bytes": peak_rss()})
                del sides
                gc.collect()
        res["sizes"].append(_summarize(name, text, runs, peak, per_rep, per_rep_cpu))
        res["sizes"][-1]["group_peak_rss"] = group_peaks
        if runs["localdiff default"]["dtype"] == "bfloat16":
            log(f"  [scale {name}] roofline: the step's components timed alone")
            res["sizes"][-1]["roofline"] = (
                roofline.components(text, CANVAS, PROMPT),
                runs["localdiff default"]["cpu_ms_per_step"]["median"] / 1e3,
            )
    if not quick:
        rv = text_config(*SHAPES["150M"], vocab=REAL_VOCAB)
        res["flops_real_vocab"] = scale_flops.real_vocab(
            "150M", rv, build, lambda k, p: Side(k, p, steps), ids, PROMPT, flops_per_step(rv), log
        )
    peak2 = {"float32": gemm_peak(torch.float32), "bfloat16": gemm_peak(torch.bfloat16)}
    res["peak_gflops"] = {k: max(peak[k], peak2[k]) for k in peak}
    res["peak_rss_bytes"] = max(
        [peak_rss() or 0] + [g["peak_rss_bytes"] or 0 for s in res["sizes"] for g in s["group_peak_rss"]]
    )
    for s in res["sizes"]:  # fractions against the larger of the two peak measurements, roofline too
        if "roofline" in s:
            comps, step_s = s["roofline"]
            s["roofline"] = roofline.analyse(comps, res["peak_gflops"]["bfloat16"] * 1e9, bw, step_s)
        for r in s["runs"].values():
            r["fraction_of_peak"] = (
                s["flops_per_step"] / (r["cpu_ms_per_step"]["median"] / 1e3) / (res["peak_gflops"][r["dtype"]] * 1e9)
            )
    return res


def _summarize(
    name: str,
    text: dict,
    runs: dict,
    peak: dict,
    per_rep: list[dict] | None = None,
    per_rep_cpu: list[dict] | None = None,
) -> dict:
    from localdiff.arch.diffusion_gemma_spec import parameter_counts

    fl = flops_per_step(text)
    real = flops_per_step(text, vocab=REAL_VOCAB)
    counts = parameter_counts({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": CANVAS})
    tps = {k: v["tokens_per_s"]["median"] for k, v in runs.items()}
    best_ld = max((k for k in tps if k.startswith("localdiff")), key=tps.get)
    best_ref = max((k for k in tps if k.startswith("reference")), key=tps.get)
    return {
        "name": name,
        "text_config": text,
        "parameters": counts["total"],
        "active": counts["active_per_token"],
        "flops_per_step": sum(fl.values()),
        "flops_by_component": fl,
        # what localdiff's bf16 default computes: the experts' zero-padded groups included
        "expert_padding": (pad := expert_padding(text)),
        "flops_per_step_localdiff_bf16": sum(fl.values()) + (pad - 1) * fl["experts"],
        "flops_per_step_real_vocab": sum(real.values()),
        "vocab_share_real_vocab": (real["LM head"] + real["self-conditioning product"]) / sum(real.values()),
        "runs": runs,
        "best": {"localdiff": best_ld, "reference": best_ref},
        "ratio_best": tps[best_ld] / tps[best_ref],
        # the same two configurations' ratio within each repetition (interleaved neighbours: load shared)
        "ratio_best_per_rep": spread([r[best_ld] / r[best_ref] for r in per_rep or []]) if per_rep else None,
        # the same ratio in tokens per CPU-second (robust to time-slicing on a shared core)
        "ratio_best_cpu_per_rep": (spread([r[best_ld] / r[best_ref] for r in per_rep_cpu]) if per_rep_cpu else None),
        "ratio_same_dtype": {
            d: tps[ld] / tps[f"reference {d}"]
            for d in ("bfloat16", "float32")
            for ld in [next((k for k in tps if k.startswith("localdiff") and runs[k]["dtype"] == d), None)]
            if ld
        },
    }


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    from localdiff.bench import roofline, scale_flops

    out = [
        "### Real model sizes: DiffusionGemma with the flagship's proportions (random weights, canvas "
        f"{sec['canvas']}, prompt {sec['prompt_tokens']}, {sec['steps']} steps per canvas, {sec['reps']} "
        "repetitions interleaved)",
        "",
        f"GEMM peak measured: fp32 {sec['peak_gflops']['float32']:.0f}, bf16 {sec['peak_gflops']['bfloat16']:.0f}"
        f" GFLOP/s. localdiff's default: {sec['precision_rule']['dtype']} "
        f"({sec['precision_rule']['reason']}; CPU {sec['precision_rule']['cpu_capability']}, bf16 instructions "
        f"{', '.join(sec['precision_rule']['bf16_instructions']) or 'none'}). Peak RSS of the run: "
        f"{(sec.get('peak_rss_bytes') or 0) / 2**30:.1f} GiB.",
        "",
    ]
    out += [f"- {n}" for n in sec.get("notes", [])]
    for s in sec["sizes"]:
        out += [
            "",
            f"**{s['name']}** ({s['parameters'] / 1e6:.0f}M parameters, {s['active'] / 1e6:.0f}M active): "
            f"{s['flops_per_step'] / 1e9:.1f} GFLOP per step ({s['flops_per_step_real_vocab'] / 1e9:.1f} at "
            f"vocab 262,144, where at this hidden size the LM head + self-conditioning product are "
            f"{s['vocab_share_real_vocab']:.0%}; the reference computes these, localdiff's bf16 experts "
            f"~{s.get('expert_padding', 1):.2f}× the routed rows (zero-padded groups or 16-row tiles, "
            "estimated for a uniform "
            "routing; the counted FLOPs below are what this model's routing gave): "
            f"{s.get('flops_per_step_localdiff_bf16', s['flops_per_step']) / 1e9:.1f} GFLOP); "
            "best localdiff ÷ best reference tokens/s: "
            f"**{s['ratio_best']:.2f}×** ({s['best']['localdiff']} vs {s['best']['reference']}"
            + (
                f"; per repetition median {pr['median']:.2f}×, range {pr['min']:.2f}–{pr['max']:.2f}×"
                if (pr := s.get("ratio_best_per_rep"))
                else ""
            )
            + (
                f"; by CPU time per repetition median {pc['median']:.2f}×, range {pc['min']:.2f}–{pc['max']:.2f}×"
                if (pc := s.get("ratio_best_cpu_per_rep"))
                else ""
            )
            + "); same dtype: "
            + ", ".join(f"{d} {r:.2f}×" for d, r in s["ratio_same_dtype"].items())
            + ". Peak RSS: "
            + "; ".join(
                f"{' + '.join(g['sides'])} {(g['peak_rss_bytes'] or 0) / 2**30:.1f} GiB"
                for g in s.get("group_peak_rss", [])
            ),
            "",
            "| configuration | dtype | ms/step | CPU ms/step | tokens/s | forwards | fraction of GEMM peak | "
            "weights (MiB) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for k, r in s["runs"].items():
            ms, tp = r["ms_per_step"], r["tokens_per_s"]
            cm = r.get("cpu_ms_per_step") or ms
            out.append(
                f"| {k} | {r['dtype']} | {ms['median']:.0f} ({ms['min']:.0f}–{ms['max']:.0f}) | "
                f"{cm['median']:.0f} ({cm['min']:.0f}–{cm['max']:.0f}) | "
                f"{tp['median']:.1f} ({tp['min']:.1f}–{tp['max']:.1f}) | {sorted(set(r['forwards']))} | "
                f"{r.get('fraction_of_peak', 0):.0%} | {r['weight_bytes'] / 2**20:.0f} |"
            )
        checks = {k: r["flops_check"] for k, r in s["runs"].items() if "flops_check" in r}
        if checks:
            out += [""] + scale_flops.render_md(checks, f"{s['name']}, vocab {s['text_config']['vocab_size']:,}")
        if s.get("roofline"):
            out += [""] + roofline.render_md(s["roofline"])
    if sec.get("flops_real_vocab"):
        rv = sec["flops_real_vocab"]
        out += [""] + scale_flops.render_md(
            {k: v for k, v in rv.items() if isinstance(v, dict)},
            f"{rv['name']} at the real vocab {rv['vocab']:,} (not timed)",
        )
    return out
