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
"""
from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

CANVAS = 256
PROMPT = 64
VOCAB = 32768
REAL_VOCAB = 262144
#: name → (hidden, layers, heads, head_dim, global head_dim)
SHAPES = {"150M": (448, 6, 4, 128, 256), "1B": (1024, 9, 8, 128, 256), "smoke": (64, 2, 2, 32, 64)}   # smoke: tests


def text_config(hidden: int, layers: int, heads: int, head_dim: int, global_head_dim: int, vocab: int = VOCAB) -> dict:
    """A DiffusionGemma text_config with the flagship's proportions at ``hidden`` (see the module docstring)."""
    types = [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 4, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                global_head_dim=global_head_dim, num_global_key_value_heads=1, sliding_window=1024,
                num_experts=128, top_k_experts=8, moe_intermediate_size=hidden // 4, max_position_embeddings=8192,
                layer_types=types)


def build(folder: Path, text: dict, seed: int = 0) -> Path:
    """Save a random DiffusionGemma with ``text`` (canvas 256) in bf16 with transformers; returns ``folder``."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from localdiff.bench.ref import WIDE_VISION

    cfg = DiffusionGemmaConfig(text_config=dict(text), vision_config=dict(WIDE_VISION), canvas_length=CANVAS)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # initialised in bf16: no fp32 copy (1B: 8.1 → ~2.5 GiB peak)
    try:
        net = DiffusionGemmaForBlockDiffusion(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    net.save_pretrained(folder)
    del net
    gc.collect()
    return folder


def flops_per_step(text: dict, canvas: int = CANVAS, history: int = PROMPT, vocab: int | None = None) -> dict:
    """FLOPs (2 per multiply-add) of one canvas denoising step, by component, from the shapes: every canvas row runs
    q/k/v/o, attention over ``history`` + canvas keys (the window on sliding layers), the dense MLP, the router,
    its top-k experts, the self-conditioning MLP and soft-embedding product (vocab × hidden) and the LM head."""
    h, v = text["hidden_size"], vocab or text["vocab_size"]
    heads, kv, d, gd = (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"],
                        text["global_head_dim"])
    out = {"attention projections": 0, "attention scores": 0, "dense MLP": 0, "router": 0, "experts": 0}
    for ty in text["layer_types"]:
        sliding = ty == "sliding_attention"
        dd, kk = (d, kv) if sliding else (gd, text["num_global_key_value_heads"])
        keys = canvas + (min(history, text["sliding_window"]) if sliding else history)
        out["attention projections"] += h * heads * dd * 2 + h * kk * dd * (2 if sliding else 1)
        out["attention scores"] += 2 * heads * dd * keys
        out["dense MLP"] += 3 * h * text["intermediate_size"]
        out["router"] += h * text["num_experts"]
        out["experts"] += text["top_k_experts"] * 3 * h * text["moe_intermediate_size"]
    out["self-conditioning MLP"] = 3 * h * text["intermediate_size"]
    out["self-conditioning product"] = v * h
    out["LM head"] = v * h
    return {k: 2 * n * canvas for k, n in out.items()}


def expert_padding(text: dict, canvas: int = CANVAS, samples: int = 16) -> float:
    """How many expert rows localdiff's bf16 experts compute per row routed, the mean over ``samples`` uniform random
    routings (what a random model's router gives): with the native kernel (:mod:`localdiff.kernels.experts`)
    each expert's rows padded to its 16-row tile, else the stream kernel's
    (:func:`localdiff.arch.layers.stream_experts`) experts × the largest group, ÷ (canvas × top-k). The reference's grouped_mm computes the routed rows only
    (factor 1)."""
    from localdiff.kernels import experts as native_experts

    g = torch.Generator().manual_seed(0)
    e, k = text["num_experts"], text["top_k_experts"]
    f = []
    for _ in range(samples):
        flat = torch.rand(canvas, e, generator=g).topk(k, -1).indices.reshape(-1)
        rows = (native_experts.computed_rows(flat, e) if native_experts.library() is not None
                else e * int(torch.bincount(flat, minlength=e).max()))
        f.append(rows / (canvas * k))
    return sum(f) / len(f)


def _reset_peak_rss() -> None:
    """Reset this process's VmHWM to the current RSS (Linux ``/proc/self/clear_refs`` "5"), so the peak of each
    group of sides is its own; silently nothing elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _gemm_peak(dtype) -> float:
    """Best GFLOP/s of a 1024×2048×2048 GEMM (``dtype``) on this process's threads, by CPU time (a shared core's
    time-slicing left out, as in the steps' CPU ms the fractions divide), after ≥ 0.3 s of CPU time of warm-up: a
    cold core's first AMX GEMMs run at ~40 % of its rate (measured 374 vs 975 GFLOP/s bf16 on Sapphire Rapids)."""
    a, b = torch.randn(1024, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        torch.nn.functional.linear(a, b)
        best = min(best, time.process_time() - t0)
    return 2 * 1024 * 2048 * 2048 / best / 1e9


class _Side:
    """One configuration: a loaded model and its generate call."""

    def __init__(self, key: str, path: Path, steps: int):
        import localdiff
        from localdiff.bench.ref import _Counter, load_reference

        self.key = key
        impl, dtype = key.split(" ", 1)
        self.ref = impl == "reference"
        ld = localdiff.load(path, device="cpu", dtype=None if dtype == "default" else dtype)
        opts = ld.sampler_options(max_denoising_steps=steps)
        self.opts = {k: opts[k] for k in ("max_denoising_steps", "t_min", "t_max", "entropy_bound",
                                          "stability_threshold", "confidence_threshold")}
        self.eos, self.pad = ld.eos_token_ids, ld.pad_token_id
        if self.ref:
            from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

            self.dtype = dtype
            del ld          # free localdiff's copy before the reference loads (the 1B fp32 pair ran out of memory)
            gc.collect()
            self.net = load_reference(path) if dtype == "float32" else load_reference_dtype(path, dtype)
            self.counter = _Counter(self.net.model.decoder)
            o = self.opts
            self.kw = dict(max_denoising_steps=int(o["max_denoising_steps"]), t_min=float(o["t_min"]),
                           t_max=float(o["t_max"]), stability_threshold=int(o["stability_threshold"]),
                           confidence_threshold=float(o["confidence_threshold"]),
                           sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(o["entropy_bound"])),
                           eos_token_id=list(self.eos), pad_token_id=self.pad)
        else:
            self.net, self.dtype = ld, str(ld.dtype).removeprefix("torch.")
            self.precision = ld.precision.to_dict() if ld.precision else None
            self.kernels = ld.kernels() if hasattr(ld, "kernels") else {}
        mod = self.net if self.ref else self.net.net
        params = list(mod.parameters()) + list(mod.buffers())
        self.weight_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in params}.values())

    def run(self, ids: torch.Tensor, seed: int) -> dict:
        """One canvas: {"seconds" (wall), "cpu_seconds" (this process's CPU time: on a shared core it leaves out
        the time other processes held it), "forwards", "tokens"}."""
        c0, t0 = time.process_time(), time.perf_counter()
        if self.ref:
            self.counter.n = 0
            torch.manual_seed(seed)
            with torch.no_grad():
                out = self.net.generate(ids, max_new_tokens=CANVAS, **self.kw)
            sec = time.perf_counter() - t0
            from localdiff.bench.ref import normalize

            return {"seconds": sec, "cpu_seconds": time.process_time() - c0, "forwards": self.counter.n,
                    "tokens": len(normalize(out.sequences[0, ids.shape[1]:].tolist(), self.eos, self.pad))}
        g = self.net.generate(ids[0].tolist(), chat=False, seed=seed, max_new_tokens=CANVAS, **self.opts)
        return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                "forwards": g.stats.forwards, "tokens": len(g.token_ids)}


