"""Helpers of the one-core bench sections (``--only int4``): pin the process to one core, name the CPU, and count a
quantized model's resident bytes."""

from __future__ import annotations

import os


def pin() -> tuple[set, int]:
    """Pin this process to its last allowed core, one torch thread. Returns (the previous affinity, threads)."""
    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {max(before)})
    torch.set_num_threads(1)
    return before, threads


def resident(net) -> int:
    """Bytes of parameters, buffers and the quantized LM head copy (``head_int8``) of ``net``."""
    from localdiff.quantize.int8 import resident_bytes

    head = getattr(net, "head_int8", None)
    extra = sum(t.numel() * t.element_size() for t in vars(head).values() if hasattr(t, "numel")) if head else 0
    return resident_bytes(net) + extra


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor string."""
    import platform

    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
