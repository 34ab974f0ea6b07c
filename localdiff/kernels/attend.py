"""The native small-query attention (``attend.c``): a few bf16 query rows over a bf16 K/V cache on CPUs with
AVX512-BF16, compiled on first use (:mod:`localdiff.kernels.build`) and loaded with ctypes.

What it replaces: ``torch.nn.functional.scaled_dot_product_attention`` for decoding steps (1-token steps, small
blocks) where every query row sees the same keys (no mask, or a per-key padding mask). Torch's CPU flash kernel
copies strided inputs, works in blocks sized for long queries and rounds the softmax weights to bf16; at 1 query row
over 513 cached keys (Qwen3-1.7B's 16 / 8 heads of 128) it took 0.41 ms a layer on one core here, against ~0.1 ms for
the K/V bytes alone. This kernel reads K and V in place (a cache's strided views), keeps the weights in fp32 and
writes the heads straight into the ``[B, n, heads·D]`` layout of the output projection. Numerics in ``attend.c``;
equal to a float64 computation within bf16 output rounding (tests/arch/test_attend_native.py).

``LOCALDIFF_NATIVE_ATTEND=0`` switches it off (torch's SDPA everywhere); without AVX512-BF16 or a C compiler it is
off too, and :func:`status` says why in one line.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from localdiff.kernels import build as _native

SOURCE = Path(__file__).with_name("attend.c")
ENV = "LOCALDIFF_NATIVE_ATTEND"
#: most query rows per call (per batch row): beyond this torch's blocked SDPA is the better kernel
MAX_ROWS = 16
HEAD_DIMS = (64, 128, 256)


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and set its ctypes signatures (raises OSError / AttributeError on a bad file)."""
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_attend(void*, long, long, long, void*, long, long, long, void*, long, long, long, "
        "void*, long, void*, long, long, long, long, long, long, float, int)",
        "int localdiff_attend_available()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    if not lib.localdiff_attend_available():
        return None, "native attention unavailable: no AVX512-BF16 in this build (torch's SDPA runs)"
    return lib, f"native small-query attention: AVX512-BF16 ({_native.built_with(cc, flags)})"


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_attend.so",
    load,
    _ready,
    unavailable=lambda why: f"native attention unavailable: {why}",
    off=lambda: f"native attention off ({ENV}=0)" if _native.switched_off(ENV) else None,
)
library = _KERNEL.library  # the loaded library, built on the first call; None when unavailable (status())
status = _KERNEL.status  # one line: whether the native attention runs, or why not
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, threads: int | None = None
) -> torch.Tensor | None:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)`` with its heads laid out for the
    output projection, by the native kernel — or None when it does not apply (the caller runs SDPA).

    Args:
        q: bf16 CPU Tensor[B, H, n, D]; k, v: bf16 Tensor[B, Hkv, L, D] (any strides with unit stride along D;
            query head h reads key-value head h // (H / Hkv)); D in :data:`HEAD_DIMS`, n ≤ :data:`MAX_ROWS`.
        mask: None (every key) or a Bool Tensor[B or 1, 1, 1, L] (True = may attend; the same keys for every row).
        threads: threads splitting the (batch, key-value head) pairs (default ``torch.get_num_threads()``).
    Returns:
        bf16 Tensor[B, n, H·D] (scale 1/√D), or None: another dtype, device, shape, mask or layout; no native
        library (:func:`status`); a row whose keys are all masked (SDPA decides what it gets).
    Raises:
        MemoryError: the kernel could not allocate its scores.
    """
    b, h, n, d = q.shape
    if (
        q.dtype != torch.bfloat16
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or q.device.type != "cpu"
        or n > MAX_ROWS
        or d not in HEAD_DIMS
        or k.dim() != 4
        or k.shape != v.shape
        or k.shape[0] != b
        or k.shape[3] != d
        or h % k.shape[1]
        or q.stride(3) != 1
        or k.stride(3) != 1
        or v.stride(3) != 1
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    ):
        return None
    hkv, length = k.shape[1], k.shape[2]
    mp, ms = None, 0
    if mask is not None:
        if (
            mask.dtype != torch.bool
            or mask.dim() != 4
            or mask.shape[1] != 1
            or mask.shape[2] != 1
            or mask.shape[3] != length
            or mask.shape[0] not in (1, b)
            or mask.stride(3) != 1
        ):
            return None
        mp, ms = mask.data_ptr(), (mask.stride(0) if mask.shape[0] == b else 0)
    lib = _KERNEL.lib if _KERNEL.lib is not None else library()
    if lib is None:
        return None
    out = torch.empty(b, n, h * d, dtype=torch.bfloat16)
    rc = lib.localdiff_attend(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        mp,
        ms,
        out.data_ptr(),
        b,
        h,
        hkv,
        n,
        length,
        d,
        1.0 / math.sqrt(d),
        threads or torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("native attention: out of memory")
    return out if rc == 0 else None
