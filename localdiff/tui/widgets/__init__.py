"""Widgets of ``localdiff chat``: canvas view, transcript, prompt box, status line."""

from localdiff.tui.widgets.canvas_view import CanvasView
from localdiff.tui.widgets.prompt import PromptArea
from localdiff.tui.widgets.status import StatusLine
from localdiff.tui.widgets.transcript import Transcript

__all__ = ["CanvasView", "PromptArea", "StatusLine", "Transcript"]
