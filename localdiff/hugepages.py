"""Weights in transparent huge pages on CPU (issue #24).

Why: safetensors hands out tensors that view the memory-mapped checkpoint file, i.e. 4 KiB page-cache pages. A
denoising step of a mixture-of-experts model streams every expert weight once (a canvas of 256 rows, top-8 of 128
experts: ~16 rows per expert), so it is bound by the read bandwidth — and with 4 KiB pages the walk of the page
tables costs part of it. Measured on this project's CPU (one core, random 1B DiffusionGemma, bf16, 4 steps, under
the bench lock): 684–715 CPU ms per step memory-mapped, 575–642 ms with the weights copied into anonymous memory
advised for huge pages (2 MiB), −16 %. A bare ``torch.bmm`` over the 128 experts' gate/up weights reads
8.2 GB/s in 4 KiB pages and 10.5 GB/s in huge pages (development core, shared).

Memory: the copies replace the mapping (1B bf16 after load: RSS 2.25 GiB, was 4.07 GiB with the file's pages still
mapped); while loading, the file's pages read so far and the copies are both resident (peak 4.2 GiB for that model;
the file's pages are clean page cache, which the kernel reclaims under pressure).

How: a fresh ``torch.empty`` of this size is a new anonymous mapping that nothing has touched yet; ``madvise`` with
``MADV_HUGEPAGE`` on its 2 MiB-aligned interior before the copy makes the first touch fault in huge pages (the
kernel's ``transparent_hugepage/enabled`` must be ``madvise`` or ``always``). Linux only; elsewhere, or when the
kernel says ``never``, :func:`resident` keeps the tensor as it is (memory-mapped) — same values either way.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

_HUGE = 2 << 20  # 2 MiB, x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_madvise = None


def available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, kernel setting not ``never``)."""
    global _madvise
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    if "[never]" in mode:
        return False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return False
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise = fn
    return True


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages over ``t``'s storage (its 2 MiB-aligned interior). Call before the memory is first
    written. Returns whether the advice was given (False: not available, too small, or the kernel refused)."""
    if t.device.type != "cpu" or not available():
        return False
    start, n = t.data_ptr(), t.untyped_storage().nbytes()
    lo, hi = -(-start // _HUGE) * _HUGE, (start + n) // _HUGE * _HUGE
    return hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def fits_in_memory(nbytes: int, share: float = 0.8) -> bool:
    """Whether ``nbytes`` of weight copies fit in ``share`` of the memory Linux reports available
    (``MemAvailable`` in /proc/meminfo, which counts reclaimable page cache). A checkpoint that does not fit stays
    memory-mapped (the kernel can page it from the file; anonymous copies could only be swapped or killed). True when
    the figure cannot be read (not Linux: :func:`available` is False there anyway)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return nbytes <= share * int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return True


def resident(t: torch.Tensor, dtype: torch.dtype | None = None, min_bytes: int = 4 << 20) -> torch.Tensor:
    """``t`` (converted to ``dtype`` if given) as a contiguous copy in this process's own memory, advised for huge
    pages when it is ``min_bytes`` or more.

    Every tensor is copied (when huge pages are available), small ones too: one tensor left as a view of the
    checkpoint file would keep the whole file mapped, and every page the copies read would stay in the RSS.

    Args:
        t: a CPU tensor (typically a view of a memory-mapped safetensors file).
        dtype: target dtype, or None = t's.
        min_bytes: smaller copies are not advised (a huge page would be mostly empty).
    Returns:
        A tensor equal to ``t.to(dtype)``: a new copy where huge pages are available, else ``t.to(dtype)`` (which
        may be ``t`` itself).
    """
    dtype = dtype or t.dtype
    if t.device.type != "cpu" or not available():
        return t.to(dtype)
    out = torch.empty(t.shape, dtype=dtype)
    if out.numel() * out.element_size() >= min_bytes:
        advise(out)
    return out.copy_(t)
