"""Large step temporaries from the heap, not fresh page-faulted mappings (glibc ``mallopt``; issue #24).

Why: a canvas step allocates and frees vocabulary-sized temporaries — logits, probabilities, the sampler's
intermediates: [256, 32768] fp32 is 32 MiB, at the real vocabulary 256 MiB. glibc serves a request above its mmap
threshold (dynamic, at most 32 MiB on 64-bit) with a new anonymous mapping and unmaps it on free, so every step
page-faults those megabytes in again, 4 KiB at a time, and the kernel zeroes each page. Measured on one core of the
project's Sapphire Rapids machine (random 150M DiffusionGemma, canvas 256, 4 steps, float32): 4,578 minor faults and
45.8 ms of system time per step; with the thresholds raised, 0.5 faults and 0.4 ms (peak RSS +38 MiB: the freed
blocks stay in the heap for the next step). The same tokens either way: only where memory comes from changes.

How: :func:`for_steps` sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to 1 GiB (requests below it come from
the heap and freed memory is kept for reuse), after the weights are loaded. :func:`for_weights` puts the mmap
threshold back to glibc's 128 KiB and trims the heap while a model loads, so that weight copies land in untouched
memory that :mod:`localdiff.hugepages` can advise for huge pages before their first touch. ``LOCALDIFF_HEAP=0`` leaves
malloc's settings alone. Elsewhere than Linux with glibc both are no-ops. PyTorch's CPU allocator calls
``posix_memalign``, which follows these settings.
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager

ENV = "LOCALDIFF_HEAP"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
STEP_THRESHOLD = 1 << 30  # 1 GiB
GLIBC_DEFAULT_MMAP = 128 << 10  # 128 KiB (its initial, dynamic value)
_mallopt = None
_trim = None
_state = {"steps": False}


def _fn():
    """glibc's ``mallopt`` or None (not Linux/glibc, or turned off with ``LOCALDIFF_HEAP=0``)."""
    global _mallopt, _trim
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if _mallopt is None:
        if not sys.platform.startswith("linux"):
            _mallopt = False
        else:
            try:
                libc = ctypes.CDLL("libc.so.6")
                fn, trim = libc.mallopt, libc.malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
                _mallopt, _trim = fn, trim
            except (OSError, AttributeError):
                _mallopt = False
    return _mallopt or None


def for_steps() -> bool:
    """Serve requests below 1 GiB from the heap and keep freed memory for reuse (see the module). Returns whether
    the settings were applied."""
    fn = _fn()
    ok = bool(fn and fn(_M_MMAP_THRESHOLD, STEP_THRESHOLD) == 1 and fn(_M_TRIM_THRESHOLD, STEP_THRESHOLD) == 1)
    _state["steps"] = ok
    return ok


@contextmanager
def for_weights():
    """While loading weights: requests of 128 KiB or more are fresh mappings (glibc's initial threshold, fixed), so
    :func:`localdiff.hugepages.resident` can advise them before their first touch, and ``malloc_trim(0)`` returns
    the heap's free pages (a previous model's, or the steps' temporaries) to the kernel; restores :func:`for_steps`'
    settings afterwards if they were on."""
    fn, was = _fn(), _state["steps"]
    if fn:
        fn(_M_MMAP_THRESHOLD, GLIBC_DEFAULT_MMAP)
        _trim(0)  # the heap's free pages back to the kernel: reused for weights, they are untouched again
    try:
        yield
    finally:
        if fn and was:
            for_steps()


def status() -> str:
    """One line for ``gen -v``: whether step temporaries come from the heap."""
    if _fn() is None:
        return "malloc defaults" + (f" ({ENV}=0)" if sys.platform.startswith("linux") else "")
    return "step temporaries from the heap (mallopt 1 GiB)" if _state["steps"] else "malloc defaults"
