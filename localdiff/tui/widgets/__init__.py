"""Widgets of ``localdiff chat``: canvas view, transcript, prompt box, status line."""
from .canvas_view import CanvasView
from .prompt import PromptArea
from .status import StatusLine
from .transcript import Transcript

__all__ = ["CanvasView", "PromptArea", "StatusLine", "Transcript"]
