"""``localdiff bench --only experts``: the bf16 MoE experts alone, native kernel vs torch path, interleaved (issue #24).

One MoE layer of the scale section's flagship-proportioned shapes (:data:`localdiff.bench.scale.SHAPES`: 128
experts, top-8, expert width hidden/4; ``150M`` hidden 448, ``1B`` hidden 1024, the latter in full runs only) over a
canvas of 256 rows with a uniform random routing (what a random model's router gives), weights std 0.02 in huge
pages (:func:`localdiff.hugepages.resident`), as :class:`localdiff.arch.layers.MoEExperts` runs it in bf16: the
native kernel (:mod:`localdiff.kernels.experts`) and the torch path (:func:`localdiff.arch.layers.stream_experts`
with its gather and scatter, inside :func:`localdiff.kernels.experts.disabled`), alternating within each
repetition (the order flips every repetition), CPU time per call, median and range. Before every timed call a
768 MiB buffer is read, so the layer's weights (38.5 MB at 150M, 201 MB at 1B) come from memory as they do in a step,
where every other layer's weights pass through the cache in between (this CPU reports a 480 MB last-level cache: a
layer timed back to back would partly run from it).

Reported per shape and kernel: ms per layer and per step (× layers), GB/s of expert weights read, the fraction of
the weight-bandwidth bound (weights + rows in and out ÷ this core's streaming read rate,
:func:`localdiff.bench.roofline.bandwidth`) and of the bf16 GEMM peak (routed FLOPs ÷ time ÷
:func:`localdiff.bench.scale_sides.gemm_peak`), and the speedup per repetition.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch

BF16 = 2


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(
    quick: bool, reps: int | None = None, sizes: list[str] | None = None, log=print, evict_mib: int = 768
) -> dict:
    """Run the section (module docstring; ``evict_mib``: MiB read before each timed call); returns
    {"bandwidth_gbs", "peak_gflops", "native", "reps", "canvas", "sizes": [per shape: "kernels", "speedup", ...]}."""
    from torch import nn

    from localdiff.kernels import experts as native_experts
    from localdiff.arch.layers import MoEExperts
    from localdiff.bench.roofline import _rand, bandwidth
    from localdiff.bench.scale_shapes import CANVAS, SHAPES, text_config
    from localdiff.bench.scale_sides import gemm_peak
    from localdiff.hugepages import resident

    reps = reps or (5 if quick else 15)
    evict = resident(torch.ones(evict_mib << 18))  # fp32: evict_mib MiB
    bw, peak = bandwidth(), gemm_peak(torch.bfloat16) * 1e9  # bytes/s, FLOP/s
    res = {
        "bandwidth_gbs": bw / 1e9,
        "peak_gflops": peak / 1e9,
        "native": native_experts.status(),
        "reps": reps,
        "canvas": CANVAS,
        "sizes": [],
    }
    for name in sizes or (["150M"] if quick else ["150M", "1B"]):
        t = text_config(*SHAPES[name])
        h, i, e, k, layers = (
            t["hidden_size"],
            t["moe_intermediate_size"],
            t["num_experts"],
            t["top_k_experts"],
            len(t["layer_types"]),
        )
        mod = MoEExperts(e, h, i)
        mod.gate_up_proj = nn.Parameter(_rand(e, 2 * i, h, std=0.02), requires_grad=False)
        mod.down_proj = nn.Parameter(_rand(e, h, i, std=0.02), requires_grad=False)
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(CANVAS, h, generator=g)).bfloat16()
        idx = torch.rand(CANVAS, e, generator=g).topk(k, -1).indices
        w = torch.rand(CANVAS, k, generator=g)
        flops = 2 * 3 * CANVAS * k * h * i
        nbytes = (3 * e * h * i + 2 * CANVAS * h) * BF16
        times = {"native": [], "torch": []}

        def call(kernel):
            evict.sum()
            with torch.inference_mode(), native_experts.disabled() if kernel == "torch" else nullcontext():
                t0 = time.process_time()
                mod(x, w, idx)
                return time.process_time() - t0

        with torch.inference_mode():
            has_native = native_experts.applies(x, mod.gate_up_proj, mod.down_proj)
        kernels = ["native", "torch"] if has_native else ["torch"]
        for kern in kernels:
            call(kern)  # warm-up (build, first touch)
        for r in range(reps):
            for kern in kernels if r % 2 == 0 else kernels[::-1]:
                times[kern].append(call(kern))
        row = {
            "name": name,
            "hidden": h,
            "intermediate": i,
            "experts": e,
            "top_k": k,
            "layers": layers,
            "flops": flops,
            "bytes": nbytes,
            "weight_bytes": 3 * e * h * i * BF16,
            "kernels": {},
        }
        for kern in kernels:
            ts = times[kern]
            med = statistics.median(ts)
            row["kernels"][kern] = {
                "ms": _spread([1e3 * s for s in ts]),
                "step_ms": 1e3 * med * layers,
                "weights_gbs": row["weight_bytes"] / med / 1e9,
                "of_bound": nbytes / bw / med,
                "of_peak": flops / med / peak,
            }
        if has_native:
            row["speedup"] = _spread([a / b for a, b in zip(times["torch"], times["native"])])
        res["sizes"].append(row)
        log(
            f"  [experts {name}] "
            + ", ".join(f"{kk} {v['ms']['median']:.2f} ms/layer" for kk, v in row["kernels"].items())
        )
        del mod
    return res


def render_md(sec: dict) -> list[str]:
    """Markdown lines of the section."""
    out = [
        f"### bf16 MoE experts alone: native kernel vs torch path (one layer, canvas {sec['canvas']}, uniform "
        f"random top-k routing, {sec['reps']} repetitions interleaved, CPU time)",
        "",
        f"{sec['native']}. Streaming read {sec['bandwidth_gbs']:.1f} GB/s, bf16 GEMM peak "
        f"{sec['peak_gflops']:.0f} GFLOP/s (both measured in the run).",
        "",
        "| shape | kernel | ms per layer | ms per step (× layers) | weights GB/s | of the bandwidth bound | "
        "of the GEMM peak |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in sec["sizes"]:
        for kern, v in s["kernels"].items():
            m = v["ms"]
            out.append(
                f"| {s['name']} (H {s['hidden']}, I {s['intermediate']}, {s['experts']} experts top-"
                f"{s['top_k']}, {s['layers']} layers) | {kern} | {m['median']:.2f} ({m['min']:.2f}–"
                f"{m['max']:.2f}) | {v['step_ms']:.1f} | {v['weights_gbs']:.1f} | {v['of_bound']:.0%} | "
                f"{v['of_peak']:.0%} |"
            )
    out.append("")
    for s in sec["sizes"]:
        if "speedup" in s:
            sp = s["speedup"]
            out.append(
                f"- {s['name']}: native ÷ torch speedup per repetition median {sp['median']:.2f}×, range "
                f"{sp['min']:.2f}–{sp['max']:.2f}×"
            )
    return out
