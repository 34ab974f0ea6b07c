"""The scale section's roofline (issue #24): per component of one bf16 denoising step, its FLOPs, its time as
localdiff runs it, the fraction of this core's measured GEMM peak it reaches, and the fraction it *could* reach.

Roofline (Williams, Waterman, Patterson, CACM 2009): a kernel that does F FLOPs and must move B bytes between
memory and the core runs at most at ``min(peak, (F / B) · bandwidth)``. Here B counts each operand once (weights,
activations read, results written: the least traffic any kernel needs), ``bandwidth`` is this core's measured
streaming read rate (best of 5 ``sum`` over 256 MiB of fp32) and ``peak`` its measured bf16 GEMM rate
(:func:`localdiff.bench.scale_sides.gemm_peak`). Each component is timed alone at the step's shapes with random
operands in huge pages (best of 3, CPU time), with the kernels localdiff's bf16 default runs:

- experts: :class:`localdiff.arch.layers.MoEExperts` as the step runs it in bf16 (the native kernel of
  :mod:`localdiff.kernels.experts` where it built, else :func:`localdiff.arch.layers.stream_experts`) over a
  random top-k routing (FLOPs: the routed rows; the padded rows it also computes are in ``computed_flops``);
- LM head: :func:`localdiff.arch.soft_embedding.raw_head` (``F.linear(h, E)`` into a reused buffer, [C, H] ×
  [H, V]); self-conditioning product: ``F.linear(p, Eᵀ)`` ([C, V] × [V, H]);
- attention: :func:`localdiff.arch.layers.attention` per layer (window and global shapes, C + prompt keys);
- other linears: q/k/v (fused), o, the dense MLP, the router and the self-conditioning MLP at C rows;
- vocab elementwise pass: :class:`localdiff.decoding.vocab_pass.VocabPass` on the LM head's raw bf16 logits
  (:class:`localdiff.arch.soft_embedding.RawLogits`) as the fast path runs it — soft-capping, temperature, the
  statistics and the probabilities in bf16 — no matmul FLOPs, so its bound is its bytes ÷ bandwidth: B = 4 bytes
  per [C, V] element (bf16 logits in, bf16 probabilities out, a row kept in cache between its passes);
  ``bytes_as_coded`` counts what the code moves: 4 bytes with the fused native kernel
  (:mod:`localdiff.kernels.vocab`), 92 with the torch passes (``LOCALDIFF_VOCAB_KERNEL=torch`` or no
  compiler); ``kernel`` says which ran.

``reachable`` for the whole step = Σ F ÷ Σ (F_i ÷ bound_i) ÷ peak: the fraction of peak a step made of these
components reaches if every one ran at its roofline bound (the vocab pass at its bandwidth bound).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from localdiff.hugepages import resident

BF16 = 2


def _best(fn, n: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def bandwidth() -> float:
    """This core's streaming read rate in bytes/s (best of 5 sums over 256 MiB of fp32, CPU time)."""
    x = resident(torch.ones(64 << 20))
    return x.numel() * 4 / _best(lambda: x.sum(), 5)


def _rand(*shape, std: float = 1.0) -> torch.Tensor:
    """Random bf16 operand in huge pages; weights get std 0.02 (transformers' initializer range, as the bench's
    random checkpoints: with std 1 the activations reach ~1e4 and bf16 GELU takes a slow path, ~4x)."""
    return resident((torch.randn(*shape) * std).to(torch.bfloat16))


