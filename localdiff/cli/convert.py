"""``localdiff convert SRC -o FILE.gguf --type T``: a checkpoint folder or pulled model → a GGUF file llama.cpp
computes (F32 / F16 / BF16 written by :mod:`localdiff.backends.gguf_write`; Q8_0 / Q4_K_M / Q5_K_M / Q6_K by
llama.cpp's quantizer from a lossless intermediate: :mod:`localdiff.backends.gguf_quant`).

Output is atomic: everything is written to ``FILE.gguf.partial`` (and the intermediate to ``FILE.gguf.tmp.partial``)
in the output's folder and renamed onto ``FILE.gguf`` only when complete; any error or Ctrl-C removes both, so no
half-written file ever carries the final name. An existing ``FILE.gguf`` is kept unless ``--force``.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from pathlib import Path

from localdiff.errors import LocaldiffError, UsageError

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def add_parser(sub) -> None:
    """The ``convert`` subcommand's arguments (called by :func:`localdiff.cli.dispatch.build_parser`)."""
    cv = sub.add_parser("convert", help="write a GGUF file (llama.cpp) from a checkpoint",
                        description="Convert a LLaDA, LLaDA-MoE, Dream, SDAR, SDAR-MoE or Fast-dLLM v2 checkpoint "
                                    "(folder or pulled model) to GGUF; quantized types use llama.cpp's quantizer.")
    cv.add_argument("src", metavar="SRC", help="checkpoint folder, catalog alias or pulled org/repo")
    cv.add_argument("-o", "--output", required=True, metavar="FILE.gguf", help="the GGUF file to write")
    cv.add_argument("--type", dest="qtype", default="F16", metavar="TYPE",
                    help=f"{' | '.join(TYPES)} (default F16)")
    cv.add_argument("--force", action="store_true", help="replace FILE.gguf if it exists")
    cv.add_argument("--threads", type=int, metavar="N", help="quantizer threads (default: all cores)")
    cv.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    cv.add_argument("--debug", action="store_true", help="show tracebacks on errors")


class _Progress:
    """Bytes written, on stderr: a rich bar on a terminal, a line every 5 s otherwise, nothing with ``-q``."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar, self.task, self.last = quiet, None, None, time.monotonic()
        self.total = self.done = 0
        self.label = ""
        try:
            tty = sys.stderr.isatty() and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")
        except (AttributeError, ValueError):
            tty = False
        if not quiet and tty:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), console=Console(file=sys.stderr))

    def phase(self, label: str, total: int) -> None:
        from localdiff.hub.progress import human_bytes

        if self.bar is not None:
            if self.task is None:
                self.bar.start()
            else:                                  # the previous phase is complete
                self.bar.update(self.task, completed=self.total, total=self.total)
        self.label, self.total, self.done = label, max(int(total), 1), 0
        if self.bar is not None:
            self.task = self.bar.add_task(label, total=self.total)
        elif not self.quiet:
            sys.stderr.write(f"{label} (about {human_bytes(total)})\n")

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=min(self.done, self.total))
        elif not self.quiet and time.monotonic() - self.last >= 5.0:
            self.last = time.monotonic()
            sys.stderr.write(f"  {self.label}: {min(100, 100 * self.done // self.total)}%\n")

    def close(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=self.total, total=self.total)
            self.bar.stop()


def _check_output(path: str, force: bool) -> Path:
    """The output path after the checks every bad ``-o`` fails with one line: empty, a folder, exists without
    ``--force``, a missing or unwritable folder."""
    if not path.strip():
        raise UsageError("-o: empty file name")
    out = Path(path).expanduser()
    if out.is_dir():
        raise UsageError(f"-o {path}: is a folder; give the .gguf file to write")
    if out.exists() and not force:
        raise UsageError(f"-o {path}: file exists; pass --force to replace it")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"-o {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"-o {path}: folder {parent} is not writable")
    return out


def _check_space(folder: Path, need: int) -> None:
    from localdiff.hub.progress import human_bytes

    free = shutil.disk_usage(folder).free
    if need + (64 << 20) > free:
        raise LocaldiffError(f"not enough disk space in {folder}: convert needs about {human_bytes(need)}, "
                             f"{human_bytes(free)} free")


def run_convert(args) -> int:
    """Run ``localdiff convert`` (see the module docstring). Returns 0; errors raise one-line LocaldiffErrors."""
    qtype = str(args.qtype).upper()
    if qtype not in TYPES:
        raise UsageError(f"--type {args.qtype}: unknown type (choose from {', '.join(TYPES)})")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be ≥ 1")
    from localdiff.hub.models import resolve_model
    from localdiff.loader import gguf_target

    if os.path.isfile(os.path.expanduser(args.src)) and gguf_target(args.src) is not None:
        raise UsageError(f"{args.src}: already a GGUF file; convert reads safetensors checkpoints")
    if not os.path.exists(os.path.expanduser(args.src)) and ("/" in args.src or os.sep in args.src) \
            and args.src.startswith((".", "/", "~")):
        raise UsageError(f"{args.src}: no such folder")
    out = _check_output(args.output, args.force)
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise LocaldiffError('convert needs the gguf extra: pip install "localdiff[gguf]"') from None
    from localdiff.backends import gguf_write

    ckpt = resolve_model(args.src)
    direct = qtype in gguf_write.DIRECT
    p = gguf_write.plan(ckpt, qtype if direct else "F32")
    if not direct:
        from localdiff.backends import gguf as backend

        backend.llama_cpp()                         # the quantizer is needed: fail before writing anything
        p = gguf_write.plan(ckpt, p.source_dtype)   # the lossless intermediate: the checkpoint's own precision
    for note in p.notes:
        sys.stderr.write(f"note: {note}\n")
    partial = out.with_name(out.name + ".partial")
    tmp = out.with_name(out.name + ".tmp.partial")
    need = p.nbytes
    if not direct:
        from localdiff.backends.gguf_quant import estimate_bytes

        quant_bytes = estimate_bytes([t.shape for t in p.tensors], qtype)
        need += quant_bytes
    _check_space(out.parent, need)
    bar = _Progress(args.quiet)
    try:
        if direct:
            bar.phase(f"writing {out.name} ({qtype})", p.nbytes)
            gguf_write.write(p, partial, gguf_write.DIRECT[qtype], bar.advance)
        else:
            from localdiff.backends.gguf_quant import quantize

            bar.phase(f"writing the {p.source_dtype} intermediate", p.nbytes)
            gguf_write.write(p, tmp, gguf_write.DIRECT[p.source_dtype], bar.advance)
            bar.phase(f"quantizing to {qtype} (llama.cpp)", quant_bytes)
            quantize(tmp, partial, qtype, args.threads or 0, bar.advance)
        os.replace(partial, out)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LocaldiffError(f"disk full while writing {out.parent}: convert needs about "
                                 f"{need / 1e9:.1f} GB; nothing was left behind") from None
        raise
    finally:
        bar.close()
        for f in (partial, tmp):
            try:
                f.unlink()
            except FileNotFoundError:
                pass
    from localdiff.hub.progress import human_bytes

    if not args.quiet:
        sys.stderr.write(f"wrote {out} ({p.arch}, {qtype}, {human_bytes(out.stat().st_size)})\n")
    return 0