def load_reference_dtype(path: Path, dtype: str):
    """transformers' model for ``path`` in ``dtype`` (CPU, eval mode)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()


def _spread(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def _interleaved(sides: list[_Side], ids, reps: int, log, label: str) -> dict:
    for s in sides:                       # warm-up, not timed
        s.run(ids, 0)
    runs = {s.key: [] for s in sides}
    for r in range(reps):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for s in order:
            runs[s.key].append(s.run(ids, r))
        log(f"  [scale {label}] repetition {r + 1}/{reps}: " + ", ".join(
            f"{k} {1e3 * v[-1]['seconds'] / max(v[-1]['forwards'], 1):.0f} ms/step" for k, v in runs.items()))
    out = {"__per_rep__": [{k: v[r]["tokens"] / v[r]["seconds"] for k, v in runs.items()} for r in range(reps)]}
    out["__per_rep_cpu__"] = [{k: v[r]["tokens"] / v[r]["cpu_seconds"] for k, v in runs.items()} for r in range(reps)]
    for s in sides:
        rs = runs[s.key]
        out[s.key] = {"dtype": s.dtype, "weight_bytes": s.weight_bytes, "forwards": [x["forwards"] for x in rs],
                      "tokens": [x["tokens"] for x in rs],
                      "ms_per_step": _spread([1e3 * x["seconds"] / max(x["forwards"], 1) for x in rs]),
                      "cpu_ms_per_step": _spread([1e3 * x["cpu_seconds"] / max(x["forwards"], 1) for x in rs]),
                      "tokens_per_s": _spread([x["tokens"] / x["seconds"] for x in rs])}
        if not s.ref:
            out[s.key]["precision"], out[s.key]["kernels"] = s.precision, s.kernels
    return out


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
    peak = {"float32": _gemm_peak(torch.float32), "bfloat16": _gemm_peak(torch.bfloat16)}
    bw = roofline.bandwidth()
    res = {"bandwidth_gbs": bw / 1e9, "sizes": [], "canvas": CANVAS, "prompt_tokens": PROMPT, "steps": steps, "reps": reps,
           "precision_rule": choose_cpu_dtype("bfloat16", None).to_dict(),
           "notes": ["ms/step = wall time of one canvas generation ÷ decoder forwards (prefill and sampler "
                     "included); CPU ms/step the same in this process's CPU time (what the fraction of GEMM peak "
                     "divides); random weights: every canvas runs the step cap"]}
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
                _reset_peak_rss()
                sides = [_Side(k, path, steps) for k in group]
                got = _interleaved(sides, ids, reps, log, name)
                for r, (tps, cps) in enumerate(zip(got.pop("__per_rep__"), got.pop("__per_rep_cpu__"))):
                    per_rep[r].update(tps)
                    per_rep_cpu[r].update(cps)
                runs.update(got)
                for s in sides:   # untimed: one more canvas per side under the FLOP counter
                    runs[s.key]["flops_check"] = scale_flops.cross_check(s, ids, text, flops_per_step(text), PROMPT)
                group_peaks.append({"sides": group, "peak_rss_bytes": _peak_rss()})
                del sides
                gc.collect()
        res["sizes"].append(_summarize(name, text, runs, peak, per_rep, per_rep_cpu))
        res["sizes"][-1]["group_peak_rss"] = group_peaks
        if runs["localdiff default"]["dtype"] == "bfloat16":
            log(f"  [scale {name}] roofline: the step's components timed alone")
            res["sizes"][-1]["roofline"] = (roofline.components(text, CANVAS, PROMPT),
                                            runs["localdiff default"]["cpu_ms_per_step"]["median"] / 1e3)
    if not quick:
        rv = text_config(*SHAPES["150M"], vocab=REAL_VOCAB)
        res["flops_real_vocab"] = scale_flops.real_vocab("150M", rv, build, lambda k, p: _Side(k, p, steps), ids,
                                                         PROMPT, flops_per_step(rv), log)
    peak2 = {"float32": _gemm_peak(torch.float32), "bfloat16": _gemm_peak(torch.bfloat16)}
    res["peak_gflops"] = {k: max(peak[k], peak2[k]) for k in peak}
    res["peak_rss_bytes"] = max([_peak_rss() or 0] + [g["peak_rss_bytes"] or 0 for s in res["sizes"]
                                                       for g in s["group_peak_rss"]])
    for s in res["sizes"]:   # fractions against the larger of the two peak measurements, roofline too
        if "roofline" in s:
            comps, step_s = s["roofline"]
            s["roofline"] = roofline.analyse(comps, res["peak_gflops"]["bfloat16"] * 1e9, bw, step_s)
        for r in s["runs"].values():
            r["fraction_of_peak"] = s["flops_per_step"] / (r["cpu_ms_per_step"]["median"] / 1e3) / \
                (res["peak_gflops"][r["dtype"]] * 1e9)
    return res


def _summarize(name: str, text: dict, runs: dict, peak: dict, per_rep: list[dict] | None = None,
               per_rep_cpu: list[dict] | None = None) -> dict:
    from localdiff.arch.diffusion_gemma_spec import parameter_counts

    fl = flops_per_step(text)
    real = flops_per_step(text, vocab=REAL_VOCAB)
    counts = parameter_counts({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": CANVAS})
    tps = {k: v["tokens_per_s"]["median"] for k, v in runs.items()}
    best_ld = max((k for k in tps if k.startswith("localdiff")), key=tps.get)
    best_ref = max((k for k in tps if k.startswith("reference")), key=tps.get)
    return {"name": name, "text_config": text, "parameters": counts["total"], "active": counts["active_per_token"],
            "flops_per_step": sum(fl.values()), "flops_by_component": fl,
            # what localdiff's bf16 default computes: the experts' zero-padded groups included
            "expert_padding": (pad := expert_padding(text)),
            "flops_per_step_localdiff_bf16": sum(fl.values()) + (pad - 1) * fl["experts"],
            "flops_per_step_real_vocab": sum(real.values()),
            "vocab_share_real_vocab": (real["LM head"] + real["self-conditioning product"]) / sum(real.values()),
            "runs": runs, "best": {"localdiff": best_ld, "reference": best_ref},
            "ratio_best": tps[best_ld] / tps[best_ref],
            # the same two configurations' ratio within each repetition (interleaved neighbours: load shared)
            "ratio_best_per_rep": _spread([r[best_ld] / r[best_ref] for r in per_rep or []]) if per_rep else None,
            # the same ratio in tokens per CPU-second (robust to time-slicing on a shared core)
            "ratio_best_cpu_per_rep": (_spread([r[best_ld] / r[best_ref] for r in per_rep_cpu])
                                       if per_rep_cpu else None),
            "ratio_same_dtype": {d: tps[ld] / tps[f"reference {d}"] for d in ("bfloat16", "float32")
                                 for ld in [next((k for k in tps if k.startswith("localdiff")
                                                  and runs[k]["dtype"] == d), None)] if ld}}


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    from localdiff.bench import roofline, scale_flops

    out = ["### Real model sizes: DiffusionGemma with the flagship's proportions (random weights, canvas "
           f"{sec['canvas']}, prompt {sec['prompt_tokens']}, {sec['steps']} steps per canvas, {sec['reps']} "
           "repetitions interleaved)", "",
           f"GEMM peak measured: fp32 {sec['peak_gflops']['float32']:.0f}, bf16 {sec['peak_gflops']['bfloat16']:.0f}"
           f" GFLOP/s. localdiff's default: {sec['precision_rule']['dtype']} "
           f"({sec['precision_rule']['reason']}; CPU {sec['precision_rule']['cpu_capability']}, bf16 instructions "
           f"{', '.join(sec['precision_rule']['bf16_instructions']) or 'none'}). Peak RSS of the run: "
           f"{(sec.get('peak_rss_bytes') or 0) / 2**30:.1f} GiB.", ""]
    out += [f"- {n}" for n in sec.get("notes", [])]
    for s in sec["sizes"]:
        out += ["", f"**{s['name']}** ({s['parameters'] / 1e6:.0f}M parameters, {s['active'] / 1e6:.0f}M active): "
                    f"{s['flops_per_step'] / 1e9:.1f} GFLOP per step ({s['flops_per_step_real_vocab'] / 1e9:.1f} at "
                    f"vocab 262,144, where at this hidden size the LM head + self-conditioning product are "
                    f"{s['vocab_share_real_vocab']:.0%}; the reference computes these, localdiff's bf16 experts "
                    f"~{s.get('expert_padding', 1):.2f}× the routed rows (zero-padded groups or 16-row tiles, "
                    "estimated for a uniform "
                    "routing; the counted FLOPs below are what this model's routing gave): "
                    f"{s.get('flops_per_step_localdiff_bf16', s['flops_per_step']) / 1e9:.1f} GFLOP); "
                    "best localdiff ÷ best reference tokens/s: "
                    f"**{s['ratio_best']:.2f}×** ({s['best']['localdiff']} vs {s['best']['reference']}"
                    + (f"; per repetition median {pr['median']:.2f}×, range {pr['min']:.2f}–{pr['max']:.2f}×"
                       if (pr := s.get("ratio_best_per_rep")) else "")
                    + (f"; by CPU time per repetition median {pc['median']:.2f}×, range {pc['min']:.2f}–"
                       f"{pc['max']:.2f}×" if (pc := s.get("ratio_best_cpu_per_rep")) else "") + "); same dtype: "
                    + ", ".join(f"{d} {r:.2f}×" for d, r in s["ratio_same_dtype"].items()) + ". Peak RSS: "
                    + "; ".join(f"{' + '.join(g['sides'])} {(g['peak_rss_bytes'] or 0) / 2**30:.1f} GiB"
                                for g in s.get("group_peak_rss", [])), "",
                "| configuration | dtype | ms/step | CPU ms/step | tokens/s | forwards | fraction of GEMM peak | "
                "weights (MiB) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for k, r in s["runs"].items():
            ms, tp = r["ms_per_step"], r["tokens_per_s"]
            cm = r.get("cpu_ms_per_step") or ms
            out.append(f"| {k} | {r['dtype']} | {ms['median']:.0f} ({ms['min']:.0f}–{ms['max']:.0f}) | "
                       f"{cm['median']:.0f} ({cm['min']:.0f}–{cm['max']:.0f}) | "
                       f"{tp['median']:.1f} ({tp['min']:.1f}–{tp['max']:.1f}) | {sorted(set(r['forwards']))} | "
                       f"{r.get('fraction_of_peak', 0):.0%} | {r['weight_bytes'] / 2**20:.0f} |")
        checks = {k: r["flops_check"] for k, r in s["runs"].items() if "flops_check" in r}
        if checks:
            out += [""] + scale_flops.render_md(checks, f"{s['name']}, vocab {s['text_config']['vocab_size']:,}")
        if s.get("roofline"):
            out += [""] + roofline.render_md(s["roofline"])
    if sec.get("flops_real_vocab"):
        rv = sec["flops_real_vocab"]
        out += [""] + scale_flops.render_md({k: v for k, v in rv.items() if isinstance(v, dict)},
                                            f"{rv['name']} at the real vocab {rv['vocab']:,} (not timed)")
    return out
