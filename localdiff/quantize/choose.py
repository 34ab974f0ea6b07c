"""Which CPU kernel an int8 matmul runs, measured per shape in this process (:func:`cpu_kernel`), and the one-line
summary ``gen -v`` / ``bench`` print (:func:`kernel_summary`). Used by :func:`localdiff.quantize.int8.int8_matmul`."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_KERNELS: dict = {}  # (row bucket, in, out, dtype) → kernel name: the measured table of this process
_PROBE_ROWS = 4096  # the probe's weight rows at most (enough for a per-row rate; keeps the probe ~ms)


def cpu_kernel(m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """The faster CPU kernel for activations [m, k] of ``dtype`` (bf16 or fp32) × int8 weight [n, k], measured once
    per (row bucket, k, n, dtype) in this process (best of 3 each on a random weight of min(n, 4096) rows, ~ms):

    * ``"native"`` — :mod:`localdiff.kernels.int8` (AMX-INT8 or the fp32-FMA kernel), a candidate up to
      :data:`localdiff.kernels.int8.MAX_ROWS` rows when it built; with AMX it is taken without a probe (below);
    * ``"int8pack"`` — ``torch._weight_int8pack_mm`` (bf16 only, ``k % 16 == 0``);
    * ``"dequant"`` — cast the weight to the activation dtype + GEMM (the exact fp32 path for fp32).

    Machines differ (int8pack below 48 rows was the rule measured on one with AVX512-BF16 at 2 threads; on an AMX
    one at 1 thread int8pack lost at every row count tried), hence the measurement. ``LOCALDIFF_INT8_KERNEL``
    (``native`` / ``int8pack`` / ``dequant``) forces one where it applies."""
    from localdiff.kernels import int8 as native

    fp32 = dtype == torch.float32
    cands = ["dequant"] if fp32 else (["int8pack", "dequant"] if k % 16 == 0 else ["dequant"])
    if m <= native.MAX_ROWS and native.library() is not None:
        cands.insert(0, "native")
    forced = os.environ.get("LOCALDIFF_INT8_KERNEL")
    if forced in cands:
        return forced
    if len(cands) == 1 or (cands[0] == "native" and native.has_amx()):
        # AMX-INT8 is not probed: a probe's weight sits in the L3 cache (480 MiB here), where int8pack looks
        # faster at 1 row than it is from memory; over a whole 1.72 GB model (1 thread) the native kernel read
        # 9.0 / 8.5 / 8.1 / ~6 GB/s at 1 / 4 / 8 / 16 rows against int8pack's 7.1 / 5.2 / 2.5 / 1.6, and at
        # 2 threads 12.9 / 12.1 / 10.9 against 11.8 / 9.9 / 5.0 (bench notes of the native kernel's commit)
        return cands[0]
    bucket = 1 << max(0, (m - 1).bit_length())
    key = (bucket, k, n, fp32)
    if key not in _KERNELS:
        import time

        rows = min(n, _PROBE_ROWS)
        x = torch.randn(bucket, k).to(dtype)
        q = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        s = torch.rand(rows).to(torch.bfloat16)
        runs = {
            "native": lambda: native.matmul(x, q, s),
            "int8pack": lambda: torch._weight_int8pack_mm(x, q, s),
            "dequant": lambda: F.linear(x, q.to(dtype)) * s.to(dtype),
        }
        best = {}
        for name in cands:
            fn = runs[name]
            fn()
            t = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            best[name] = min(t)
        _KERNELS[key] = min(best, key=best.get)
    return _KERNELS[key]


def cpu_bf16_kernel(m: int, k: int, n: int) -> str:
    """:func:`cpu_kernel` for bf16 activations (kept for callers of the earlier name)."""
    return cpu_kernel(m, k, n, torch.bfloat16)


def reset_kernels() -> None:
    """Forget the measured kernel table and the native library's state (tests that change the environment)."""
    from localdiff.kernels import int8 as native

    native.reset()
    _KERNELS.clear()


def kernel_summary() -> str:
    """One line for ``gen -v`` / ``bench``: the native kernel's status and the measured choices so far."""
    from localdiff.kernels import int8 as native

    from collections import Counter

    per: dict = {}
    for (b, _, _, fp32), v in sorted(_KERNELS.items()):
        per.setdefault(f"{'fp32' if fp32 else 'bf16'} ≤{b} rows", Counter())[v] += 1
    chosen = [f"{g}: " + " / ".join(f"{v} ×{c}" for v, c in cnt.most_common()) for g, cnt in per.items()]
    amx = f"; AMX taken for ≤ {native.MAX_ROWS} rows" if native.has_amx() else ""
    return native.status() + amx + ("; measured choice per shape — " + ", ".join(chosen) if chosen else "")