def components(text: dict, canvas: int, prompt: int, vocab: int | None = None) -> dict:
    """{component: {"flops", "bytes", "seconds"} (whole step, all layers)} at ``text``'s shapes, measured now."""
    from torch import nn

    from localdiff.kernels import experts as native_experts
    from localdiff.arch.layers import MoEExperts, attention
    from localdiff.arch.soft_embedding import RawLogits, raw_head
    from localdiff.decoding.vocab_pass import VocabPass

    h, v, c = text["hidden_size"], vocab or text["vocab_size"], canvas
    e, k, i = text["num_experts"], text["top_k_experts"], text["moe_intermediate_size"]
    layers = text["layer_types"]
    out = {}
    # experts: one layer's kernel × layers
    mod = MoEExperts(e, h, i)
    mod.gate_up_proj, mod.down_proj = (
        nn.Parameter(_rand(e, 2 * i, h, std=0.02), requires_grad=False),
        nn.Parameter(_rand(e, h, i, std=0.02), requires_grad=False),
    )
    x = _rand(c, h)
    g = torch.Generator().manual_seed(0)
    idx = torch.rand(c, e, generator=g).topk(k, -1).indices
    flat, w = idx.reshape(-1), torch.rand(c, k)
    with torch.inference_mode():
        native = native_experts.applies(x, mod.gate_up_proj, mod.down_proj)
        t = _best(lambda: mod(x, w, idx))
    pad = native_experts.computed_rows(flat, e) if native else e * int(torch.bincount(flat, minlength=e).max())
    out["experts"] = {
        "flops": 2 * 3 * c * k * h * i * len(layers),
        "computed_flops": 2 * 3 * pad * h * i * len(layers),
        "bytes": (3 * e * h * i + 2 * c * k * h) * BF16 * len(layers),
        "seconds": t * len(layers),
    }
    del mod
    emb, hh, head_buffers = _rand(v, h, std=0.02), _rand(1, c, h), {}
    out["LM head"] = {
        "flops": 2 * c * h * v,
        "bytes": (v * h + c * h + c * v) * BF16,
        "seconds": _best(lambda: raw_head(hh, emb, 30.0, head_buffers)),
    }
    p16 = _rand(1, c, v)
    out["self-conditioning product"] = {
        "flops": 2 * c * h * v,
        "bytes": (v * h + c * v + c * h) * BF16,
        "seconds": _best(lambda: F.linear(p16, emb.t())),
    }
    y16 = F.linear(hh, emb)
    del emb, p16
    vp = VocabPass(torch.bfloat16)

    def vocab_pass():
        probs = vp.run(RawLogits(y16, 30.0), 0.8).probs
        if probs.dtype != torch.bfloat16:  # the torch passes: the policy's bf16 copy
            probs.to(torch.bfloat16)

    # bytes per [C, V] element: the least any kernel needs (bf16 logits in, bf16 probabilities out: one pass per
    # row held in cache) and what the code moves (read + write): the native kernel that least; the torch passes
    # the fp32 cast 2 + 4, soft-capping 3 × 8, mul_ 8, max 4, sub_ 8, exp 8, sum 4, mul_ 12, sum 4, div_ 8, the
    # bf16 cast 4 + 2
    coded = 4 if vp.native else 6 + 3 * 8 + (8 + 4 + 8 + 8 + 4 + 12 + 4 + 8) + 6
    out["vocab elementwise pass"] = {
        "flops": 0,
        "bytes": 4 * c * v,
        "bytes_as_coded": coded * c * v,
        "kernel": "native fused" if vp.native else "torch passes",
        "seconds": _best(vocab_pass),
    }
    del y16, vp
    # attention and the other linears, per layer type
    heads, kv, d, gd = (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["head_dim"],
        text["global_head_dim"],
    )
    att = {"flops": 0, "bytes": 0, "seconds": 0.0}
    lin = {"flops": 0, "bytes": 0, "seconds": 0.0}
    inter = text["intermediate_size"]
    for ty in set(layers):
        n_ty = layers.count(ty)
        sliding = ty == "sliding_attention"
        dd, kk = (d, kv) if sliding else (gd, text["num_global_key_value_heads"])
        keys = c + prompt
        q, kt, vt = _rand(1, heads, c, dd), _rand(1, kk, keys, dd), _rand(1, kk, keys, dd)
        att["flops"] += 4 * heads * c * keys * dd * n_ty
        att["bytes"] += (2 * heads * c * dd + 2 * kk * keys * dd) * BF16 * n_ty
        att["seconds"] += _best(lambda: attention(q, kt, vt, None)) * n_ty
        shapes = [
            (heads * dd + kk * dd * (2 if sliding else 1), h),
            (h, heads * dd),
            (2 * inter, h),
            (h, inter),
            (e, h),
        ]
        for n_out, n_in in shapes:
            wt, xx = _rand(n_out, n_in, std=0.02), _rand(c, n_in)
            lin["flops"] += 2 * c * n_out * n_in * n_ty
            lin["bytes"] += (n_out * n_in + c * n_in + c * n_out) * BF16 * n_ty
            lin["seconds"] += _best(lambda: F.linear(xx, wt)) * n_ty
    for n_out, n_in in [(2 * inter, h), (h, inter)]:  # the self-conditioning MLP, once per step
        wt, xx = _rand(n_out, n_in, std=0.02), _rand(c, n_in)
        lin["flops"] += 2 * c * n_out * n_in
        lin["bytes"] += (n_out * n_in + c * n_in + c * n_out) * BF16
        lin["seconds"] += _best(lambda: F.linear(xx, wt))
    out["attention"], out["other linears"] = att, lin
    return out


