"""``localdiff bench --only int4`` (its ``canvas`` part): DiffusionGemma's denoising step in int4 vs bf16 at the
flagship's proportions (:data:`localdiff.bench.scale.SHAPES` "1B": hidden 1024, 9 layers, 128 experts top-8 of width
256, vocab 32,768; quick runs "150M"), canvas 256 after a 64-token prompt, self-conditioning on.

Both copies load the same random bf16 checkpoint (:func:`localdiff.bench.scale.build`); the int4 one by the
flagship's recipe (``quant/diffusiongemma-26b-a4b.toml`` with ``--quant int4``: attention, dense MLP and experts int4,
the tied embedding / LM head an int4 table). With ~16 routed rows per expert at one canvas the experts read their
weights once per step for a few rows: the step is bound by weight bytes, which int4 cuts to 28 %. The recipe's
``int4_activations = "int8"`` runs the experts on int8 activations (AVX512-VNNI, :mod:`localdiff.kernels.int4_vnni`);
a third copy, "int4-exact", is the same int4 model with that switched off (the exact bf16 / fp32 int4 kernels). One
pinned core, the copies interleaved (order rotating), medians and ranges of wall time and of the thread's CPU time
(the latter steadier on a shared machine). Target: int4 step ≤ 0.75× bf16.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path


def canvas_steps(quick: bool, log=print, size: str | None = None, reps: int | None = None) -> dict:
    """The int4 / bf16 canvas-step timings of the module docstring."""
    import torch

    from localdiff.bench import scale
    from localdiff.bench.onecore import cpu_name, resident
    from localdiff.bench.onecore import pin as _pin
    from localdiff.cache.kv import KVCache
    from localdiff.loader import load_model
    from localdiff.quantize.int4 import Int4Experts
    from localdiff.quantize.recipe import load_recipe

    size = size or ("150M" if quick else "1B")
    reps = reps or (3 if quick else 7)
    before, threads = _pin()
    try:
        with tempfile.TemporaryDirectory(prefix="localdiff-int4-dg-") as d:
            log(f"int4: building the flagship-proportioned random DiffusionGemma ({size})")
            path = scale.build(Path(d), scale.text_config(*scale.SHAPES[size]))
            recipe = load_recipe("diffusiongemma-26b-a4b")
            nets = {
                "bf16": load_model(path, "cpu", torch.bfloat16)[0],
                "int4": load_model(path, "cpu", torch.bfloat16, quant="int4", recipe=recipe)[0],
            }
            if recipe.int4_activations == "int8":
                nets["int4-exact"] = load_model(path, "cpu", torch.bfloat16, quant="int4", recipe=recipe)[0]
                for m in nets["int4-exact"].modules():
                    if isinstance(m, Int4Experts) or getattr(m, "act_int8", False):
                        m.act_int8 = False
        c = nets["bf16"].config
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, c.vocab_size, (1, scale.PROMPT), generator=g)
        canvas = torch.randint(3, c.vocab_size, (1, scale.CANVAS), generator=g)
        sc = torch.randn(1, scale.CANVAS, c.vocab_size, generator=g)
        caches = {}
        with torch.inference_mode():
            for k, n in nets.items():
                caches[k] = KVCache(**n.cache_layout())
                n.prefill(prompt, caches[k])
                n.denoise(canvas, caches[k], sc)  # warm-up (kernels' first-use builds)
            times, cpu = {k: [] for k in nets}, {k: [] for k in nets}
            names = list(nets)
            for r in range(reps):
                for k in (names[r % len(names) :] + names[: r % len(names)])[:: 1 if r % 2 == 0 else -1]:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    nets[k].denoise(canvas, caches[k], sc)
                    times[k].append((time.perf_counter() - t0) * 1e3)
                    cpu[k].append((time.thread_time() - c0) * 1e3)
                log(f"int4: canvas round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in times.items()) + " ms")
        med = {k: statistics.median(v) for k, v in times.items()}
        out = {
            "shape": f"DiffusionGemma {size} (flagship proportions), canvas {scale.CANVAS}, prompt {scale.PROMPT}",
            "cpu": cpu_name(),
            "threads": 1,
            "core": max(os.sched_getaffinity(0)),
            "steps": {
                k: {
                    "median_ms": med[k],
                    "range_ms": [min(v), max(v)],
                    "runs": len(v),
                    "cpu_median_ms": statistics.median(cpu[k]),
                    "cpu_range_ms": [min(cpu[k]), max(cpu[k])],
                }
                for k, v in times.items()
            },
            "load_average": list(os.getloadavg()),
            "resident_bytes": {k: resident(n) for k, n in nets.items()},
            "int4_over_bf16": med["int4"] / med["bf16"],
            "int4_over_bf16_cpu": statistics.median(cpu["int4"]) / statistics.median(cpu["bf16"]),
        }
        out["target int4 step <= 0.75x bf16"] = out["int4_over_bf16"] <= 0.75
        return out
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def render_md(s: dict) -> list[str]:
    """Markdown lines of the canvas part."""
    lines = [
        f"#### {s['shape']}, one core ({s['cpu']})",
        "",
        "| step | median ms | range ms | CPU median ms | CPU range ms |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {v['median_ms']:.1f} | {v['range_ms'][0]:.1f} … {v['range_ms'][1]:.1f} | "
        f"{v.get('cpu_median_ms', 0):.1f} | {v.get('cpu_range_ms', [0, 0])[0]:.1f} … "
        f"{v.get('cpu_range_ms', [0, 0])[1]:.1f} |"
        for k, v in s["steps"].items()
    ]
    rb = s["resident_bytes"]
    return lines + [
        "",
        f"int4 / bf16 step {s['int4_over_bf16']:.2f}, CPU time {s.get('int4_over_bf16_cpu', 0):.2f} "
        f"(load average {', '.join(f'{x:.1f}' for x in s.get('load_average', []))}; target ≤ 0.75: "
        f"{'met' if s['target int4 step <= 0.75x bf16'] else 'NOT met'}); resident "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in rb.items()),
        "",
    ]
