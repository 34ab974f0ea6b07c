"""The native bf16 MoE experts (``experts.c``): the routed experts' gated FFN, weighting and sum over the
top-k slots in one call, compiled on first use (:mod:`localdiff.kernels.build`) and loaded with ctypes.

Why: a canvas of 256 tokens with top-8 of 128 experts gives each expert ~16 rows, so a step reads every expert's
weights once for a few rows (weight-bandwidth-bound). The torch path (:func:`localdiff.arch.layers.stream_experts`)
computes zero-padded groups (1.7-2x the routed rows) and materialises each intermediate in memory; this kernel
streams each expert's weights once, computes only the real rows (padded to a 16-row tile), keeps the activation in
fp32 until the down product and sums the K slots in fp32.

Math (per routed row of token t, slot j, expert e; ``gate_up[e] = [Wg; Wu]``):
``a = gelu_tanh(x_t Wgᵀ) · (x_t Wuᵀ) · w_tj`` (fp32 sums of bf16 products), ``y_tj = bf16(a) · Wd_eᵀ`` (fp32 sums,
rounded to bf16), ``out_t = bf16(Σ_j y_tj)`` in fp32. The torch path rounds every intermediate to bf16 and sums
the slots in bf16; both are within bf16 accumulation error of the float64 math (tests/arch/test_native_experts.py).

Paths: AMX-BF16 tiles (``tdpbf16ps``; Sapphire Rapids and later, when Linux grants the tile state), the default
where it runs; AVX512-BF16 (``vdpbf16ps`` emulating the tile product) only with ``LOCALDIFF_NATIVE_EXPERTS=avx512``:
it is compute-bound and measured 0.57x / 0.93x the torch path at the 1B / 150M shapes (``bench --only experts`` on
this project's AMX CPU, where torch's own GEMMs use AMX). No AMX (unless forced), no compiler, a failed build or
``LOCALDIFF_NATIVE_EXPERTS=0`` → :func:`library` is None, :func:`status` says why, and the experts keep the torch
path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path

import torch

from localdiff.kernels import build as _native

SOURCE = Path(__file__).with_name("experts.c")
ENV = "LOCALDIFF_NATIVE_EXPERTS"

_PATH = 0  # 2 AMX-BF16, 1 AVX512-BF16
_OFF = False  # set by disabled()
_SCRATCH = threading.local()  # .ys: this thread's reused [rows · H] bf16 slot-output buffer
_SCRATCH_MAX = 16 << 20  # bytes kept between calls (a canvas step's; longer prefills allocate theirs)


def _load(path: Path) -> ctypes.CDLL:
    return _native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_experts_bf16(void*, long, long, long, long, long, void*, void*, void*, void*, void*, "
        "void*, void*, int, int)",
        "int localdiff_experts_has()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    global _PATH
    has = lib.localdiff_experts_has()
    if has == 0:
        return None, "native experts unavailable: this CPU or build has no AVX512-BF16 (torch path)"
    forced = os.environ.get(ENV, "").strip().lower() == "avx512"
    if has == 1 and not forced:
        return None, (
            "native experts not used: no AMX here, and the AVX512-BF16 path measured slower than the torch "
            f"path (0.57-0.93x, bench --only experts; {ENV}=avx512 forces it)"
        )
    _PATH = 1 if forced else has
    return lib, (
        f"native experts: {'AMX-BF16 tiles' if _PATH == 2 else 'AVX512-BF16 dot products'} "
        f"({_native.built_with(cc, flags)})"
    )


_KERNEL = _native.Kernel(
    SOURCE,
    "liblocaldiff_experts.so",
    _load,
    _ready,
    unavailable=lambda why: f"native experts unavailable: {why}",
    off=lambda: f"native experts off ({ENV}=0)" if _native.switched_off(ENV) else None,
)
library = _KERNEL.library  # the loaded library (built on the first call), or None when it cannot run here
status = _KERNEL.status  # one line: which native experts path runs, or why none does


def reset() -> None:
    """Forget the loaded library / failure (tests that change the environment)."""
    global _PATH
    _KERNEL.reset()
    _PATH = 0


@contextlib.contextmanager
def disabled():
    """Within the block, :func:`applies` is False (the experts take their torch path): A/B measurements."""
    global _OFF
    old, _OFF = _OFF, True
    try:
        yield
    finally:
        _OFF = old


def applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`moe` can run on these operands: bf16 CPU tensors, contiguous, autograd off, library loaded,
    not inside :func:`disabled`."""
    return (
        not _OFF
        and x.dtype == torch.bfloat16
        and gate_up.dtype == torch.bfloat16
        and down.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and gate_up.device.type == "cpu"
        and not torch.is_grad_enabled()
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and library() is not None
    )


