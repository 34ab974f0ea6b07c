"""The native per-row bf16 ops of a dense layer (``rowops.c``): RMSNorm, and Qwen3's per-head q/k RMSNorm + RoPE,
one library call each instead of 8 resp. ~20 torch ops, compiled on first use (:mod:`localdiff.kernels.build`).

At one token a step the dense families' layers run ~85 norms and 28 q/k rotations of a few thousand values each:
their cost is the torch ops' dispatch (~3–6 µs each on one core here), not the arithmetic. The kernels round where
torch's bf16 ops round (``rowops.c`` spells the formulas), so the results equal :func:`localdiff.arch.dense.llama_rms_norm`
and ``apply_rope`` except where a different order of the sum of squares moves the last bit
(tests/arch/test_rowops.py). ``LOCALDIFF_NATIVE_ROWOPS=0`` switches them off; without a C compiler they are off and
:func:`status` says why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from localdiff.kernels import build as _native

SOURCE = Path(__file__).with_name("rowops.c")
ENV = "LOCALDIFF_NATIVE_ROWOPS"


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and set its ctypes signatures (raises OSError / AttributeError on a bad file)."""
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_rms_norm_bf16(void*, long, long, long, void*, float, void*, long)",
        "int localdiff_qk_norm_rope_bf16(void*, long, long, long, long, long, void*, void*, float, void*, "
        "void*, void*)",
    )


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_rowops.so",
    load,
    lambda lib, cc, flags: (lib, f"native row ops ({_native.built_with(cc, flags)})"),
    unavailable=lambda why: f"native row ops unavailable: {why}",
    off=lambda: f"native row ops off ({ENV}=0)" if _native.switched_off(ENV) else None,
)
library = _KERNEL.library  # the loaded library, built on the first call; None when unavailable (status())
status = _KERNEL.status  # one line: whether the native row ops run, or why not
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def _lib():
    return _KERNEL.lib if _KERNEL.lib is not None else library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """``llama_rms_norm(x, weight, eps)`` for bf16 x by the library, or None when it does not apply (the caller runs
    the torch ops).

    Args:
        x: bf16 CPU Tensor[..., D], contiguous; weight: bf16 Tensor[D] or None.
    Returns:
        bf16 Tensor like x, or None: another dtype / device / layout, or no library (:func:`status`).
    """
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or not x.is_contiguous()
        or x.numel() == 0
        or (weight is not None and (weight.dtype != torch.bfloat16 or not weight.is_contiguous()))
    ):
        return None
    lib = _lib()
    if lib is None:
        return None
    d = x.shape[-1]
    out = torch.empty_like(x)
    lib.localdiff_rms_norm_bf16(
        x.data_ptr(), x.numel() // d, d, d, None if weight is None else weight.data_ptr(), eps, out.data_ptr(), d
    )
    return out


def qk_norm_rope(
    qk: torch.Tensor, hq: int, wq: torch.Tensor, wk: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor | None:
    """Qwen3's q/k path on the q and k heads of a fused q/k/v output: per-head RMSNorm (weight ``wq`` on the first
    ``hq`` heads, ``wk`` on the rest), then full rotate-half RoPE with ``cos`` / ``sin`` cast to bf16 — equal to
    :class:`localdiff.arch.dense.Attention`'s torch ops (module docstring) — or None when it does not apply.

    Args:
        qk: bf16 CPU Tensor[B, n, hq + hk, D], heads of D contiguous values back to back (strides (·, ·, D, 1)).
        wq, wk: bf16 Tensor[D]; cos, sin: fp32 Tensor[n, D] (the n tokens' positions, the same for every batch row).
    Returns:
        a new bf16 Tensor[B, n, hq + hk, D], or None: other dtypes / layouts, D odd or > 512, partial rotary, or no
        library (:func:`status`).
    """
    b, n, h, d = qk.shape
    if (
        qk.dtype != torch.bfloat16
        or qk.device.type != "cpu"
        or qk.stride(3) != 1
        or qk.stride(2) != d
        or wq.dtype != torch.bfloat16
        or wk.dtype != torch.bfloat16
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or tuple(cos.shape) != (n, d)
        or tuple(sin.shape) != (n, d)
        or d % 2
        or d > 512
    ):
        return None
    lib = _lib()
    if lib is None:
        return None
    cos, sin, wq, wk = cos.contiguous(), sin.contiguous(), wq.contiguous(), wk.contiguous()
    out = torch.empty(b, n, h, d, dtype=torch.bfloat16)
    for i in range(b):  # the tables are per token: one call per batch row
        lib.localdiff_qk_norm_rope_bf16(
            qk[i].data_ptr(),
            n,
            qk.stride(1),
            hq,
            h - hq,
            d,
            wq.data_ptr(),
            wk.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            out[i].data_ptr(),
        )
    return out
