"""``localdiff convert SRC -o FILE.gguf --type T``: a checkpoint folder or pulled model → a GGUF file llama.cpp
computes. The work (and the atomic ``FILE.gguf.partial`` → ``FILE.gguf`` rename) is
:func:`localdiff.backends.gguf_convert.convert_checkpoint`; here: argument checks (every bad input one line, before
anything is written; an existing ``FILE.gguf`` is kept unless ``--force``) and the progress bar on stderr.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from localdiff.errors import LocaldiffError, UsageError

#: the --type values (as :data:`localdiff.backends.gguf_convert.TYPES`; kept here so --help needs no import)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def add_parser(sub) -> None:
    """The ``convert`` subcommand's arguments (called by :func:`localdiff.cli.parser.build_parser`)."""
    cv = sub.add_parser(
        "convert",
        help="write a GGUF file (llama.cpp) from a checkpoint",
        description="Convert a LLaDA, LLaDA-MoE, Dream, SDAR, SDAR-MoE or Fast-dLLM v2 checkpoint "
        "(folder or pulled model) to GGUF; quantized types use llama.cpp's quantizer.",
    )
    cv.add_argument("src", metavar="SRC", help="checkpoint folder, catalog alias or pulled org/repo")
    cv.add_argument("-o", "--output", required=True, metavar="FILE.gguf", help="the GGUF file to write")
    cv.add_argument("--type", dest="qtype", default="F16", metavar="TYPE", help=f"{' | '.join(TYPES)} (default F16)")
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

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
            )

    def phase(self, label: str, total: int) -> None:
        from localdiff.hub.progress import human_bytes

        if self.bar is not None:
            if self.task is None:
                self.bar.start()
            else:  # the previous phase is complete
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


def run_convert(args) -> int:
    """Run ``localdiff convert`` (see the module docstring). Returns 0; errors raise one-line LocaldiffErrors."""
    from localdiff.backends.gguf_convert import TYPES

    qtype = str(args.qtype).upper()
    if qtype not in TYPES:
        raise UsageError(f"--type {args.qtype}: unknown type (choose from {', '.join(TYPES)})")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be ≥ 1")
    from localdiff.hub.models import resolve_model
    from localdiff.loader import gguf_target

    if os.path.isfile(os.path.expanduser(args.src)) and gguf_target(args.src) is not None:
        raise UsageError(f"{args.src}: already a GGUF file; convert reads safetensors checkpoints")
    if (
        not os.path.exists(os.path.expanduser(args.src))
        and ("/" in args.src or os.sep in args.src)
        and args.src.startswith((".", "/", "~"))
    ):
        raise UsageError(f"{args.src}: no such folder")
    out = _check_output(args.output, args.force)
    try:
        import gguf

        if getattr(gguf, "__file__", None) is None:  # a folder named gguf in the working directory, not the package
            raise ImportError
    except ImportError:
        raise LocaldiffError('convert needs the gguf extra: pip install "localdiff[gguf]"') from None
    from localdiff.backends.gguf_convert import convert_checkpoint
    from localdiff.hub.progress import human_bytes

    ckpt = resolve_model(args.src)
    bar = _Progress(args.quiet)
    try:
        p = convert_checkpoint(
            ckpt,
            out,
            qtype,
            args.threads or 0,
            bar.phase,
            bar.advance,
            lambda text: sys.stderr.write(f"note: {text}\n"),
        )
    finally:
        bar.close()
    if not args.quiet:
        sys.stderr.write(f"wrote {out} ({p.arch}, {qtype}, {human_bytes(out.stat().st_size)})\n")
    return 0
