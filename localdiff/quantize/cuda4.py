"""int4 on CUDA: which library kernel runs localdiff's group-wise int4 linear layers on a GPU.

On CPU :mod:`localdiff.kernels.int4` runs every int4 matmul. On a CUDA device, after loading,
:func:`convert_model` swaps each :class:`localdiff.quantize.int4.Int4Linear` for a module holding a library's own
layout (the same bytes: 0.5 per weight + 16-bit group constants), chosen by :func:`choose`:

* ``"tinygemm"`` (default for bf16 models): torch's ``aten._weight_int4pack_mm`` — the tinygemm kernel that
  torchao's ``Int4WeightOnlyConfig`` runs on CUDA — with groups of 64. tinygemm dequantizes ``w = (q − 8)·s + zt``
  with bf16 ``s`` and ``zt``; ours is ``w = s·(q − z)`` with a bf16 ``s`` and an fp16 ``z``, so ``zt = s·(8 − z)``
  rounded to bf16 (:func:`tinygemm_constants`): the only difference from our dequantization, at most
  ``|s·(8 − z)|·2⁻⁹`` per weight (≤ 1/64 of a quantization step for z in [0, 15]). Needs bf16 activations,
  ``in % 128 == 0`` and ``out % 16 == 0`` (torch's checks: CUDA asks out % 8, its CPU build out % 16); else
  "dequant".
* ``"bnb"`` (asked with ``LOCALDIFF_CUDA_INT4=bnb``; bitsandbytes installed): bitsandbytes' NF4 (blocks of 64,
  ``gemv_4bit`` at one row). NF4 is a fixed 16-value code book scaled by a block absmax, with no zero point, so our
  affine codes cannot be carried over: the dequantized weight is quantized a second time (an extra rounding; the
  GPU check reports its error). Not the default for that reason.
* ``"dequant"``: keep :class:`Int4Linear` (its forward dequantizes the weight for one GEMM): exact, any shape.

bitsandbytes is imported only when "bnb" is chosen, so CPU-only installs never import it. The tinygemm modules
also run on CPU through torch's ``_weight_int4pack_mm_for_cpu`` (same formula), which is how the tests check the
conversion without a GPU. ``.ci/gpu_check.sh`` runs the CUDA checks and timings where a GPU is lent.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from localdiff.errors import LocaldiffError
from localdiff.quantize import int4

ENV = "LOCALDIFF_CUDA_INT4"
BACKENDS = ("tinygemm", "bnb", "dequant")
INNER_K_TILES = 8


def bnb_installed() -> bool:
    """Whether bitsandbytes can be imported (checked without importing it)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def choose(
    device: torch.device | str,
    dtype: torch.dtype,
    in_features: int,
    out_features: int,
    env: str | None = None,
    bnb: bool | None = None,
) -> str:
    """The backend for an int4 linear layer ``[out, in]`` on ``device`` with activations of ``dtype`` (module
    docstring); "native" on CPU. ``env`` defaults to ``$LOCALDIFF_CUDA_INT4`` ("", "auto" or one of
    :data:`BACKENDS`); ``bnb`` (default :func:`bnb_installed`) whether bitsandbytes is there.

    Raises:
        LocaldiffError: an unknown ``LOCALDIFF_CUDA_INT4``, or "bnb" asked without bitsandbytes.
    """
    if torch.device(device).type != "cuda":
        return "native"
    want = (os.environ.get(ENV, "") if env is None else env).strip().lower() or "auto"
    if want not in BACKENDS + ("auto",):
        raise LocaldiffError(f"{ENV}={want!r}: use auto, {', '.join(BACKENDS)}")
    if want == "bnb":
        if not (bnb_installed() if bnb is None else bnb):
            raise LocaldiffError(f"{ENV}=bnb needs bitsandbytes (pip install bitsandbytes)")
        return "bnb"
    fits = dtype == torch.bfloat16 and in_features % (INNER_K_TILES * 16) == 0 and out_features % 16 == 0
    if want == "tinygemm" and not fits:
        return "dequant"  # tinygemm cannot take this shape / dtype: the exact fallback
    return "tinygemm" if want in ("auto", "tinygemm") and fits else "dequant"