def moe(
    x: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' output ``Σ_j w_tj · expert_{idx_tj}(x_t)`` by the native kernel (module docstring);
    :func:`applies` must hold.

    Args:
        x: bf16 Tensor[N, H]. flat: LongTensor[N·K], the expert of each (token, slot) (``index.reshape(-1)``).
        order: LongTensor[N·K], ``argsort(flat, stable=True)``. weights: fp32 Tensor[N, K] routing weights.
        gate_up: bf16 Tensor[E, 2I, H]; down: bf16 Tensor[E, H, I] (checkpoint layout).
    Threads: ``torch.get_num_threads()`` split the experts. Runs as the op ``torch.ops.localdiff.experts_bf16``
    (so dispatch-mode tools such as :mod:`localdiff.bench.scale_flops` see it; :func:`computed_rows`).
    Returns:
        bf16 Tensor[N, H].
    Raises:
        RuntimeError: the kernel ran out of memory.
    """
    return torch.ops.localdiff.experts_bf16(x, flat, order, weights, gate_up, down)


@torch.library.custom_op("localdiff::experts_bf16", mutates_args=(), device_types="cpu")
def _experts_bf16(
    x: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    lib = _KERNEL.lib if _KERNEL.lib is not None else library()
    n, h = x.shape
    e, two_i, _ = gate_up.shape
    k = flat.numel() // max(n, 1)
    x = x.contiguous()
    ends = torch.bincount(flat, minlength=e).cumsum(0)
    order = order.contiguous()
    rw = weights.reshape(-1).float().contiguous()
    ys = _slot_buffer(n * k * h)
    out = torch.empty(n, h, dtype=torch.bfloat16)
    rc = lib.localdiff_experts_bf16(
        x.data_ptr(),
        n,
        h,
        two_i // 2,
        e,
        k,
        order.data_ptr(),
        ends.data_ptr(),
        rw.data_ptr(),
        gate_up.data_ptr(),
        down.data_ptr(),
        ys.data_ptr(),
        out.data_ptr(),
        int(_PATH == 2),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native experts failed (code {rc}: out of memory)")
    return out


def _slot_buffer(numel: int) -> torch.Tensor:
    """A bf16 scratch of ``numel`` elements, reused per thread up to :data:`_SCRATCH_MAX` bytes (a fresh 4 MiB
    buffer per 1B layer cost ~1 ms of page faults)."""
    if 2 * numel > _SCRATCH_MAX:
        return torch.empty(numel, dtype=torch.bfloat16)
    buf = getattr(_SCRATCH, "ys", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.ys = torch.empty(numel, dtype=torch.bfloat16)
    return buf


def computed_rows(flat: torch.Tensor, num_experts: int) -> int:
    """Expert rows the kernel computes for the routing ``flat`` (LongTensor[N·K]): each expert's rows padded to a
    multiple of its 16-row tile (the FLOPs it executes are 2 · 3 · H · I per computed row)."""
    return int(((torch.bincount(flat.reshape(-1), minlength=num_experts) + 15) // 16).sum()) * 16
