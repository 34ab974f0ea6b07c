"""Checkpoint → GGUF file, atomically: the library half of ``localdiff convert`` (the CLI adds argument checks and
the progress bar). F32 / F16 / BF16 are written by :mod:`localdiff.backends.gguf_write`; Q8_0 / Q4_K_M / Q5_K_M /
Q6_K by llama.cpp's quantizer (:mod:`localdiff.backends.gguf_quant`) from a lossless intermediate in the
checkpoint's own precision (BF16 for a bf16 checkpoint, F16 for f16, else F32).

Atomic output: everything is written to ``FILE.partial`` (the intermediate to ``FILE.tmp.partial``) next to the
output and renamed onto ``FILE`` only when complete; any error or Ctrl-C removes both, so no half-written file ever
carries the final name, and an existing ``FILE`` stays as it was until the new one replaces it.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable

from localdiff.backends import gguf_quant, gguf_write
from localdiff.errors import LocaldiffError, UsageError
from localdiff.units import format_size

#: every ``--type``: the directly written ones, then llama.cpp's quantized ones
TYPES = tuple(gguf_write.DIRECT) + tuple(gguf_quant.QUANT)
#: bytes kept free on the output's file system beyond the estimate
MARGIN = 64 << 20


def _nothing(*_a) -> None:
    return None


def convert_checkpoint(
    ckpt,
    out,
    qtype: str,
    threads: int = 0,
    phase: Callable[[str, int], None] = _nothing,
    advance: Callable[[int], None] = _nothing,
    note: Callable[[str], None] = _nothing,
) -> gguf_write.Plan:
    """Write checkpoint folder ``ckpt`` as the GGUF file ``out`` in ``qtype`` (a key of :data:`TYPES`).

    Args:
        threads: the quantizer's threads (0 = all cores). phase(label, total_bytes) / advance(bytes): progress;
        note(text): remarks for the user (e.g. a tokenizer pre-tokenizer llama.cpp does not know).
    Returns:
        the :class:`localdiff.backends.gguf_write.Plan` written.
    Raises:
        UsageError: unknown ``qtype``. CheckpointError: a checkpoint convert cannot write (one line, from
        :func:`localdiff.backends.gguf_write.plan`). BackendMissingError: a quantized type without llama-cpp-python.
        LocaldiffError: not enough free disk space (checked before writing) or disk full while writing, llama.cpp's
        quantizer failing. KeyboardInterrupt passes through after the partial files are removed.
    """
    if qtype not in TYPES:
        raise UsageError(f"--type {qtype}: unknown type (choose from {', '.join(TYPES)})")
    out = Path(out)
    direct = qtype in gguf_write.DIRECT
    p = gguf_write.plan(ckpt, qtype if direct else "F32")
    if not direct:
        from localdiff.backends import gguf as backend

        backend.llama_cpp()  # the quantizer is needed: fail before writing anything
        p = gguf_write.plan(ckpt, p.source_dtype)  # the lossless intermediate: the checkpoint's own precision
    for text in p.notes:
        note(text)
    quant_bytes = 0 if direct else gguf_quant.estimate_bytes([t.shape for t in p.tensors], qtype)
    need = p.nbytes + quant_bytes
    folder = out.parent if str(out.parent) else Path(".")
    free = shutil.disk_usage(folder).free
    if need + MARGIN > free:
        raise LocaldiffError(
            f"not enough disk space in {folder}: convert needs about {format_size(need)}, {format_size(free)} free"
        )
    partial, tmp = out.with_name(out.name + ".partial"), out.with_name(out.name + ".tmp.partial")
    try:
        if direct:
            phase(f"writing {out.name} ({qtype})", p.nbytes)
            gguf_write.write(p, partial, gguf_write.DIRECT[qtype], advance)
        else:
            phase(f"writing the {p.source_dtype} intermediate", p.nbytes)
            gguf_write.write(p, tmp, gguf_write.DIRECT[p.source_dtype], advance)
            phase(f"quantizing to {qtype} (llama.cpp)", quant_bytes)
            gguf_quant.quantize(tmp, partial, qtype, threads, advance)
        os.replace(partial, out)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LocaldiffError(
                f"disk full while writing into {folder}: convert needs about {format_size(need)}; "
                "the partial file was removed"
            ) from None
        raise
    finally:
        for f in (partial, tmp):
            try:
                f.unlink()
            except FileNotFoundError:
                pass
    return p