def tinygemm_constants(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Our bf16 scale / fp16 zero [N, G] → tinygemm's ``scales_and_zeros`` bf16 Tensor[G, N, 2] (s, s·(8 − z))."""
    s = scale.float()
    zt = s * (8.0 - zero.float())
    return torch.stack([s, zt], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def tinygemm_dequantize(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """tinygemm's dequantization ``(q − 8)·s + zt`` in fp32: codes uint8 [N, K] (K = 64·G), sz [G, N, 2] →
    Tensor[N, K] (the reference the tests hold the kernels to)."""
    n, k = codes.shape
    s, zt = sz[..., 0].t().float(), sz[..., 1].t().float()  # [N, G]
    q = codes.float().view(n, k // int4.GROUP, int4.GROUP)
    return ((q - 8) * s[..., None] + zt[..., None]).view(n, k)


class TinygemmLinear(nn.Module):
    """An int4 linear layer in tinygemm's layout (module docstring). State: ``weight_int4pack`` (torch's packed
    int4, device-specific), ``scales_and_zeros`` bf16 Tensor[G, N, 2]; optional float ``bias`` [N].
    forward(x: Tensor[..., in]) → Tensor[..., out] in x's dtype (computed with bf16 activations)."""

    def __init__(self, lin: int4.Int4Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        codes = int4.unpack_codes(lin.weight)  # [N, Kp] values 0..15
        self.padded = codes.shape[1]
        self.scales_and_zeros = tinygemm_constants(lin.weight_scale, lin.weight_zero)
        if codes.is_cuda:  # torch's CUDA packing takes two codes a byte, the even k in the high nibble
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            self.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
        else:
            self.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), INNER_K_TILES
            )
        self.bias = lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.padded != self.in_features:
            x2 = nn.functional.pad(x2, (0, self.padded - self.in_features))
        op = torch.ops.aten._weight_int4pack_mm if x2.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = op(x2.contiguous(), self.weight_int4pack, int4.GROUP, self.scales_and_zeros).to(x.dtype)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class BnbNF4Linear(nn.Module):
    """An int4 linear layer requantized to bitsandbytes' NF4 (blocks of 64; module docstring: a second rounding).
    forward(x: Tensor[..., in]) → Tensor[..., out] in x's dtype (``bitsandbytes.matmul_4bit``)."""

    def __init__(self, lin: int4.Int4Linear):
        super().__init__()
        import bitsandbytes.functional as bf

        w = int4.dequantize(lin.weight, lin.weight_scale, lin.weight_zero, lin.in_features, torch.float32)
        self.weight_nf4, self.quant_state = bf.quantize_4bit(
            w.to(torch.bfloat16), blocksize=int4.GROUP, quant_type="nf4"
        )
        self.in_features, self.out_features, self.bias = lin.in_features, lin.out_features, lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        y = bnb.matmul_4bit(x.to(torch.bfloat16), self.weight_nf4.t(), quant_state=self.quant_state).to(x.dtype)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def convert_model(model: nn.Module, env: str | None = None, force_device: str | None = None) -> dict[str, int]:
    """Swap every :class:`Int4Linear` of ``model`` on a CUDA device for its :func:`choose`'s backend module
    (``force_device="cuda"``: choose as if on CUDA — the tests run the conversion on CPU). Stacked int4 experts and
    int4 embedding tables keep our layout (one expert's / one chunk's dequantization per call). Returns
    {backend: number of layers}."""
    counts: dict[str, int] = {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    swapped: set[int] = set()
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, int4.Int4Linear):
            continue
        dev = force_device or mod.weight.device
        b = choose(dev, dtype, mod.in_features, mod.out_features, env)
        counts[b] = counts.get(b, 0) + 1
        if b in ("native", "dequant"):
            continue
        new = TinygemmLinear(mod) if b == "tinygemm" else BnbNF4Linear(mod)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        swapped.add(id(mod))
    for owner in model.modules():  # fused q/k/v, gate/up (localdiff.quantize.fuse) of swapped layers: unfused
        for attr in ("qkv_fused", "gate_up_fused"):
            fused = getattr(owner, attr, None)
            if fused is not None and any(id(m) in swapped for m in getattr(fused, "mods", ())):
                setattr(owner, attr, None)
    return counts
