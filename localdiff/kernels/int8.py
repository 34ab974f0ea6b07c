"""The native small-M int8 matmul (``int8.c``): compiled on first use with the system C compiler, loaded
with ctypes.

``y[m, n] = scale[n] · Σ_k x[m, k] · q[n, k]`` for fp32 activations x [M, K] and the per-output-channel int8 weights
of :mod:`localdiff.quantize.int8` (q int8 [N, K], scale bf16 or fp32 [N]): the weight is streamed once, each int8
element converted to fp32 once and multiplied with all M rows (fused multiply-adds, M × R vector accumulators), so
a small-M product reads ~1 byte per weight instead of casting the weight per call. No activation quantization: the
result is ``dequantize(q, scale) @ xᵀ`` in fp32 up to the summation order.

Build: :mod:`localdiff.kernels.build` (``$CC -O3 -march=native -fPIC -shared``, without ``-march=native`` when the
compiler refuses it, into the user cache, keyed by the source, compiler, flags and CPU flags; a finished build is
reused). ``LOCALDIFF_NATIVE_INT8=fma`` keeps the FMA kernel where AMX or AVX512-BF16 would run.

bf16 activations on a CPU with AVX512-BF16 (and no AMX, or more than :data:`MAX_ROWS` rows) take the kernel's
``vdpbf16ps`` path: each int8 weight converted to bf16 once per call (exact), products exact in fp32, sums in fp32
(``dequantize(q, scale) @ xᵀ`` up to the summation order, subnormals flushed), twice the fp32 FMAs' multiply rate,
so block steps of several requests (4–16 rows) stay near the weight-read time (docs/BENCHMARKS.md, serve-batch).
No compiler, a failed compile or ``LOCALDIFF_NATIVE_INT8=0`` → :func:`library` is None and :func:`status` says why in
one line (the callers keep their torch kernels).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from localdiff.kernels import build as _native
from localdiff.kernels.build import compiler as _compiler  # a module name here: tests patch it

SOURCE = Path(__file__).with_name("int8.c")
ENV = "LOCALDIFF_NATIVE_INT8"

#: most activation rows the native kernel is offered for (its AMX path's tile width; more rows are prefill, where
#: the torch GEMMs win)
MAX_ROWS = 16

_HAS_AMX: dict = {}  # id(library) → bool
_HAS_BF16: dict = {}  # id(library) → bool: the AVX512-BF16 path runs bf16 activations


def _load(path: Path) -> ctypes.CDLL:
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_int8_mm(void*, long, long, long, void*, long, void*, int, void*, long, int)",
        "int localdiff_int8_vector_width()",
        "int localdiff_int8_mm_amx(void*, int, long, long, long, void*, long, void*, int, void*, int, long, int)",
        "int localdiff_int8_has_amx()",
        "int localdiff_int8_mm_bf16(void*, long, long, long, void*, long, void*, int, void*, int, long, int)",
        "int localdiff_int8_has_bf16dot()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    amx = bool(os.environ.get(ENV, "").strip().lower() != "fma" and lib.localdiff_int8_has_amx())
    _HAS_AMX[id(lib)] = amx
    bf16 = bool(os.environ.get(ENV, "").strip().lower() != "fma" and lib.localdiff_int8_has_bf16dot())
    _HAS_BF16[id(lib)] = bf16
    width = lib.localdiff_int8_vector_width()
    return lib, (
        f"native int8 kernel: {'AMX-INT8 tiles, ' if amx else ''}"
        f"{'AVX512-BF16 dot products (bf16 activations), ' if bf16 else ''}{width}-lane fp32 FMA "
        f"({_native.built_with(cc, flags)})"
    )


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_int8.so",
    _load,
    _ready,
    unavailable=lambda why: f"native int8 kernel unavailable: {why}",
    off=lambda: f"native int8 kernel off ({ENV}=0)" if _native.switched_off(ENV) else None,
    compiler=lambda: _compiler(),
)
#: :meth:`Kernel.build`: compile ``int8.c`` with ``cc`` and ``flags`` into ``out_dir`` (default: the keyed cache
#: folder); returns the library's path. Raises RuntimeError (the compiler's first error line) when it fails.
build = _KERNEL.build
library = _KERNEL.library  # the loaded library, built on the first call; None when unavailable (status())
status = _KERNEL.status  # one line: which native kernel is loaded, or why none is
reset = _KERNEL.reset  # forget the loaded library / failure (also localdiff.quantize.int8.reset_kernels)


def has_amx() -> bool:
    """True when the loaded library runs its AMX-INT8 path in this process."""
    lib = library()
    return lib is not None and bool(_HAS_AMX.get(id(lib)))


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``(x @ qᵀ) · scale`` by the native kernel (:func:`library` must not be None): AMX-INT8 when this CPU and
    process have it and M ≤ :data:`MAX_ROWS` (exact integer products of q with x rounded to 27 bits below its row's
    largest power of two, see ``int8.c``), else for bf16 x AVX512-BF16 dot products where the build has them (exact
    products, fp32 sums), else fp32 FMAs (x cast to fp32; exact fp32 products). Every path computes each row of x
    by the same instructions whatever M is (rows are bit-identical alone and in a batch) and whatever ``threads``.

    Args:
        x: bf16 or fp32 Tensor[M, K] with unit stride along K (any row stride).
        q: int8 Tensor[N, K], contiguous. scale: bf16 or fp32 Tensor[N], contiguous.
        threads: threads splitting N (default ``torch.get_num_threads()``).
    Returns:
        Tensor[M, N] in x's dtype.
    Raises:
        ValueError: other dtypes or layouts.
    """
    lib = _KERNEL.lib if _KERNEL.lib is not None else library()
    m, k = x.shape
    n = q.shape[0]
    if (
        x.dtype not in (torch.float32, torch.bfloat16)
        or x.stride(1) != 1
        or not q.is_contiguous()
        or not scale.is_contiguous()
        or scale.dtype not in (torch.bfloat16, torch.float32)
    ):
        raise ValueError("native int8 matmul: bf16/fp32 x with unit K stride, contiguous int8 q, bf16/fp32 scale")
    threads = threads or torch.get_num_threads()
    sbf = int(scale.dtype == torch.bfloat16)
    y = torch.empty(m, n, dtype=x.dtype)
    if m <= MAX_ROWS and _HAS_AMX.get(id(lib)):
        rc = lib.localdiff_int8_mm_amx(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            x.stride(0),
            m,
            k,
            q.data_ptr(),
            n,
            scale.data_ptr(),
            sbf,
            y.data_ptr(),
            int(y.dtype == torch.bfloat16),
            n,
            threads,
        )
        if rc == 0:
            return y
    if x.dtype == torch.bfloat16 and _HAS_BF16.get(id(lib)):
        rc = lib.localdiff_int8_mm_bf16(
            x.data_ptr(), x.stride(0), m, k, q.data_ptr(), n, scale.data_ptr(), sbf, y.data_ptr(), 1, n, threads
        )
        if rc == 0:
            return y
    xf = x.float()
    yf = y if y.dtype == torch.float32 else torch.empty(m, n, dtype=torch.float32)
    lib.localdiff_int8_mm(
        xf.data_ptr(), xf.stride(0), m, k, q.data_ptr(), n, scale.data_ptr(), sbf, yf.data_ptr(), n, threads
    )
    return yf if y.dtype == torch.float32 else yf.to(y.dtype)
