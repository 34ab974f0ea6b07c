"""int4 weights × int8 activations by AVX512-VNNI (``int4_vnni.c``): stacked int4 experts at a few rows each
(:func:`grouped_matmul`) and dense int4 weights at a few rows (:func:`dense_matmul`, 1-token and block steps).

``y = dequantize_int8(x) @ dequantize(packed, scale, zero)ᵀ`` for :mod:`localdiff.quantize.int4`'s format (packed
uint8 [N, G·32], bf16 scale and fp16 zero [N, G], unchanged: no repacking), where each activation row's group of 64
features is quantized once per call to int8, symmetric absmax (as llama.cpp's Q8_0 blocks, 64 wide here):
``sx = amax / 127``, ``xi = round_half_even(x · (127 / amax))`` in fp32. ``vpdpbusd`` multiplies 64 codes by 64 int8
activations per instruction (``vdpbf16ps``: 32), so the compute-bound expert products run ~1.5× faster than the
bf16 path of :mod:`localdiff.kernels.int4` (docs/BENCHMARKS.md). The activation quantization changes the numerics:
the result equals a float64 product of the dequantized int8 activations and int4 weights up to fp32 rounding
(tests/quant/test_int4_vnni.py); a recipe opts in with ``int4_activations = "int8"`` (:mod:`localdiff.quantize.recipe`).

Build: :mod:`localdiff.kernels.build`. No AVX512-VNNI (or no compiler, or ``LOCALDIFF_NATIVE_INT4_VNNI=0``) →
:func:`library` is None, :func:`status` says why, and the experts keep the exact bf16 / fp32 kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from localdiff.kernels import build as _native

SOURCE = Path(__file__).with_name("int4_vnni.c")
ENV = "LOCALDIFF_NATIVE_INT4_VNNI"
GROUP = 64


def load(path) -> ctypes.CDLL:
    """Load a built library and set its ctypes signatures (raises OSError / AttributeError on a bad file)."""
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_int4_vnni_mm_grouped(void*, int, long, void*, long, long, void*, long, void*, void*, "
        "void*, long, int, int)",
        "int localdiff_int4_vnni_quantize(void*, int, long, long, long, void*, void*)",
        "int localdiff_int4_vnni_mm(void*, int, long, long, long, void*, long, void*, void*, void*, long, int, int)",
        "int localdiff_int4_vnni_available()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    if not lib.localdiff_int4_vnni_available():
        return None, "native int4 x int8 kernel unavailable: this CPU or build has no AVX512-VNNI"
    return lib, f"native int4 x int8 kernel: AVX512-VNNI vpdpbusd ({_native.built_with(cc, flags)})"


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_int4_vnni.so",
    load,
    _ready,
    unavailable=lambda why: f"native int4 x int8 kernel unavailable: {why}",
    off=lambda: f"native int4 x int8 kernel off ({ENV}=0)" if _native.switched_off(ENV) else None,
)
library = _KERNEL.library  # the loaded library (built on first use), or None (status() says why)
status = _KERNEL.status  # one line: what runs, or why nothing does
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def _prep(x: torch.Tensor, g: int) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("native int4 x int8 matmul: bf16 or fp32 activations")
    k = x.shape[1]
    if k > g * GROUP:
        raise ValueError(f"native int4 x int8 matmul: x has {k} features, the weight {g} groups of {GROUP}")
    return F.pad(x, (0, g * GROUP - k)) if k < g * GROUP else x.contiguous()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization alone (module docstring): x bf16 / fp32 Tensor[M, 64·G] →
    (int8 Tensor[M, 64·G], fp32 scales Tensor[M, G]); ``x ≈ xi · sx`` per group. Needs :func:`library`."""
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    m, k = x.shape
    g = (k + GROUP - 1) // GROUP
    xx = _prep(x, g)
    xi = torch.empty(m, g * GROUP, dtype=torch.int8)
    sx = torch.empty(m, g, dtype=torch.float32)
    if lib.localdiff_int4_vnni_quantize(
        xx.data_ptr(), int(xx.dtype == torch.bfloat16), xx.stride(0), m, g, xi.data_ptr(), sx.data_ptr()
    ):
        raise MemoryError("native int4 x int8 quantize: out of memory")
    return xi, sx


