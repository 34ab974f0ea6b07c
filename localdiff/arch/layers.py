"""Shared model pieces: RMSNorm, RoPE tables, attention over a KV cache, the gated FFN and MoE experts.

Everything here is plain torch. The math follows transformers 5.23.0 ``models/diffusion_gemma/modeling_diffusion_gemma.py``
(the reference); tests compare our logits with it to 1e-4 in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.kernels import experts as native_experts


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm computed in fp32: ``x * (mean(x²) + eps)^-0.5 * weight`` (weight is the full scale, not 1 + w).

    Args:
        x: Tensor[..., D] of any float dtype; the result has x's dtype.
        weight: Tensor[D], or a Tensor broadcastable to x (e.g. [H, D]: one scale per head of a [B, L, H, D]
            tensor), or None (no scale, as in the reference's ``with_scale=False`` norms).
        eps: added to the mean square.
    """
    d = x.shape[-1]
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        if weight is None or weight.dim() == 1:
            return torch.rms_norm(x, (d,), weight, eps)  # bit-identical to the formula in fp32
        return torch.rms_norm(x, (d,), None, eps) * weight  # same rounding: rms_norm scales after normalising
    if x.device.type == "cpu" and (weight is None or (weight.dim() == 1 and weight.dtype == x.dtype)):
        if not (torch.is_grad_enabled() and x.requires_grad):
            # the same fp32 math in four in-place passes over one fp32 copy, rounded once: bit-identical to
            # torch.rms_norm (tests/decoding/test_vocab_pass.py), whose CPU composite multiplies the 16-bit weight in a slow
            # mixed-dtype pass — measured at [256, 1024] bf16: 0.88 → 0.21 ms; ~45 ms of a 1B step's ~600
            xf = x.float()
            xf.mul_(xf.square().mean(-1, keepdim=True).add_(eps).rsqrt_())
            return (xf if weight is None else xf.mul_(weight)).to(x.dtype)
        # (autograd) one fused kernel instead of six ops; it computes in fp32 and rounds once, as the formula below
        # does (bit-identical on the bf16 tensors tested): 13 % of a 150M bf16 step → ~2 %
        return torch.rms_norm(x, (d,), weight, eps)
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def norm(mod: "RMSNorm", x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for an :class:`RMSNorm` without the module-call overhead (hot paths)."""
    return rms_norm(x, mod.weight, mod.eps)


def linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``; a plain ``nn.Linear`` runs as ``F.linear`` without the module-call overhead (quantized or hooked
    projections keep their own call)."""
    if type(mod) is nn.Linear and not mod._forward_hooks and not mod._forward_pre_hooks:
        return F.linear(x, mod.weight, mod.bias)
    return mod(x)


class RMSNorm(nn.Module):
    """RMSNorm module with an optional learned scale of shape [dim] (see :func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (fp32) for one RoPE variant.

    ``rope_type == "default"``: ``1 / theta^(2i/d)`` over ``d = head_dim * partial_rotary_factor`` dims.
    ``rope_type == "proportional"`` (Gemma 4 global layers): the first ``partial_rotary_factor * head_dim / 2``
    angles rotate with frequencies ``1 / theta^(2i/head_dim)``, the remaining angles get frequency 0 (identity),
    so the table always spans ``head_dim``. An optional ``factor`` divides all frequencies.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    kind = rope.get("rope_type", "default")
    theta = float(rope["rope_theta"])
    partial = float(rope.get("partial_rotary_factor", 1.0))
    if kind == "default":
        dim = int(head_dim * partial)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "proportional":
        angles = int(partial * head_dim // 2)
        rot = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        nope = head_dim // 2 - angles
        inv = torch.cat([rot, torch.zeros(nope)]) if nope > 0 else rot
        return inv / float(rope.get("factor", 1.0))
    raise ValueError(f"unsupported rope_type {kind!r}")


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for absolute ``positions`` (LongTensor[L]) → (cos, signed sin), each Tensor[L, 1, 2F] in ``dtype``
    (F = len(inv_freq)), ready to broadcast over [B, L, H, 2F]. The sin table's first half is negated so that
    :func:`apply_rope` needs one ``roll`` instead of slicing, negating and concatenating."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE ``x·cos + rotate_half(x)·sin`` on x: Tensor[B, L, H, D] with the tables of
    :func:`rope_tables` (Tensor[L, 1, D]). ``rotate_half(x) = cat(-x₂, x₁) = roll(x, D/2) · [-1…, +1…]``; the sign
    lives in the sin table, so the result is bit-identical to the reference's formula."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled-dot-product attention with scale 1.0 (Gemma 4 uses q/k norms instead of 1/sqrt(d)) and GQA.

    Args:
        q: Tensor[B, Hq, Lq, D]; k, v: Tensor[B, Hkv, Lk, D] with Hq a multiple of Hkv.
        mask: BoolTensor broadcastable to [B, 1, Lq, Lk] (True = may attend) or None (attend to all).
    Returns:
        Tensor[B, Lq, Hq * D].
    """
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=q.shape[1] != k.shape[1])
    b, h, lq, d = out.shape
    return out.transpose(1, 2).reshape(b, lq, h * d)


