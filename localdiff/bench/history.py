"""`localdiff bench` sections 3 and 6: denoising-step time vs history length, and a profile of the step.

History scaling: a history of L random tokens is prefilled once into a cache, then one denoising step (decoder
forward over a canvas, with self-conditioning) is timed — with the block cache (history read from the cache) and
with the prefix recomputed every step (a fresh cache, prefill of the whole history, then the step), and with the
cache's device budget at zero (everything offloaded to the host tier) and unlimited.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time

import torch


def _new_cache(m, budget):
    """m.new_cache with a device budget when the cache supports one; (cache, note)."""
    try:
        params = inspect.signature(m.new_cache).parameters
    except (TypeError, ValueError):
        params = {}
    if "device_budget_bytes" not in params:
        return m.new_cache(), "new_cache() takes no device budget"
    return m.new_cache(device_budget_bytes=budget), None


def _canvas_inputs(m, gen):
    c, v = m.config.canvas_length, m.config.vocab_size
    canvas = torch.randint(0, v, (1, c), generator=gen).to(m.device)
    sc = torch.randn(1, c, v, generator=gen).to(m.device)
    return canvas, sc


def _sync(m):
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)


def step_ms(m, cache, canvas, sc, n: int, warm: bool = True) -> list[float]:
    """Times (ms) of ``n`` denoising steps reading ``cache`` (after one untimed warm-up step when ``warm``)."""
    if warm:
        m.denoise(canvas, cache, sc)
    out = []
    for _ in range(n):
        _sync(m)
        t0 = time.perf_counter()
        m.denoise(canvas, cache, sc)
        _sync(m)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def _recompute_ms(m, hist, canvas, sc) -> float:
    _sync(m)
    t0 = time.perf_counter()
    cache, _ = _new_cache(m, None)
    m.prefill(hist, cache)
    m.denoise(canvas, cache, sc)
    _sync(m)
    return 1e3 * (time.perf_counter() - t0)


def attention_ms(m, history: int, n: int = 5) -> float:
    """Best-of-``n`` ms of the step's attention alone at ``history`` tokens: one scaled-dot-product attention per
    layer with that layer's shapes (canvas queries against the visible history + the canvas; sliding layers see at
    most ``window - 1`` history tokens), random fp inputs in the model's dtype. This is the part of a cached step
    that grows with history by arithmetic (FLOPs ∝ history), whatever the cache does."""
    from localdiff.arch.layers import attention

    cfg, dev = m.config, m.device
    dtype = m.net.embed_tokens.weight.dtype
    c, hq = cfg.canvas_length, cfg.num_attention_heads
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = []
    for i, (d, hkv) in enumerate(cfg.layer_heads):
        w = cfg.window(i)
        seen = history if w is None else min(history, w - 1)
        shapes.append(
            (
                torch.randn(1, hq, c, d, generator=g).to(dev, dtype),
                torch.randn(1, hkv, seen + c, d, generator=g).to(dev, dtype),
                torch.randn(1, hkv, seen + c, d, generator=g).to(dev, dtype),
            )
        )
    best = float("inf")
    with torch.inference_mode():
        for r in range(n + 1):
            _sync(m)
            t0 = time.perf_counter()
            for q, k, v in shapes:
                attention(q, k, v, None)
            _sync(m)
            if r:  # the first round warms up
                best = min(best, 1e3 * (time.perf_counter() - t0))
    return best


def history_scaling(m, lengths: list[int], steps: int, recompute_steps: int, budgets=(None, 0), log=print) -> dict:
    """ms per denoising step at each history length.

    Measurements are interleaved (one step of each budget per round) so a burst of machine load hits all variants;
    each variant reports its median and its minimum (best of N, the least noise-sensitive figure on a shared
    machine); the headline ratio uses the minimum.

    Returns:
        {"rows": [{"history", "cached_ms" {budget: median}, "cached_min_ms" {budget: min}, "recompute_ms",
        "recompute_min_ms", "recompute_vs_cached", "attention_min_ms" (:func:`attention_ms`), "cache_stats"
        {budget: {...}}}], "ratio_<hi>_vs_<lo>", "rest_ratio_<hi>_vs_<lo>" (the same without attention), "notes"}.
    """
    gen = torch.Generator().manual_seed(0)
    canvas, sc = _canvas_inputs(m, gen)
    rows, notes = [], []
    for n in lengths:
        hist = torch.randint(3, m.config.vocab_size, (1, n), generator=gen).to(m.device)
        caches = {}
        for budget in budgets:
            key = "unlimited" if budget is None else f"{budget}B"
            cache, note = _new_cache(m, budget)
            if note and budget is not None:
                if f"offload budget {key}: skipped ({note})" not in notes:
                    notes.append(f"offload budget {key}: skipped ({note})")
                continue
            m.prefill(hist, cache)
            m.denoise(canvas, cache, sc)  # warm-up
            caches[key] = cache
        times = {k: [] for k in caches}
        rec = []
        for r in range(max(steps, recompute_steps)):
            if r < steps:
                for k, cache in caches.items():
                    times[k].append(step_ms(m, cache, canvas, sc, 1, warm=False)[0])
            if r < recompute_steps:
                rec.append(_recompute_ms(m, hist, canvas, sc))
        row = {
            "history": n,
            "cached_ms": {k: statistics.median(v) for k, v in times.items()},
            "cached_min_ms": {k: min(v) for k, v in times.items()},
            "recompute_ms": statistics.median(rec),
            "recompute_min_ms": min(rec),
            "cache_stats": {
                k: {a: v for a, v in (c.stats() if hasattr(c, "stats") else {}).items() if isinstance(v, (int, float))}
                for k, c in caches.items()
            },
        }
        row["recompute_vs_cached"] = row["recompute_min_ms"] / row["cached_min_ms"].get("unlimited", float("nan"))
        row["attention_min_ms"] = attention_ms(m, n)
        rows.append(row)
        del caches
        cached = ", ".join(f"budget {k} {v:.1f} ms" for k, v in row["cached_min_ms"].items())
        log(f"  history {n}: cached (min) {cached}, recompute (min) {row['recompute_min_ms']:.1f} ms")
    by = {r["history"]: r for r in rows}
    out = {
        "rows": rows,
        "notes": notes,
        "canvas_length": m.config.canvas_length,
        "max_position_embeddings": m.config.max_position_embeddings,
    }
    if max(lengths) > m.config.max_position_embeddings:
        notes.append(
            f"histories past {m.config.max_position_embeddings} tokens exceed the model's trained context; "
            "they are timed for speed only (RoPE extends, outputs are not meaningful)"
        )
    lo, hi = min(lengths), max(lengths)
    if lo != hi and "unlimited" in by[lo]["cached_min_ms"]:
        out[f"ratio_{hi}_vs_{lo}"] = by[hi]["cached_min_ms"]["unlimited"] / by[lo]["cached_min_ms"]["unlimited"]
        rest = [by[x]["cached_min_ms"]["unlimited"] - by[x]["attention_min_ms"] for x in (hi, lo)]
        if rest[1] > 0:  # the step without its attention: what the cache (not the arithmetic) adds with history
            out[f"rest_ratio_{hi}_vs_{lo}"] = rest[0] / rest[1]
    return out


def profile_generate(m, prompt_ids: list[int], seed: int, max_new_tokens: int, top: int = 15, **sampler) -> dict:
    """Profile one ``m.generate`` (after an untimed warm-up) with torch.profiler; also split its wall time into
    plain decoder forwards (denoise), the fused forwards that also prefill (prefill: the prompt or a finished canvas
    with the next canvas's first step) and the rest (the sampler loop: softmax, draws, acceptance, stopping).

    Returns:
        {"forwards", "wall_ms", "split_ms": {"denoise", "prefill", "loop"}, "ms_per_step",
         "top": [{"op", "self_cpu_ms", "share", "calls"}]} (top ops by self CPU time over the whole generate).
    """
    from torch.profiler import ProfilerActivity, profile

    # Kineto (the profiler's C++ side) prints "USDT:... profiler_start" / "profiler_stop" to stderr at its USDT
    # level (5); a minimum level above every level (6) silences it. Read when Kineto's logger first starts, so set
    # before the first profile; a level the user set wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    kw = dict(chat=False, seed=seed, max_new_tokens=max_new_tokens, **sampler)
    m.generate(list(prompt_ids), **kw)
    net, spent = m.net, [0.0]
    orig = net.denoise

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    net.denoise = timed  # instance attribute shadows the method for this run only
    try:
        t0 = time.perf_counter()
        g = m.generate(list(prompt_ids), **kw)
        wall = time.perf_counter() - t0
    finally:
        del net.denoise
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if m.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        m.generate(list(prompt_ids), **kw)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    rows = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    fw = max(g.stats.forwards, 1)
    # prefill runs fused with a canvas's first step: "prefill" is those fused forwards, "denoise" the others
    split = {"denoise": 1e3 * (spent[0] - g.stats.prefill_seconds), "prefill": 1e3 * g.stats.prefill_seconds}
    split["loop"] = 1e3 * wall - split["denoise"] - split["prefill"]
    return {
        "forwards": g.stats.forwards,
        "new_tokens": g.stats.new_tokens,
        "wall_ms": 1e3 * wall,
        "split_ms": split,
        "ms_per_step": 1e3 * wall / fw,
        "denoise_ms_per_step": split["denoise"] / fw,
        "top": [
            {
                "op": e.key,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in rows
        ],
    }