def grouped_matmul(
    xs: torch.Tensor,
    offsets: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    threads: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Stacked int4 experts × int8-quantized activations in one call: rows ``offsets[e] .. offsets[e + 1] − 1`` of
    ``xs`` times expert e's weight (each row's result independent of the other rows and experts).

    Args:
        xs: bf16 or fp32 Tensor[R, K], rows sorted by expert; offsets: int64 Tensor[E + 1] (offsets[0] = 0,
            offsets[E] = R); packed: uint8 Tensor[E, N, G·32]; scale: bf16 / zero: fp16 Tensor[E, N, G]; K ≤ 64·G.
        threads: threads splitting N (default ``torch.get_num_threads()``).
        out_dtype: fp32 or bf16 (default xs's dtype; bf16 is rounded once from the fp32 sums, as a cast).
    Returns:
        Tensor[R, N].
    Raises:
        ValueError: other dtypes or shapes; MemoryError: out of memory; RuntimeError: no VNNI library loaded.
    """
    lib = _KERNEL.require()
    r = xs.shape[0]
    e, n, g = scale.shape
    if (
        packed.dtype != torch.uint8
        or tuple(packed.shape) != (e, n, g * GROUP // 2)
        or tuple(zero.shape) != (e, n, g)
        or scale.dtype != torch.bfloat16
        or zero.dtype != torch.float16
        or tuple(offsets.shape) != (e + 1,)
    ):
        raise ValueError(
            "native int4 x int8 grouped matmul: codes [E, N, G*32], bf16 scale / fp16 zero [E, N, G], offsets [E+1]"
        )
    off = offsets.to(torch.int64).contiguous()
    return _run(
        lib.localdiff_int4_vnni_mm_grouped,
        xs,
        (off.data_ptr(), e, g),
        r,
        packed,
        scale,
        zero,
        threads,
        out_dtype,
        "grouped matmul: bad offsets or no VNNI path",
    )


def matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    threads: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One int4 weight (packed [N, G·32], scale / zero [N, G]) × x [M, K] (bf16 / fp32) with int8-quantized
    activations: :func:`grouped_matmul` with one expert. Returns Tensor[M, N] in ``out_dtype`` (default x's)."""
    off = torch.tensor([0, x.shape[0]], dtype=torch.int64)
    return grouped_matmul(x, off, packed[None], scale[None], zero[None], threads, out_dtype)


def dense_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    threads: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One int4 weight × a few int8-quantized activation rows (``localdiff_int4_vnni_mm``: the codes decoded in
    registers straight from the weight, no staging buffer; the dense int4 linears' path at
    :data:`localdiff.quantize.int4.VNNI_ROWS` rows or fewer). Same numerics as :func:`matmul` (float64 on the same
    int8 activations up to fp32 rounding), summed in an order independent of the row count and threads.

    Args:
        x: bf16 or fp32 Tensor[M, K]; packed: uint8 Tensor[N, G·32]; scale: bf16 / zero: fp16 Tensor[N, G];
            K ≤ 64·G. threads: threads splitting N (default ``torch.get_num_threads()``).
        out_dtype: fp32 or bf16 (default x's; bf16 rounded once from the fp32 sums, as a cast).
    Returns:
        Tensor[M, N].
    Raises:
        ValueError: other dtypes or shapes; MemoryError: out of memory; RuntimeError: no VNNI library loaded.
    """
    lib = _KERNEL.require()
    m = x.shape[0]
    n, g = scale.shape
    if (
        packed.dtype != torch.uint8
        or tuple(packed.shape) != (n, g * GROUP // 2)
        or tuple(zero.shape) != (n, g)
        or scale.dtype != torch.bfloat16
        or zero.dtype != torch.float16
    ):
        raise ValueError("native int4 x int8 matmul: codes [N, G*32], bf16 scale / fp16 zero [N, G]")
    return _run(
        lib.localdiff_int4_vnni_mm, x, (m, g), m, packed, scale, zero, threads, out_dtype, "matmul: no VNNI path"
    )


def _run(fn, x, rows_args: tuple, m: int, packed, scale, zero, threads, out_dtype, what: str) -> torch.Tensor:
    """Call a VNNI kernel ``fn(x, x_bf16, ldx, *rows_args, codes, N, scale, zero, y, ldy, threads, y_bf16)`` with
    x's activations int8-quantized per group (:func:`_prep`) and return y [m, N] in ``out_dtype`` (default x's).
    Raises MemoryError (code -2) or ValueError naming ``what`` (codes < -2)."""
    n, g = scale.shape[-2:]
    xx = _prep(x, g)
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    rc = fn(
        xx.data_ptr(),
        int(xx.dtype == torch.bfloat16),
        xx.stride(0),
        *rows_args,
        packed.data_ptr(),
        n,
        scale.data_ptr(),
        zero.data_ptr(),
        y.data_ptr(),
        n,
        threads or torch.get_num_threads(),
        int(y.dtype == torch.bfloat16),
    )
    if rc == -2:
        raise MemoryError("native int4 x int8 matmul: out of memory")
    if rc < -1:
        raise ValueError(f"native int4 x int8 {what} (code {rc})")
    return y if y.dtype == out_dtype else y.to(out_dtype)
