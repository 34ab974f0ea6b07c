"""Download progress on stderr: a rich bar on a terminal, plain lines otherwise, nothing with ``-q``.

All reporters share one small interface: ``start(total_bytes, done_bytes)``, ``file_start(name, size, initial)``,
``advance(n)``, ``file_done(name)``, ``note(text)``, ``close()``. Byte counts are in bytes; rates in bytes/second.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    """Format a byte count with decimal units (kB, MB, GB, TB), as ``hf`` and ``ollama`` do."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"  # pragma: no cover


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class QuietProgress:
    """Reports nothing except notes (which are also dropped)."""

    def start(self, total: int, done: int = 0) -> None: ...
    def file_start(self, name: str, size: int, initial: int = 0) -> None: ...
    def advance(self, n: int) -> None: ...
    def file_done(self, name: str) -> None: ...
    def note(self, text: str) -> None: ...
    def close(self) -> None: ...


class PlainProgress(QuietProgress):
    """One line per file and a status line at most every ``interval`` seconds; no ANSI codes (for logs and pipes)."""

    def __init__(self, stream: TextIO | None = None, interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.interval = interval
        self.total = self.done = 0
        self.t0 = self.last = time.monotonic()
        self.session_bytes = 0
        self.name = ""
        self.file_size = self.file_done_bytes = 0

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, total: int, done: int = 0) -> None:
        self.total, self.done = total, done
        self.t0 = self.last = time.monotonic()

    def file_start(self, name: str, size: int, initial: int = 0) -> None:
        self.name, self.file_size, self.file_done_bytes = name, size, initial
        resumed = f" (resuming at {human_bytes(initial)})" if initial else ""
        self._line(f"downloading {name} ({human_bytes(size)}){resumed}")

    def advance(self, n: int) -> None:
        self.done += n
        self.session_bytes += n
        self.file_done_bytes += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            rate = self.session_bytes / max(now - self.t0, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else 0
            pct = 100.0 * self.done / self.total if self.total else 100.0
            self._line(
                f"  {human_bytes(self.done)} / {human_bytes(self.total)} ({pct:.0f}%), "
                f"{human_bytes(rate)}/s, ETA {_eta(left)}"
            )

    def file_done(self, name: str) -> None:
        pass

    def note(self, text: str) -> None:
        self._line(text)


class RichProgress(QuietProgress):
    """A rich progress bar (bytes, rate, ETA) on a terminal stderr; honours NO_COLOR through rich's Console."""

    def __init__(self, stream: TextIO | None = None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(file=stream or sys.stderr)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.task = None

    def start(self, total: int, done: int = 0) -> None:
        self.progress.start()
        self.task = self.progress.add_task("pulling", total=total, completed=done)

    def file_start(self, name: str, size: int, initial: int = 0) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=name if len(name) < 40 else "…" + name[-39:])

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, description="done")
        self.progress.stop()


def make_progress(quiet: bool = False, stream: TextIO | None = None):
    """Pick the reporter: Quiet with ``quiet``, Rich when ``stream`` (default stderr) is a terminal that can redraw a
    line, else Plain — also on ``TERM=dumb`` / ``unknown``, where rich draws no live bar and a pull would show nothing
    until it ends."""
    stream = stream or sys.stderr
    if quiet:
        return QuietProgress()
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    dumb = os.environ.get("TERM", "").lower() in ("dumb", "unknown")
    return RichProgress(stream) if tty and not dumb else PlainProgress(stream)
