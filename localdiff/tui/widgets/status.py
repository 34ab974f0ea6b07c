"""The status line: model, device, quantization, tokens per forward, tokens/s, ARness (how left to right the decoding
order was: Global ARness@1, masked family), process memory (RSS), state."""

from __future__ import annotations

import os

from textual.widgets import Static

from localdiff.safetext import visible


def rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``; peak RSS elsewhere; 0 if unknown)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except Exception:
        return 0


def human_bytes(n: float) -> str:
    """1536 → "1.5 KiB"; binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "MiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class StatusLine(Static):
    """One line: ``ready │ tiny · cpu · fp32 │ TPF 3.20 · 51.2 tok/s │ RSS 310 MiB``. Memory refreshes every 2 s.

    While an answer runs (``show_live``) the figures are live: ``generating 2.4 s · 37 tok · 15.4 tok/s · TPF 3.08``
    (elapsed seconds, answer tokens so far, tokens per second, tokens per decoder forward)."""

    DEFAULT_CSS = """
    StatusLine { height: 1; dock: top; background: $panel; color: $text; padding: 0 1; }
    StatusLine.-error { background: $error 40%; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", markup=False, **kwargs)
        self.model = "—"
        self.device = "—"
        self.quant = "—"
        self.tpf: float | None = None
        self.tps: float | None = None
        self.arness: float | None = None  # Global ARness@1 of the last answer (masked family)
        self.tau: float | None = None  # DFlash acceptance length τ of the last answer (with a draft)
        self.state = "starting"
        self.memory_fn = rss_bytes
        self.live: tuple[float, int, int] | None = None  # (elapsed seconds, tokens so far, forwards so far)

    def on_mount(self) -> None:
        self._redraw()
        self.set_interval(2.0, self._redraw)

    def set_model(self, name: str, device: str, quant: str) -> None:
        """Show the loaded model."""
        self.model, self.device, self.quant = name, device, quant
        self._redraw()

    def set_state(self, state: str, *, error: bool = False) -> None:
        """Show the app state ("loading tiny…", "ready", "generating", "error")."""
        self.state = state
        self.set_class(error, "-error")
        self._redraw()

    def show_stats(self, stats) -> None:
        """Show TPF and tok/s (and DFlash's τ) from a GenerationStats (None clears them)."""
        self.tau = float(stats.acceptance_length) if getattr(stats, "acceptance_lengths", None) else None
        self.tpf = None if stats is None else float(stats.tokens_per_forward)
        self.tps = None if stats is None else float(stats.tokens_per_second)
        self.arness = None if stats is None else (getattr(stats, "arness", None) or {}).get("global@1")
        self._redraw()

    def show_live(self, elapsed: float, tokens: int, forwards: int) -> None:
        """Live figures of the answer in flight (``clear_live`` ends them)."""
        self.live = (elapsed, tokens, forwards)
        self._redraw()

    def clear_live(self) -> None:
        """Back to the last finished answer's figures."""
        self.live = None
        self._redraw()

    def line(self) -> str:
        """The current status text."""
        if self.live is not None:
            secs, tokens, forwards = self.live
            tps = tokens / secs if secs > 0 else 0.0
            tpf = f"TPF {tokens / forwards:.2f}" if forwards else "TPF —"
            return f"{self.state} {secs:.1f} s · {tokens} tok · {tps:.1f} tok/s · {tpf} │ {self.model} · {self.device}"
        tpf = "TPF —" if self.tpf is None else f"TPF {self.tpf:.2f}"
        tps = "— tok/s" if self.tps is None else f"{self.tps:.1f} tok/s"
        if self.arness is not None:
            tps += f" · ARness {self.arness:.2f}"
        if self.tau is not None:
            tps += f" · τ {self.tau:.2f}"
        rss = self.memory_fn()
        mem = f"RSS {human_bytes(rss)}" if rss else "RSS ?"
        return visible(f"{self.state} │ {self.model} · {self.device} · {self.quant} │ {tpf} · {tps} │ {mem}")

    def _redraw(self) -> None:
        self.update(self.line())
