"""int8 weights × int8 activations by AVX512-VNNI (``int8_vnni.c``): the int8 linear layers' calls of a few rows
(block steps of several requests packed into one forward: 4 rows a request) at twice ``vdpbf16ps``'s multiply rate.

``y = scale · (dequantize_int8(x) @ qᵀ)`` for :mod:`localdiff.quantize.int8`'s format (q int8 [N, K], scale bf16 or
fp32 [N], unchanged: no repacking), where each activation row is quantized once per call to int8 in groups of 64
features, symmetric absmax (as :mod:`localdiff.kernels.int4_vnni`): ``sx = amax / 127``, ``xi = round_half_even(x ·
(127 / amax))`` in fp32. A group follows the weight's byte order (no weight byte is moved in registers): a row is cut
into blocks of 1024 features and feature k belongs to group ``16·(k // 1024) + (k % 64) // 4`` (:func:`groups_of`).
``vpdpbusd`` multiplies 64 int8 pairs per instruction (weights fed as ``q ^ 0x80 = q + 128``, the activation-only
term ``128 · Σ xi`` taken off in int32), so each group's sum is exact; the result equals a float64 product of the
dequantized int8 activations and the int8 weights up to fp32 rounding (tests/quant/test_int8_vnni.py), each row's
result independent of the other rows and the threads. A recipe opts in with ``int8_activations = "int8"``
(:mod:`localdiff.quantize.recipe`).

Build: :mod:`localdiff.kernels.build`. No AVX512-VNNI (or no compiler, or ``LOCALDIFF_NATIVE_INT8_VNNI=0``) →
:func:`library` is None, :func:`status` says why, and the int8 layers keep their exact kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from localdiff.kernels import build as _native

SOURCE = Path(__file__).with_name("int8_vnni.c")
ENV = "LOCALDIFF_NATIVE_INT8_VNNI"
BLOCK = 1024  # features per block: 16 groups of 64


def load(path) -> ctypes.CDLL:
    """Load a built library and set its ctypes signatures (raises OSError / AttributeError on a bad file)."""
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_int8_vnni_quantize(void*, int, long, long, long, void*, void*)",
        "int localdiff_int8_vnni_mm(void*, int, long, long, long, void*, long, void*, int, void*, int, long, int)",
        "int localdiff_int8_vnni_available()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    if not lib.localdiff_int8_vnni_available():
        return None, "native int8 x int8 kernel unavailable: this CPU or build has no AVX512-VNNI"
    return lib, f"native int8 x int8 kernel: AVX512-VNNI vpdpbusd ({_native.built_with(cc, flags)})"


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_int8_vnni.so",
    load,
    _ready,
    unavailable=lambda why: f"native int8 x int8 kernel unavailable: {why}",
    off=lambda: f"native int8 x int8 kernel off ({ENV}=0)" if _native.switched_off(ENV) else None,
)
library = _KERNEL.library  # the loaded library (built on first use), or None (status() says why)
status = _KERNEL.status  # one line: what runs, or why nothing does
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def groups_of(k: int) -> torch.Tensor:
    """The activation group of each of ``k`` features: int64 Tensor[k], ``16·(i // 1024) + (i % 64) // 4``."""
    i = torch.arange(k)
    return 16 * (i // BLOCK) + (i % 64) // 4


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError("native int8 x int8 matmul: bf16 or fp32 activations [M, K] with unit K stride")


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization alone (module docstring): x bf16 / fp32 Tensor[M, K] → (int8
    Tensor[M, 1024·B], zeros past K; fp32 scales Tensor[M, 16·B], group g's ``sx``), B = ⌈K / 1024⌉; ``x[:, k] ≈
    xi[:, k] · sx[:, groups_of(K)[k]]``. Raises RuntimeError without :func:`library`, ValueError on bad x."""
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    _check_x(x)
    m, k = x.shape
    b = (k + BLOCK - 1) // BLOCK
    xi = torch.empty(m, b * BLOCK, dtype=torch.int8)
    sx = torch.empty(m, b * 16, dtype=torch.float32)
    rc = lib.localdiff_int8_vnni_quantize(
        x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, k, xi.data_ptr(), sx.data_ptr()
    )
    if rc:
        raise MemoryError("native int8 x int8 quantize: out of memory")
    return xi, sx


def matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    threads: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``scale · (quantize(x) @ qᵀ)`` by ``localdiff_int8_vnni_mm`` (module docstring): each output summed in an
    order independent of the row count and the threads (rows bit-identical alone and in a batch).

    Args:
        x: bf16 or fp32 Tensor[M, K] with unit K stride (any row stride).
        q: int8 Tensor[N, K]; scale: bf16 or fp32 Tensor[N].
        threads: threads splitting N (default ``torch.get_num_threads()``).
        out_dtype: fp32 or bf16 (default x's; bf16 rounded once from the fp32 result, as a cast).
    Returns:
        Tensor[M, N].
    Raises:
        ValueError: other dtypes or shapes; MemoryError: out of memory; RuntimeError: no VNNI library loaded.
    """
    lib = _KERNEL.require()
    _check_x(x)
    m, k = x.shape
    n = q.shape[0]
    if q.dtype != torch.int8 or q.shape != (n, k) or scale.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("native int8 x int8 matmul: int8 q [N, K] with x's K, bf16 / fp32 scale [N]")
    if scale.shape != (n,):
        raise ValueError("native int8 x int8 matmul: scale [N]")
    q, scale = q.contiguous(), scale.contiguous()
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    rc = lib.localdiff_int8_vnni_mm(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.stride(0),
        m,
        k,
        q.data_ptr(),
        n,
        scale.data_ptr(),
        int(scale.dtype == torch.bfloat16),
        y.data_ptr(),
        int(y.dtype == torch.bfloat16),
        n,
        threads or torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("native int8 x int8 matmul: out of memory")
    if rc < -1:
        raise ValueError(f"native int8 x int8 matmul: no VNNI path (code {rc})")
    return y if y.dtype == out_dtype else y.to(out_dtype)
