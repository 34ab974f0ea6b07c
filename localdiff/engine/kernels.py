"""Which kernels a loaded model runs (``gen -v``, ``bench``): compute dtype, experts, int8 layers, the
self-conditioning product and the LM head, as measured choices (see :mod:`localdiff.capability`,
:func:`localdiff.arch.layers.stream_experts`, :func:`localdiff.quantize.int8.int8_matmul`)."""

from __future__ import annotations

from torch import nn


def describe(net: nn.Module, sampler: str | None = None) -> dict[str, str]:
    """name → one-line description of the kernels ``net`` runs (keys: dtype, device, weights and heap (CPU),
    experts, int8, self_conditioning, sampler). ``sampler``: "exact" | "fast" (``Precision.sampler_path``), None = by
    dtype (fp32: exact)."""
    from localdiff.kernels import experts as native_experts
    from localdiff.arch.layers import MoEExperts
    from localdiff.quantize.int4 import Int4Experts, Int4Linear
    from localdiff.quantize.int8 import Int8Experts, Int8Linear

    if not isinstance(net, nn.Module):  # a backend (GGUF: llama.cpp) — gen -v's backend line says which
        return {"backend": str(getattr(net, "backend", type(net).__name__))}
    p = next(net.parameters())
    dtype, cpu = str(p.dtype).removeprefix("torch."), p.device.type == "cpu"
    out = {"dtype": dtype, "device": p.device.type}
    if cpu:
        from localdiff.hugepages import available

        out["weights"] = (
            "copied out of the memory-mapped file, those of 4 MiB and more into huge pages (localdiff.hugepages)"
            if available()
            else "memory-mapped from the checkpoint file"
        )
        from localdiff import heap

        out["heap"] = heap.status()
    mods = list(net.modules())
    experts = [m for m in mods if isinstance(m, MoEExperts)]
    if any(isinstance(m, Int8Experts) for m in experts):
        out["experts"] = "int8 weights, one int8 matmul per active expert"
    elif any(isinstance(m, Int4Experts) for m in experts):
        out["experts"] = "int4 weights (CPU: all experts in one native call per projection)"
        if cpu and any(getattr(m, "act_int8", False) for m in experts):
            from localdiff.kernels import int4_vnni

            out["experts"] += (
                f", int8 activations ({int4_vnni.status()})"
                if int4_vnni.library() is not None
                else f" (int8 activations asked; {int4_vnni.status()})"
            )
    elif experts and cpu and dtype == "bfloat16" and experts[0].kernel == "stream" and native_experts.library():
        out["experts"] = (
            f"{native_experts.status()}: each expert's weights streamed once over its routed rows "
            "only, fp32 activation, slots summed in fp32"
        )
    elif experts and cpu and dtype == "bfloat16" and experts[0].kernel == "stream":
        out["experts"] = (
            f"stream (zero-padded W·Xᵀ torch.bmm over all experts, routing weight folded into the "
            f"activation; measured faster than grouped_mm in bf16); {native_experts.status()}"
        )
    elif experts and cpu:
        out["experts"] = "torch._grouped_mm over expert-sorted rows (bit-identical to the per-expert loop)"
    elif experts:
        out["experts"] = "per-expert matmul loop"
    if any(isinstance(m, Int8Linear) for m in mods):
        from localdiff.quantize.choose import kernel_summary

        out["int8"] = (
            "≤ 16 rows: the measured fastest of the native kernel, _weight_int8pack_mm and dequantize + "
            "GEMM; more rows: dequantize to bf16 + GEMM"
            if dtype == "bfloat16"
            else "≤ 16 rows: the native kernel where it measures faster; more rows: dequantized fp32 GEMM (exact)"
        ) + (f" ({kernel_summary()})" if cpu else "")
        if cpu and any(getattr(m, "act_int8", False) for m in mods if isinstance(m, Int8Linear)):
            from localdiff.kernels import int8_vnni

            out["int8"] += (
                f"; ≤ 64 rows on int8 activations (recipe opt-in; {int8_vnni.status()})"
                if int8_vnni.library() is not None
                else f"; int8 activations asked ({int8_vnni.status()})"
            )
    if any(isinstance(m, (Int4Linear, Int4Experts)) for m in mods):
        from localdiff.kernels import int4 as native4

        out["int4"] = (
            f"{native4.status()}, every row count"
            if cpu and native4.library() is not None
            else "dequantize to fp32 (fp16 for fp16 activations) + GEMM" + (f" ({native4.status()})" if cpu else "")
        )
        if cpu and any(getattr(m, "act_int8", False) for m in mods if isinstance(m, Int4Linear)):
            from localdiff.kernels import int4_vnni

            out["int4"] += (
                "; linears below 32 rows on int8 activations (recipe opt-in)"
                if int4_vnni.library() is not None
                else f"; int8 activations asked ({int4_vnni.status()})"
            )
    if hasattr(net, "self_conditioning"):
        if (sampler or ("exact" if dtype == "float32" else "fast")) == "exact":
            out["self_conditioning"] = "softmax(fp32) then F.linear(p, Eᵀ) in float32 (the reference's ops)"
            out["sampler"] = "the reference's ops and random stream (reference-exact)"
        else:
            out["self_conditioning"] = f"the sampler's probabilities, F.linear(p, Eᵀ) in {dtype}"
            from localdiff.kernels import vocab as vocab_native

            native = cpu and vocab_native.library() is not None
            out["sampler"] = (
                "vocab pass: one fused native pass over the raw logits, probabilities written in "
                f"{dtype} ({vocab_native.status().removeprefix('vocab pass: ')})"
                if native
                else "vocab pass: 7 in-place fp32 passes into reused buffers"
                + (f" ({vocab_native.status().removeprefix('vocab pass: ')})" if cpu else "")
            ) + " (localdiff.decoding.vocab_pass); draws for accepted positions only"
    return out
