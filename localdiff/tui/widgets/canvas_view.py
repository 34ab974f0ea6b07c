"""The live canvas panel: one cell per canvas position, styled by state, shaded by confidence.

States are told apart by text style as well as colour, so the panel reads without colour too:
locked = bold, just locked = bold underline, still noisy = dim italic, reopened / renoised after locking =
strike-through. Confidence (top-1 probability) shades each cell's background and is drawn again as a sparkline row
(``▁``…``█``, one character per position; positions are averaged in groups when the canvas is wider than two rows).
Cells hold whole tokens while the canvas fits the panel; a long canvas (e.g. 256 positions at 80 columns) switches to
one character per position (the token's first visible character) so the whole canvas stays on screen.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from localdiff.tui.runner import LOCKED, MASK, NEW, NOISY, REOPENED, CanvasFrame

SPARKS = "▁▂▃▄▅▆▇█"
CONTENT_ROWS = 8  # rows inside the panel's border (max-height 10)


def spark(value: float) -> str:
    """Sparkline character for a value in [0, 1] (clamped)."""
    v = min(max(value, 0.0), 1.0)
    return SPARKS[min(int(v * len(SPARKS)), len(SPARKS) - 1)]


class CanvasView(Widget):
    """Draws the newest ``CanvasFrame``; the border shows canvas index, step (``step 5/16``) and state counts."""

    COMPONENT_CLASSES = {
        "canvas--locked",
        "canvas--new",
        "canvas--noisy",
        "canvas--mask",
        "canvas--reopened",
        "canvas--confidence",
        "canvas--spark",
    }

    DEFAULT_CSS = """
    CanvasView {
        height: auto;
        max-height: 10;
        border: round $primary;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    CanvasView > .canvas--locked { text-style: bold; color: $text; }
    CanvasView > .canvas--new { text-style: bold underline; color: $success; }
    CanvasView > .canvas--noisy { text-style: dim italic; color: $text-muted; }
    CanvasView > .canvas--reopened { text-style: strike bold; color: $error; }
    CanvasView > .canvas--mask { text-style: dim; color: $accent; }
    CanvasView > .canvas--confidence { color: $primary; }
    CanvasView > .canvas--spark { color: $secondary; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.frame: CanvasFrame | None = None
        self.frames_drawn = 0
        self.border_title = "canvas"
        self.border_subtitle = "bold locked · underline new · dim noisy · strike reopened"

    def show(self, frame: CanvasFrame) -> None:
        """Draw ``frame`` (call on the UI thread)."""
        self.frame = frame
        self.frames_drawn += 1
        if frame.drafted:  # DFlash: the drafted block; the last token and the accepted drafts are NEW
            n, acc = len(frame.states) - 1, frame.count(NEW) - 1
            self.border_title = f"drafted block {frame.canvas_index} · accepted {acc}/{n}"
            self.border_subtitle = "underline accepted · dim rejected"
            self.refresh(layout=True)
            return
        state = "done" if frame.final else f"step {frame.step}/{frame.max_steps}"
        if frame.slots and not frame.final:  # ReFusion: a step is a plan-and-fill round over slots
            state = f"round {frame.step} · {frame.slots}"
        self.border_title = f"canvas {frame.canvas_index + 1} · {state}"
        n = len(frame.states)
        self.border_subtitle = f"locked {frame.count(LOCKED) + frame.count(NEW)}/{n} · new {frame.count(NEW)}" + (
            f" · masked {frame.count(MASK)}"
            if MASK in frame.states
            else f" · noisy {frame.count(NOISY)} · reopened {frame.count(REOPENED)}"
        )
        self.refresh(layout=True)

    def mark_stopped(self) -> None:
        """Esc stopped the answer: the canvas on screen was not finished (and is not part of the answer)."""
        if self.frame is not None and not self.frame.final:
            self.border_title = f"canvas {self.frame.canvas_index + 1} · stopped at step {self.frame.step} (dropped)"

    def reset(self) -> None:
        """Forget the frame (before a new answer)."""
        self.frame = None
        self.border_title = "canvas"
        self.border_subtitle = "waiting for the first step"
        self.refresh(layout=True)

    def _state_styles(self) -> dict:
        return {
            s: self.get_component_rich_style(f"canvas--{s}", partial=True) for s in (LOCKED, NEW, NOISY, REOPENED, MASK)
        }

    def render(self) -> Text:
        frame = self.frame
        if frame is None:
            return Text("the canvas of the next answer denoises here", style="dim italic")
        styles = self._state_styles()
        _, base = self.background_colors
        shade = self.get_component_styles("canvas--confidence").color
        width = max(self.content_region.width or self.size.width or 76, 8)
        n = len(frame.tokens)
        spark_rows = min(2, -(-n // width))
        # Whole tokens when they fit in the panel; else one character cell per position (first character).
        budget = (CONTENT_ROWS - spark_rows) * width
        compact = sum(cell_len(t) for t in frame.tokens) * 1.15 > budget
        text = Text(no_wrap=False, overflow="fold")
        for tok, state, conf in zip(frame.tokens, frame.states, frame.confidence):
            bg = base.blend(shade, 0.08 + 0.5 * min(max(conf, 0.0), 1.0))
            if state in (NOISY, REOPENED) and tok.strip() == "":
                tok = "·" * max(len(tok), 1)
            if compact:
                tok = next((ch for ch in tok if ch.strip()), "·")
                tok = tok if cell_len(tok) == 1 else "▪"
            text.append(tok, styles[state] + Style(bgcolor=bg.rich_color))
        text.append("\n")
        text.append_text(self._sparkline(frame, styles, spark_rows * width))
        return text

    def _sparkline(self, frame: CanvasFrame, styles: dict, max_chars: int) -> Text:
        n = min(len(frame.confidence), len(frame.states))
        line = Text(overflow="fold")
        spark_style = self.get_component_rich_style("canvas--spark", partial=True)
        if n == 0:
            return line
        group = max(1, -(-n // max_chars))
        for start in range(0, n, group):
            vals = frame.confidence[start : start + group]
            state = frame.states[start]
            style = spark_style if state in (LOCKED, NEW) else styles[state]
            line.append(spark(sum(vals) / len(vals)), style)
        return line
