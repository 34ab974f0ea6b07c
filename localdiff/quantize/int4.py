"""int4 weight-only quantization: group-wise affine 4-bit codes, int4 linear layers and stacked int4 experts.

Format (fixed; the memory planner counts it): each output row of a weight W[out, in] is cut into groups of
:data:`GROUP` = 64 consecutive input features (the last group of a row zero-padded when ``in % 64 != 0``). A group
g of row o stores 64 unsigned 4-bit codes q ∈ [0, 15], a bf16 scale s[o, g] and an fp16 zero point z[o, g] (a
float, not necessarily an integer), with ``W[o, k] ≈ s[o, g] · (q[o, k] − z[o, g])``:

* ``packed``: uint8 Tensor[..., out, ceil(in / 64) · 32], two codes a byte. Byte i (0 ≤ i < 32) of group g holds
  the code of input feature ``64·g + i`` in its low nibble and that of ``64·g + 32 + i`` in its high nibble (so one
  32-byte load gives the group's first 32 codes from the low nibbles and its last 32 from the high ones).
* ``scale``: bf16 Tensor[..., out, ceil(in / 64)]; ``zero``: fp16 Tensor[..., out, ceil(in / 64)].

Resident bytes per weight: 0.5 + 4 / 64 = 0.5625 (28 % of bf16). Quantization (:func:`quantize_tensor`): per group
``s = (max − min) / 15`` rounded *up* to bf16 (at least ``max|w| / 256``, so z stays within fp16's exact range),
``z = −min / s`` rounded to fp16, ``q = clamp(round(w / s + z), 0, 15)``: asymmetric min/max ("zero point")
quantization as in GPTQ / AWQ's group-wise int4 (arXiv 2210.17323, 2306.00978) and llama.cpp's Q4_1 blocks.

Which kernel runs (:func:`int4_matmul`):

* CPU with a C compiler: the native kernel of :mod:`localdiff.kernels.int4` (bf16 activations: AVX512-BF16 dot
  products where the CPU has them; otherwise, and for fp32 activations, fp32 FMAs on weights dequantized in
  registers). It streams 0.5625 bytes per weight once per call. bf16 activations of :data:`DEQUANT_ROWS` rows or
  more: the weight dequantized to bf16 (the library, a block of rows at a time) and torch's bf16 GEMM.
* Otherwise (no compiler, CUDA, fp16): dequantize to fp32 (to fp16 for fp16 activations) and one GEMM — the exact
  reference computation, slow on CPU since the weight is expanded on every call.
* Opt-in (a recipe's ``int4_activations = "int8"``: ``act_int8`` on :class:`Int4Linear`, :class:`Int4Experts`, the
  int4 table's head and :class:`Int4Head`): on CPUs with AVX512-VNNI, calls of fewer than :data:`VNNI_ROWS` rows
  quantize each activation row to int8 per group of 64 (llama.cpp's Q8_0 scheme) and run
  :func:`localdiff.kernels.int4_vnni.dense_matmul` — not exact in the activations (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.layers import MoEExperts, gelu_tanh
from localdiff.kernels import int4 as native4
from localdiff.kernels import int4_vnni

GROUP = 64
#: bytes per weight of the format (4-bit code + a 16-bit scale and a 16-bit zero per group of 64)
BYTES_PER_WEIGHT = 0.5 + 4 / GROUP


def groups(k: int) -> int:
    """Number of groups of an ``in_features = k`` row."""
    return (k + GROUP - 1) // GROUP


def _round_up_bf16(v: torch.Tensor) -> torch.Tensor:
    b = v.to(torch.bfloat16)
    return torch.where(b.float() < v, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise 4-bit quantization of the last dimension (module docstring: format and method).

    Args:
        w: float Tensor[..., out, in] (2-D linear weight or 3-D stacked experts); computed in fp32 one leading slice
            at a time (the fp32 temporary is at most one expert's weight).
    Returns:
        (packed uint8 Tensor[..., out, G·32], scale bf16 Tensor[..., out, G], zero fp16 Tensor[..., out, G]) with
        G = ceil(in / 64).
    """
    if w.dim() > 2:
        parts = [quantize_tensor(w[i]) for i in range(w.shape[0])]
        return tuple(torch.stack(p) for p in zip(*parts))  # type: ignore[return-value]
    n, k = w.shape
    g = groups(k)
    pad = g * GROUP - k
    wf = w.detach().float().contiguous()
    if pad:  # pad each row with its last value (in the last group: its min / max unchanged); codes zeroed below
        wf = torch.cat([wf, wf[:, k - 1 : k].expand(n, pad)], dim=1)
    elif wf.data_ptr() == w.data_ptr():
        wf = wf.clone()  # worked on in place below
    wg = wf.view(n, g, GROUP)
    lo, hi = torch.aminmax(wg, dim=-1)
    exact = torch.maximum((hi - lo) / 15.0, torch.maximum(lo.abs(), hi.abs()) / 256.0)
    exact = torch.where(exact > 0, exact, torch.ones_like(exact))  # an all-zero group: s = 1, z = 0
    scale = _round_up_bf16(exact)
    zero = (-lo / scale.float()).to(torch.float16)
    q = wg.div_(scale.float()[..., None]).add_(zero.float()[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    if pad:
        q.view(n, g * GROUP)[:, k:] = 0
    return pack_codes(q.view(n, g * GROUP)), scale, zero


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes Tensor[..., out, G·64] (values 0..15) → packed uint8 Tensor[..., out, G·32] (module docstring)."""
    *lead, n, kp = codes.shape
    c = codes.reshape(*lead, n, kp // GROUP, 2, GROUP // 2)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, n, kp // 2)


def unpack_codes(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """packed uint8 Tensor[..., out, G·32] → uint8 codes Tensor[..., out, k] (default k = G·64)."""
    *lead, n, half = packed.shape
    p = packed.reshape(*lead, n, half // (GROUP // 2), 1, GROUP // 2)
    codes = torch.cat([p & 15, p >> 4], dim=-2).reshape(*lead, n, half * 2)
    return codes if k is None else codes[..., :k]


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    k: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``s · (q − z)`` computed in fp32 (float64 when ``dtype`` is float64), returned in ``dtype``.

    Args:
        packed, scale, zero: the format of the module docstring ([..., out, G·32], [..., out, G], [..., out, G]).
        k: in_features (default G·64).
    Returns:
        Tensor[..., out, k].
    """
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    codes = unpack_codes(packed).to(ct)
    *lead, n, kp = codes.shape
    c = codes.view(*lead, n, kp // GROUP, GROUP)
    w = (c - zero.to(ct)[..., None]) * scale.to(ct)[..., None]
    w = w.reshape(*lead, n, kp)
    return (w if k is None else w[..., :k]).to(dtype)


#: bf16 activations with at least this many rows: weights dequantized to bf16 a block of rows at a time, then torch's
#: bf16 GEMM (the native kernel is exact but reaches about half the GEMM's throughput there; int8 does the same
#: above 16 rows). Fewer rows, or fp32 activations: the native kernel.
DEQUANT_ROWS = 32
_BLOCK_BYTES = 8 << 20
#: bf16 experts with fewer rows than this each run in one native call for all experts (Int4Experts.forward): past
#: DEQUANT_ROWS the kernel is a little slower per expert than dequantize + GEMM, but the per-expert Python it saves
#: costs more (a canvas of 256 tokens, top-8 of 128: ~16 rows each, the largest often 32-60)
GROUPED_MAX_ROWS = 128
#: ``act_int8`` calls with fewer rows than this run the int4 × int8 VNNI kernel (:func:`int4_matmul`): measured
#: faster than the exact native kernel at every row count below :data:`DEQUANT_ROWS` (docs/BENCHMARKS.md)
VNNI_ROWS = DEQUANT_ROWS


def _dequant_gemm(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """bf16 x2 [M, K] @ bf16(dequantize(...))ᵀ: blocks of rows dequantized by the native library (≤ 8 MiB each)."""
    n, g = scale.shape
    kp = g * GROUP
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    xp = F.pad(x2, (0, kp - x2.shape[1])) if x2.shape[1] < kp else x2
    nb = min(n, max(16, _BLOCK_BYTES // (kp * 2)))
    buf = torch.empty(nb, kp, dtype=torch.bfloat16)
    if nb == n:
        return F.linear(xp, native4.dequantize_bf16(packed, scale, zero, 0, n, buf))
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    for a in range(0, n, nb):
        b = min(n, a + nb)
        y[:, a:b] = F.linear(xp, native4.dequantize_bf16(packed, scale, zero, a, b, buf))
    return y


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, act_int8: bool = False
) -> torch.Tensor:
    """``x @ dequantize(packed, scale, zero)ᵀ`` with the kernel of the module docstring.

    Args:
        x: Tensor[..., in] (fp32, bf16 or fp16) on packed's device; ``in`` ≤ G·64 (the rest of the last group is
            zero padding).
        packed: uint8 Tensor[out, G·32]; scale: bf16 Tensor[out, G]; zero: fp16 Tensor[out, G].
        act_int8: the opt-in int8-activation kernel for fewer than :data:`VNNI_ROWS` rows (module docstring; CPU,
            fp32 / bf16, no autograd, the VNNI library loaded — else the exact kernels).
    Returns:
        Tensor[..., out] in x's dtype.
    Raises:
        ValueError: x's last dimension does not fit the weight's groups.
    """
    shape = x.shape
    k = shape[-1]
    n, g = scale.shape
    if groups(k) != g or packed.shape[-1] != g * GROUP // 2:
        raise ValueError(f"int4 matmul: x has {k} features, the weight {g} groups of {GROUP}")
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_zeros(*shape[:-1], n)
    if (
        act_int8
        and x2.shape[0] < VNNI_ROWS
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not (x.requires_grad and torch.is_grad_enabled())
        and int4_vnni.library() is not None
    ):
        return int4_vnni.dense_matmul(x2, packed, scale, zero).reshape(*shape[:-1], n)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and native4.library() is not None:
        if x.dtype == torch.bfloat16 and x2.shape[0] >= DEQUANT_ROWS:
            return _dequant_gemm(x2, packed, scale, zero).reshape(*shape[:-1], n)
        return native4.matmul(x2, packed, scale, zero).reshape(*shape[:-1], n)
    ct = torch.float16 if x.dtype == torch.float16 else torch.float32
    y = F.linear(x2.to(ct), dequantize(packed, scale, zero, k, ct))
    return y.to(x.dtype).reshape(*shape[:-1], n)


class Int4Linear(nn.Module):
    """Bias-optional linear layer with a group-wise int4 weight (module docstring).

    State (checkpoint names ``<module>.weight``, ``.weight_scale``, ``.weight_zero``): weight uint8 Tensor[out, G·32],
    weight_scale bf16 Tensor[out, G], weight_zero fp16 Tensor[out, G]; bias float Tensor[out] or None.
    forward(x: Tensor[..., in]) -> Tensor[..., out] in x's dtype (:func:`int4_matmul`). ``act_int8`` (set from a
    recipe's ``int4_activations = "int8"``): few-row calls on int8 activations by AVX512-VNNI (module docstring).
    """

    act_int8 = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        g = groups(in_features)
        self.register_buffer("weight", torch.zeros(out_features, g * GROUP // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, g, dtype=torch.bfloat16, device=device))
        self.register_buffer("weight_zero", torch.zeros(out_features, g, dtype=torch.float16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "Int4Linear":
        """Quantize a float nn.Linear (the new module holds only codes, scales and zero points)."""
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        m.weight, m.weight_scale, m.weight_zero = quantize_tensor(lin.weight)
        if lin.bias is not None:
            m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_matmul(x, self.weight, self.weight_scale, self.weight_zero, self.act_int8)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


class Int4Experts(MoEExperts):
    """Stacked int4 experts; the grouped forward of :class:`localdiff.arch.layers.MoEExperts` (tokens sorted by
    expert, one call per active expert, as :class:`localdiff.quantize.int8.Int8Experts`) runs :meth:`expert_ffn`
    on int4 weights.

    State (checkpoint names): gate_up_proj uint8 Tensor[E, 2I, G_H·32] + ``_scale`` bf16 / ``_zero`` fp16
    Tensor[E, 2I, G_H]; down_proj uint8 Tensor[E, H, G_I·32] + ``_scale`` / ``_zero`` Tensor[E, H, G_I].

    ``act_int8`` (set from a recipe's ``int4_activations = "int8"``): on CPUs with AVX512-VNNI both projections
    quantize their activations to int8 per row and group of 64 (:mod:`localdiff.kernels.int4_vnni`), in the grouped
    call and in :meth:`expert_ffn` alike; elsewhere it has no effect (exact kernels).
    """

    act_int8 = False

    def __init__(self, num_experts: int, hidden: int, inter: int, device=None):
        nn.Module.__init__(self)
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            g = groups(cols)
            self.register_buffer(name, torch.zeros(num_experts, rows, g * GROUP // 2, dtype=torch.uint8, device=device))
            self.register_buffer(name + "_scale", torch.ones(num_experts, rows, g, dtype=torch.bfloat16, device=device))
            self.register_buffer(name + "_zero", torch.zeros(num_experts, rows, g, dtype=torch.float16, device=device))

    @classmethod
    def from_experts(cls, ex: MoEExperts) -> "Int4Experts":
        """Quantize float stacked experts expert by expert."""
        e, two_i, h = ex.gate_up_proj.shape
        m = cls(e, h, two_i // 2, device="meta")
        m.gate_up_proj, m.gate_up_proj_scale, m.gate_up_proj_zero = quantize_tensor(ex.gate_up_proj)
        m.down_proj, m.down_proj_scale, m.down_proj_zero = quantize_tensor(ex.down_proj)
        return m

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """As :meth:`MoEExperts.forward` (x [N, H], fp32 weights [N, K], index [N, K] → [N, H]). On CPU with the
        native library and fewer than :data:`GROUPED_MAX_ROWS` rows per expert (fp32: any): both projections of all
        experts in one library call each (:func:`localdiff.kernels.int4.grouped_matmul`; bit-equal to the
        per-expert loop, without its per-expert Python); otherwise the loop."""
        if not (
            x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.is_grad_enabled()
            and native4.library() is not None
        ):
            return super().forward(x, weights, index)
        k = index.shape[1]
        flat = index.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        vnni = self._vnni(x)
        if not vnni and x.dtype == torch.bfloat16 and int(counts.max()) >= GROUPED_MAX_ROWS:
            return super().forward(x, weights, index)
        order = torch.argsort(flat, stable=True)
        token = order // k
        off = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=off[1:])
        mm = int4_vnni.grouped_matmul if vnni else native4.grouped_matmul
        gate, up = mm(
            x.index_select(0, token), off, self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_zero
        ).chunk(2, dim=-1)
        ys = mm(gelu_tanh(gate) * up, off, self.down_proj, self.down_proj_scale, self.down_proj_zero)
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _vnni(self, x: torch.Tensor) -> bool:
        """Whether the int8-activation kernel runs for x (``act_int8``, CPU, bf16 / fp32, no autograd, library)."""
        return (
            self.act_int8
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and not torch.is_grad_enabled()
            and int4_vnni.library() is not None
        )

    def expert_ffn(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x: Tensor[N, H] → Tensor[N, H] (gelu-tanh gated FFN on int4 weights)."""
        mm = int4_vnni.matmul if self._vnni(x) else int4_matmul
        gate, up = mm(x, self.gate_up_proj[e], self.gate_up_proj_scale[e], self.gate_up_proj_zero[e]).chunk(2, dim=-1)
        return mm(gelu_tanh(gate) * up, self.down_proj[e], self.down_proj_scale[e], self.down_proj_zero[e])


class Int4Head:
    """An int4 copy of a model's LM head for its logits (a recipe's ``head = "int8"`` applied with int4, or
    ``head = "int4"``), kept outside the state dict like :class:`localdiff.quantize.int8.Int8Head`: adds
    ``rows · H · 0.5625`` bytes beside the float head / tied embedding.

    ``__call__(h: Tensor[..., H]) -> Tensor[..., rows]`` in h's dtype (:func:`int4_matmul`; ``act_int8`` as
    :class:`Int4Linear`'s).
    """

    act_int8 = False

    def __init__(self, w: torch.Tensor):
        self.weight, self.weight_scale, self.weight_zero = quantize_tensor(w)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return int4_matmul(h, self.weight, self.weight_scale, self.weight_zero, self.act_int8)


QUANT_TYPES = (Int4Linear, Int4Experts)


def int4_entries(local: str, t: torch.Tensor, device=None) -> dict[str, torch.Tensor]:
    """Quantize one float tensor while loading: ``{local: codes, local + "_scale": bf16, local + "_zero": fp16}`` on
    ``device`` (for a loader filling modules made by :func:`localdiff.quantize.apply.convert_modules`)."""
    q, s, z = quantize_tensor(t.to(device) if device is not None else t)
    out = {local: q, local + "_scale": s, local + "_zero": z}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out
