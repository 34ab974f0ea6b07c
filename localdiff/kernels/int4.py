"""The native int4 matmul (``int4.c``): compiled on first use with the system C compiler, loaded with ctypes.

``y = x @ dequantize(packed, scale, zero)ᵀ`` for the group-wise int4 format of :mod:`localdiff.quantize.int4`
(packed uint8 [N, G·32], scale bf16 [N, G], zero fp16 [N, G]) and fp32 or bf16 activations x [M, K], any M. The
weight is streamed once per call, 0.5625 bytes per weight, and dequantized in registers; no activation
quantization (the result equals a float64 dequantize-then-matmul up to fp32 summation: tests/quant/test_int4.py).

Paths (one per build; ``int4.c`` says how each works):

* ``bf16-dot`` — bf16 activations on a CPU with AVX512-BF16 (e.g. AMD Zen 4, Intel Sapphire Rapids):
  ``vdpbf16ps`` on exact bf16 codes, one FMA per group for the scale. It needs half the instructions of fp32 FMAs,
  which matters from ~4 rows on, where the FMA kernels are bound by instructions rather than by memory.
* ``fma`` — fp32 FMAs on weights dequantized in registers: fp32 activations, bf16 ones without AVX512-BF16 (cast to
  fp32 first), or forced with ``LOCALDIFF_NATIVE_INT4=fma``. zmm on AVX-512, ymm on AVX2, plain C vectors elsewhere.

Build: :mod:`localdiff.kernels.build` (``$CC -O3 -march=native -fPIC -shared``, without ``-march=native`` when
the compiler refuses it, into the user cache keyed by source, compiler, flags and CPU flags; a finished build is
reused). No compiler, a failed compile or ``LOCALDIFF_NATIVE_INT4=0`` → :func:`library` is None, :func:`status`
says why in one line, and :func:`localdiff.quantize.int4.int4_matmul` dequantizes and runs a torch GEMM instead.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from localdiff.kernels import build as _native
from localdiff.kernels.build import compiler as _compiler  # a module name here: tests patch it

SOURCE = Path(__file__).with_name("int4.c")
ENV = "LOCALDIFF_NATIVE_INT4"
GROUP = 64


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and set its ctypes signatures (raises OSError / AttributeError on a bad file)."""
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_int4_mm(void*, int, long, long, long, void*, long, void*, void*, void*, long, int, int)",
        "int localdiff_int4_mm_grouped(void*, int, long, void*, long, long, void*, long, void*, void*, void*, "
        "long, int, int)",
        "int localdiff_int4_dequant_bf16(void*, void*, void*, long, long, long, void*)",
        "int localdiff_int4_has_bf16()",
        "int localdiff_int4_vector_width()",
    )


def bf16_dot(lib: ctypes.CDLL | None = None) -> bool:
    """Whether bf16 activations run the AVX512-BF16 path with ``lib`` (default: the loaded library) in this process
    (not when ``LOCALDIFF_NATIVE_INT4=fma``)."""
    lib = lib if lib is not None else library()
    return lib is not None and bool(lib.localdiff_int4_has_bf16()) and os.environ.get(ENV, "").strip().lower() != "fma"