def analyse(comps: dict, peak_flops: float, bw: float, step_seconds: float | None = None) -> dict:
    """Add to each component its achieved rate, ``fraction_of_peak``, arithmetic ``intensity`` (FLOP/byte),
    ``bound`` (its roofline rate ÷ peak: the most it can reach) and ``of_bound``; and the whole step's figures.

    Args:
        comps: :func:`components`' result; peak_flops: FLOP/s; bw: bytes/s; step_seconds: the measured CPU time of
            a step (the share of the components' sum in it is reported), or None.
    """
    rows, lower = {}, 0.0
    for name, r in comps.items():
        f, b, s = r["flops"], r["bytes"], r["seconds"]
        bound_rate = min(peak_flops, f / b * bw) if f else 0.0
        floor = f / bound_rate if f else b / bw  # the least time this component can take
        lower += floor
        rows[name] = dict(
            r,
            gflops=f / s / 1e9 if s else 0.0,
            fraction_of_peak=f / s / peak_flops if s else 0.0,
            intensity=f / b,
            bound=bound_rate / peak_flops,
            of_bound=floor / s if s else 0.0,
            min_seconds=floor,
        )
    flops, secs = sum(r["flops"] for r in comps.values()), sum(r["seconds"] for r in comps.values())
    return {
        "components": rows,
        "peak_gflops": peak_flops / 1e9,
        "bandwidth_gbs": bw / 1e9,
        "flops": flops,
        "seconds_sum": secs,
        "step_seconds": step_seconds,
        "fraction_of_peak_components": flops / secs / peak_flops,
        "fraction_of_peak_step": flops / step_seconds / peak_flops if step_seconds else None,
        "reachable": flops / lower / peak_flops,
        "min_step_seconds": lower,
    }


def render_md(r: dict) -> list[str]:
    """Markdown lines of :func:`analyse`'s result."""
    out = [
        f"Roofline of one bf16 step (each component timed alone at the step's shapes; peak "
        f"{r['peak_gflops']:.0f} GFLOP/s, streaming read {r['bandwidth_gbs']:.1f} GB/s): the components reach "
        f"**{r['fraction_of_peak_components']:.0%}** of peak"
        + (
            f" (the measured step, {1e3 * r['step_seconds']:.0f} CPU ms with norms, routing and sampling: "
            f"{r['fraction_of_peak_step']:.0%})"
            if r.get("step_seconds")
            else ""
        )
        + f"; at every component's roofline bound a step would take {1e3 * r['min_step_seconds']:.0f} ms and "
        f"reach **{r['reachable']:.0%}** of peak.",
        "",
        "| component | GFLOP | ms | GFLOP/s | of peak | FLOP/byte | roofline bound (of peak) | of its bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in r["components"].items():
        extra = f" ({c['computed_flops'] / 1e9:.1f} computed, padded)" if "computed_flops" in c else ""
        bound = f"{c['bound']:.0%}" if c["flops"] else f"{1e3 * c['min_seconds']:.1f} ms (bandwidth)"
        out.append(
            f"| {name} | {c['flops'] / 1e9:.2f}{extra} | {1e3 * c['seconds']:.1f} | {c['gflops']:.0f} | "
            f"{c['fraction_of_peak']:.0%} | {c['intensity']:.1f} | {bound} | {c['of_bound']:.0%} |"
        )
    return out
