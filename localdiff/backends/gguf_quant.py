"""GGUF → quantized GGUF through llama.cpp's own quantizer (``llama_model_quantize`` in llama-cpp-python), the
second half of ``localdiff convert --type Q8_0|Q4_K_M|Q5_K_M|Q6_K`` (the first writes the lossless F32 / F16 / BF16
file: :mod:`localdiff.backends.gguf_write`).

llama.cpp picks each tensor's type as ``llama-quantize`` does (``src/llama-quant.cpp``): the _M mixes give some
attention-V and FFN-down tensors a larger type; norms, biases and the MoE router stay F32; a tensor whose rows are
not a multiple of the type's block (256 for K-quants, 32 for Q8_0) falls back to a type whose block fits (or F16).

The quantizer is one blocking C call: it runs in a worker thread so that Ctrl-C reaches Python (the caller then
removes the partial file); progress is the output file's growth, polled.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from localdiff.errors import LocaldiffError

#: --type → llama_ftype (``LLAMA_FTYPE_MOSTLY_*``) and the main ggml type's (elements, bytes) per block
QUANT = {"Q8_0": (7, 32, 34), "Q4_K_M": (15, 256, 144), "Q5_K_M": (17, 256, 176), "Q6_K": (18, 256, 210)}


def estimate_bytes(shapes: list[tuple], qtype: str) -> int:
    """Rough size of the quantized tensors (every ≥2-D tensor at the main type's rate; 1-D ones F32)."""
    _, block, size = QUANT[qtype]
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= int(d)
        total += n * 4 if len(s) <= 1 else -(-n // block) * size
    return total


def quantize(
    src: Path,
    dst: Path,
    qtype: str,
    threads: int = 0,
    advance: Callable[[int], None] = lambda n: None,
    poll: float = 0.2,
) -> None:
    """Write ``dst`` = ``src`` (an F32 / F16 / BF16 GGUF) quantized to ``qtype`` by llama.cpp.

    Args:
        src, dst: GGUF paths (``dst`` is created or truncated). qtype: a key of :data:`QUANT`.
        threads: quantizer threads (0 = llama.cpp's default: all cores). advance: called with bytes as ``dst`` grows.
    Raises:
        BackendMissingError: llama-cpp-python missing (names the extra). LocaldiffError: llama.cpp failed (its last
        log line is quoted). KeyboardInterrupt passes through at once (the C call may still run: the caller deletes
        ``dst``; the worker is a daemon thread).
    """
    from localdiff.backends import gguf as backend

    lib = backend.llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = QUANT[qtype][0]
    params.nthread = int(threads or 0)
    result: list = []
    backend._LOG_TAIL.clear()

    def run():
        try:
            result.append(lib.llama_model_quantize(str(src).encode(), str(dst).encode(), params))
        except BaseException as e:  # noqa: BLE001 — reported by the caller's thread
            result.append(e)

    worker = threading.Thread(target=run, name="llama-quantize", daemon=True)
    worker.start()
    seen = 0
    while worker.is_alive():
        worker.join(poll)
        try:
            size = dst.stat().st_size
        except OSError:
            size = seen
        if size > seen:
            advance(size - seen)
            seen = size
    if isinstance(result[0], BaseException):
        raise result[0]
    if result[0] != 0:
        why = backend._LOG_TAIL[-1] if backend._LOG_TAIL else f"return code {result[0]}"
        raise LocaldiffError(f"llama.cpp could not quantize {src.name} to {qtype} ({why})")
    advance(max(0, dst.stat().st_size - seen))