#: (the library loaded by :func:`library`, :func:`bf16_dot` of it when it loaded): matmul's per-call answer
_DOT: list = [None, False]


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    _DOT[:] = [lib, bf16_dot(lib)]
    dot = "AVX512-BF16 dot products for bf16 activations, " if _DOT[1] else ""
    return lib, (
        f"native int4 kernel: {dot}{lib.localdiff_int4_vector_width()}-lane fp32 FMA ({_native.built_with(cc, flags)})"
    )


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_int4.so",
    load,
    _ready,
    unavailable=lambda why: f"native int4 kernel unavailable: {why}",
    off=lambda: f"native int4 kernel off ({ENV}=0)" if _native.switched_off(ENV) else None,
    compiler=lambda: _compiler(),
)
#: :meth:`Kernel.build`: compile ``int4.c`` with ``cc`` and ``flags`` into ``out_dir`` (default: the keyed cache
#: folder); returns the library's path. Raises RuntimeError (the compiler's first error line) when it fails.
build = _KERNEL.build
library = _KERNEL.library  # the loaded library, built on the first call; None when unavailable (status())
status = _KERNEL.status  # one line: which native int4 kernel is loaded, or why none is
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    threads: int | None = None,
    lib: ctypes.CDLL | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ dequantize(packed, scale, zero)ᵀ`` by the native kernel (module docstring for the paths).

    Args:
        x: bf16 or fp32 Tensor[M, K], K ≤ G·64 (padded with zeros to G·64 here when shorter).
        packed: uint8 Tensor[N, G·32]; scale: bf16 Tensor[N, G]; zero: fp16 Tensor[N, G] (made contiguous).
        threads: threads splitting N (default ``torch.get_num_threads()``).
        lib: a library from :func:`load` (tests of other builds); default :func:`library`, which must not be None.
        out_dtype: the result's dtype (default x's; fp32 gives the kernel's sums unrounded; bf16 is rounded by
            the kernel itself, equal to casting the fp32 result).
    Returns:
        Tensor[M, N] in ``out_dtype`` (computed in fp32).
    Raises:
        ValueError: other dtypes or shapes.
    """
    lib = lib if lib is not None else (_KERNEL.lib if _KERNEL.lib is not None else library())
    m, k = x.shape
    n, g = scale.shape
    if (
        x.dtype not in (torch.float32, torch.bfloat16)
        or packed.dtype != torch.uint8
        or scale.dtype != torch.bfloat16
        or zero.dtype != torch.float16
        or tuple(zero.shape) != (n, g)
        or tuple(packed.shape) != (n, g * GROUP // 2)
        or k > g * GROUP
    ):
        raise ValueError(
            "native int4 matmul: bf16/fp32 x [M, K], uint8 codes [N, G*32], bf16 scale and fp16 zero [N, G], K <= 64 G"
        )
    dot = x.dtype == torch.bfloat16 and (_DOT[1] if lib is _DOT[0] else bf16_dot(lib))
    xx = x if dot else x.float()
    if k < g * GROUP:
        xx = F.pad(xx, (0, g * GROUP - k))
    elif xx.stride(1) != 1:
        xx = xx.contiguous()
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    out_dtype = out_dtype or x.dtype
    ybf = out_dtype == torch.bfloat16  # the kernel rounds to bf16 itself: no fp32 result and cast
    y = torch.empty(m, n, dtype=torch.bfloat16 if ybf else torch.float32)
    rc = lib.localdiff_int4_mm(
        xx.data_ptr(),
        int(dot),
        xx.stride(0),
        m,
        g,
        packed.data_ptr(),
        n,
        scale.data_ptr(),
        zero.data_ptr(),
        y.data_ptr(),
        n,
        threads or torch.get_num_threads(),
        int(ybf),
    )
    if rc == -2:
        raise MemoryError("native int4 matmul: out of memory")
    return y if out_dtype in (torch.float32, torch.bfloat16) else y.to(out_dtype)


def dequantize_bf16(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    n0: int,
    n1: int,
    out: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Rows ``n0 .. n1 − 1`` of ``dequantize(packed, scale, zero)`` rounded to bf16, written into ``out``
    (bf16 Tensor[≥ n1 − n0, G·64], contiguous) by the kernel library: bit-equal to
    :func:`localdiff.quantize.int4.dequantize` with ``dtype=torch.bfloat16``. Returns ``out[: n1 − n0]``.
    packed / scale / zero: the contiguous int4 format ([N, G·32] uint8, [N, G] bf16, [N, G] fp16)."""
    lib = lib if lib is not None else library()
    g = scale.shape[1]
    lib.localdiff_int4_dequant_bf16(packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), g, n0, n1, out.data_ptr())
    return out[: n1 - n0]


def grouped_matmul(
    xs: torch.Tensor,
    offsets: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    threads: int | None = None,
) -> torch.Tensor:
    """Stacked int4 experts in one call: rows ``offsets[e] .. offsets[e + 1] − 1`` of ``xs`` times expert e's weight,
    each row computed as :func:`matmul` computes it (bit-equal to one call per expert).

    Args:
        xs: bf16 or fp32 Tensor[R, K], rows sorted by expert; offsets: int64 Tensor[E + 1] (offsets[0] = 0,
            offsets[E] = R); packed: uint8 Tensor[E, N, G·32]; scale: bf16 / zero: fp16 Tensor[E, N, G].
    Returns:
        Tensor[R, N] in xs's dtype.
    Raises:
        ValueError: other dtypes or shapes; MemoryError: the kernel ran out of memory.
    """
    lib = _KERNEL.lib if _KERNEL.lib is not None else library()
    r, k = xs.shape
    e, n, g = scale.shape
    if (
        xs.dtype not in (torch.float32, torch.bfloat16)
        or tuple(packed.shape) != (e, n, g * GROUP // 2)
        or tuple(zero.shape) != (e, n, g)
        or k > g * GROUP
        or tuple(offsets.shape) != (e + 1,)
    ):
        raise ValueError(
            "native int4 grouped matmul: x [R, K], offsets [E+1], codes [E, N, G*32], scale / zero [E, N, G], K <= 64 G"
        )
    dot = xs.dtype == torch.bfloat16 and bf16_dot(lib)
    xx = xs if dot else xs.float()
    xx = F.pad(xx, (0, g * GROUP - k)) if k < g * GROUP else xx.contiguous()
    ybf = xs.dtype == torch.bfloat16
    y = torch.empty(r, n, dtype=torch.bfloat16 if ybf else torch.float32)
    off = offsets.to(torch.int64).contiguous()
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    rc = lib.localdiff_int4_mm_grouped(
        xx.data_ptr(),
        int(dot),
        xx.stride(0),
        off.data_ptr(),
        e,
        g,
        packed.data_ptr(),
        n,
        scale.data_ptr(),
        zero.data_ptr(),
        y.data_ptr(),
        n,
        threads or torch.get_num_threads(),
        int(ybf),
    )
    if rc == -2:
        raise MemoryError("native int4 matmul: out of memory")
    return y
