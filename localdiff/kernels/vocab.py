"""The fused native vocab pass (``vocab.c``, issue #24): compiled on first use with the system C compiler
(:mod:`localdiff.kernels.build`), loaded with ctypes; :class:`localdiff.decoding.vocab_pass.VocabPass` runs it and
keeps its torch passes as the fallback.

Per row of logits: soft-capping ``cap·tanh(x/cap)``, ``/ temperature``, max and first argmax, ``exp``, ``Σe`` and
``Σe·x``, the entropy (nats) and top-1 probability, and the probabilities written once in bf16 or fp32 — one read of
the logits and one write of the probabilities (4 bytes per element in bf16, against 92 for the torch passes).
AVX-512 where the compiler targets it (``-march=native``), portable C otherwise. Accuracy against float64
(tests/decoding/test_vocab_native.py): probabilities, entropy and confidence within ~1e-5 relative (the probabilities before
their bf16 rounding), argmax identical except exact ties.

``LOCALDIFF_VOCAB_KERNEL``: ``auto`` (default: native when it builds), ``native`` (the same; the fallback still
applies when no compiler works, and :func:`status` says why), ``torch`` (always the torch passes). Any other value:
UsageError.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from localdiff.errors import UsageError
from localdiff.kernels import build as native

SOURCE = Path(__file__).with_name("vocab.c")
ENV = "LOCALDIFF_VOCAB_KERNEL"
CHOICES = ("auto", "native", "torch")


def choice() -> str:
    """``$LOCALDIFF_VOCAB_KERNEL`` checked (default ``auto``). Raises UsageError for another value."""
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in CHOICES:
        raise UsageError(f"{ENV}: invalid value {os.environ.get(ENV)!r} (use {', '.join(CHOICES)})")
    return v


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its function signatures set."""
    return native.declare(
        ctypes.CDLL(str(path)),
        "int localdiff_vocab_pass(void*, int, long, long, long, float, float, void*, int, long, void*, void*, "
        "void*, void*, int)",
        "int localdiff_vocab_vector_width()",
    )


def _ready(lib: ctypes.CDLL, cc: str, flags: tuple) -> tuple:
    width = lib.localdiff_vocab_vector_width()
    return lib, (
        f"vocab pass: native fused kernel, {'AVX-512 16-lane' if width == 16 else 'portable scalar'}"
        f" ({native.built_with(cc, flags)})"
    )


def _off() -> str | None:
    return f"vocab pass: torch passes ({ENV}=torch)" if choice() == "torch" else None


_KERNEL = native.Kernel(
    SOURCE,
    "liblocaldiff_vocab.so",
    load,
    _ready,
    off=_off,
    unavailable=lambda why: (
        "vocab pass: torch passes ("
        + (
            "no C compiler: cc / gcc / clang on PATH"
            if why == native.NO_COMPILER
            else f"native kernel unavailable: {why}"
        )
        + ")"
    ),
)
#: :meth:`Kernel.build`: compile ``vocab.c``. Raises RuntimeError when the compiler fails or times out.
build = _KERNEL.build
#: the loaded kernel, built on the first call; None when off or unavailable (see ``status()``). Raises UsageError
#: for a bad ``LOCALDIFF_VOCAB_KERNEL``.
library = _KERNEL.library
status = _KERNEL.status  # one line: which vocab pass runs, and why
reset = _KERNEL.reset  # forget the loaded library / failure (tests that change the environment)


def vocab_pass(
    x: torch.Tensor,
    cap: float | None,
    temperature: float,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused pass (module docstring) by the native kernel (:func:`library` must not be None).

    Args:
        x: bf16 or fp32 CPU Tensor[N, V] of logits (before soft-capping when ``cap``), unit stride along V.
        cap: the soft-cap (> 0), or None / 0 for none. temperature: > 0.
        out: bf16 or fp32 CPU Tensor[N, V], unit stride along V: receives ``softmax(softcap(x) / temperature)``.
        scratch: fp32 Tensor with at least threads·V elements (reused by the caller; None = allocated here).
        threads: threads splitting the rows (default ``torch.get_num_threads()``).
    Returns:
        (argmax LongTensor[N], entropy FloatTensor[N] in nats, confidence FloatTensor[N] = top-1 probability).
    Raises:
        ValueError: other dtypes, devices, shapes or layouts.
    """
    lib = _KERNEL.lib if _KERNEL.lib is not None else library()
    n, v = x.shape
    if (
        x.dtype not in (torch.bfloat16, torch.float32)
        or out.dtype not in (torch.bfloat16, torch.float32)
        or x.device.type != "cpu"
        or out.device.type != "cpu"
        or tuple(out.shape) != (n, v)
        or x.stride(1) != 1
        or out.stride(1) != 1
        or not temperature > 0
    ):
        raise ValueError(
            "native vocab pass: bf16/fp32 CPU [N, V] logits and output with unit stride along V, temperature > 0"
        )
    threads = max(1, min(threads or torch.get_num_threads(), n))
    if scratch is None or scratch.numel() < threads * v:
        scratch = torch.empty(threads * v, dtype=torch.float32)
    arg = torch.empty(n, dtype=torch.long)
    ent = torch.empty(n, dtype=torch.float32)
    conf = torch.empty(n, dtype=torch.float32)
    lib.localdiff_vocab_pass(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.stride(0),
        n,
        v,
        float(cap or 0.0),
        1.0 / temperature,
        out.data_ptr(),
        int(out.dtype == torch.bfloat16),
        out.stride(0),
        arg.data_ptr(),
        ent.data_ptr(),
        conf.data_ptr(),
        scratch.data_ptr(),
        threads,
    )
    return arg, ent, conf