def backs(fused: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether ``fused`` (a concatenated weight made by a ``fuse()``) still backs ``weight`` — not replaced, cast or
    moved since — and autograd is off, so a forward may run one matmul on it."""
    if fused is None or torch.is_grad_enabled():
        return False
    return weight.data_ptr() == fused.data_ptr()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """Gated FFN ``down(gelu_tanh(gate(x)) * up(x))`` with bias-free linears (hidden → inter → hidden)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.fused = None  # Tensor[2 * inter, hidden] whose halves back gate_proj / up_proj (see fuse())

    def fuse(self) -> None:
        """Back gate_proj and up_proj by one [2I, H] tensor so forward runs one matmul instead of two (the two
        weights become views of it: no extra memory). Only for plain float nn.Linear weights."""
        if type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear:
            w = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
            n = self.gate_proj.weight.shape[0]
            self.gate_proj.weight = nn.Parameter(w[:n], requires_grad=False)
            self.up_proj.weight = nn.Parameter(w[n:], requires_grad=False)
            self.fused = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if backs(self.fused, self.gate_proj.weight):
            gate, up = F.linear(x, self.fused).chunk(2, dim=-1)
            return linear(self.down_proj, F.gelu(gate, approximate="tanh") * up)
        return linear(self.down_proj, gelu_tanh(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class Router(nn.Module):
    """Gemma 4 MoE router: unscaled RMSNorm → × scale × hidden^-0.5 → linear → softmax (fp32) → top-k →
    renormalise to sum 1 → × per_expert_scale[expert].

    forward(x: Tensor[N, H]) -> (weights: FloatTensor[N, K] fp32, index: LongTensor[N, K]).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.eps = eps
        self.top_k = top_k
        self.root = hidden**-0.5
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(rms_norm(x, None, self.eps))

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward, on ``rms_norm(x, None)`` already computed (Tensor[N, H]; the layer shares it)."""
        h = normed * self.scale * self.root
        probs = torch.softmax(linear(self.proj, h), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class MoEExperts(nn.Module):
    """Stacked experts: ``gate_up_proj`` Tensor[E, 2I, H], ``down_proj`` Tensor[E, H, I] (checkpoint layout).

    Tokens are grouped by expert (one stable sort), each active expert runs one matmul over its tokens
    (:meth:`expert_ffn`), results are weighted and scattered back with one ``index_add_``. Quantized subclasses
    (``localdiff.quantize.int8.Int8Experts``) override :meth:`expert_ffn` only.
    """

    #: bf16 on CPU: "stream" (the native kernel, else :func:`stream_experts`, measured 1.3-1.6x faster than
    #: grouped_mm there) or "grouped"
    kernel = "stream"

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def expert_ffn(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x: Tensor[N, H] → Tensor[N, H]."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(gelu_tanh(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x: Tensor[N, H]; weights: Tensor[N, K] (fp32); index: LongTensor[N, K] → Tensor[N, H] in x's dtype.

        On CPU without autograd, both expert matmuls run as one ``torch._grouped_mm`` each over the expert-sorted
        rows (group ends from a cumulative bincount: no host sync); it equals the per-expert loop bit for bit.
        In bf16 there (``kernel == "stream"``): the native kernel (:mod:`localdiff.kernels.experts`, AMX-BF16 or
        AVX512-BF16) where it built, else :func:`stream_experts`."""
        n, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if (
            self.kernel == "stream"
            and self._grouped(x)
            and native_experts.applies(x, self.gate_up_proj, self.down_proj)
        ):
            return native_experts.moe(x, flat, order, weights, self.gate_up_proj, self.down_proj)
        token = order // k
        xs = x.index_select(0, token)
        if self._grouped(xs) and xs.dtype == torch.bfloat16 and self.kernel == "stream":
            ys = stream_experts(xs, flat, order, self.gate_up_proj, self.down_proj, weights.reshape(-1)[order])
            return torch.zeros_like(x).index_add_(0, token, ys)
        elif self._grouped(xs):
            offs = torch.bincount(flat, minlength=self.num_experts).cumsum(0, dtype=torch.int32)
            gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            ys = torch._grouped_mm(gelu_tanh(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            groups = xs.split(counts)
            outs = [self.expert_ffn(e, g) for e, g in enumerate(groups) if counts[e]]
            ys = torch.cat(outs) if len(outs) > 1 else outs[0]
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _grouped(self, xs: torch.Tensor) -> bool:
        """Whether the grouped-matmul path applies: plain float experts (not a quantized subclass), CPU, no autograd
        (its CPU backward is not usable), fp32/bf16, and torch has ``_grouped_mm``."""
        return (
            _HAS_GROUPED_MM
            and type(self).expert_ffn is MoEExperts.expert_ffn
            and xs.device.type == "cpu"
            and xs.dtype in (torch.float32, torch.bfloat16)
            and self.gate_up_proj.dtype == xs.dtype
            and not torch.is_grad_enabled()
        )


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def stream_experts(
    xs: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' gated FFN in the weight-streaming layout: rows of each expert are placed in a zero-padded block
    (one host sync for the largest group) and each expert runs ``W · Xᵀ`` as one ``torch.bmm`` over all experts.

    Why: a canvas of 256 tokens with top-8 of 128 experts gives each expert ~16 rows, so the step reads every
    expert weight once for a few rows — memory-bound. With the weight as the streamed left operand, bf16 reaches
    ~13 GB/s of weights on one core here (the machine's ~12 GB/s read rate) against ~8 for ``torch._grouped_mm``
    (one small matmul per expert): measured 1.3-1.6x faster per expert layer at hidden 512 / 1024. Not for fp32
    (there ``_grouped_mm`` measured faster) and not bit-identical to it (bf16 rounding of another GEMM blocking).

    Args:
        xs: Tensor[N·K, H] rows sorted by expert (``x[order // K]``); flat: LongTensor[N·K] expert of each
            (token, slot); order: ``argsort(flat, stable=True)``.
        gate_up: Tensor[E, 2I, H]; down: Tensor[E, H, I] (checkpoint layout).
        row_weights: FloatTensor[N·K] routing weight of each sorted row, or None. Given, it scales the activation
            before the down projection (``down(w·a) = w·down(a)``: no separate [N·K, H] product and cast).
    Returns:
        Tensor[N·K, H]: row r = expert ``flat[order[r]]`` applied to ``xs[r]`` (times ``row_weights[r]``).
    Measured at hidden 1024 (one layer, 128 experts, canvas 256, huge pages): the two products 20 ms of ~30; the
    bandwidth floor of the weights 14 ms (localdiff bench --only scale, roofline).
    """
    e, two_i, h = gate_up.shape
    counts = torch.bincount(flat, minlength=e)
    eid = flat[order]
    pos = torch.arange(eid.numel(), device=xs.device) - (counts.cumsum(0) - counts)[eid]
    # rows copied whole into [E, max rows, H] (a strided [E, H, max rows] scatter cost ~1 ms more per layer at
    # hidden 1024), the product reads it transposed; the padding is left uninitialised: each output column of a
    # matmul depends on its own input column only, and only real rows are gathered at the end (bit-identical)
    buf = xs.new_empty(e, int(counts.max()), h)
    buf[eid, pos] = xs
    o = torch.bmm(gate_up, buf.transpose(1, 2))  # [E, 2I, max rows]
    half = two_i // 2
    act = gelu_tanh(o[:, :half]) * o[:, half:]
    if row_weights is not None:
        wb = xs.new_zeros(e, 1, buf.shape[1])
        wb[eid, 0, pos] = row_weights.to(xs.dtype)
        act = act.mul_(wb)
    return torch.bmm(down, act)[eid, :, pos]


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (final-logit soft-capping); identity when cap is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def embed_scale(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Gemma's embedding multiplier sqrt(hidden), rounded to ``dtype`` exactly as the reference's buffer is."""
    return torch.tensor(math.sqrt(hidden), dtype=torch.float32).to(dtype)
