"""The prompt box: Enter sends; ctrl+j or alt+enter inserts a newline."""
from __future__ import annotations

from textual.binding import Binding
from textual.events import Key
from textual.message import Message
from textual.widgets import TextArea


class PromptArea(TextArea):
    """Multi-line prompt. Posts ``PromptArea.Submitted`` with the text (and clears itself) on Enter."""

    BINDINGS = [
        Binding("enter", "submit", "Send"),
        Binding("ctrl+j", "newline", "Newline"),
        Binding("alt+enter", "newline", "Newline", show=False),
    ]

    DEFAULT_CSS = """
    PromptArea { height: auto; min-height: 3; max-height: 8; border: round $accent; }
    PromptArea:focus { border: round $primary; }
    """

    class Submitted(Message):
        """The user sent ``text`` (stripped, non-empty)."""

        def __init__(self, prompt: "PromptArea", text: str) -> None:
            super().__init__()
            self.prompt, self.text = prompt, text

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.border_title = "message"
        self.placeholder = "Type a message · /set steps 8 · ctrl+p commands"

    async def _on_key(self, event: Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in ("ctrl+j", "alt+enter"):
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        """Send the text unless it is blank."""
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(self, text))
            self.clear()

    def action_newline(self) -> None:
        """Insert a line break at the cursor."""
        start, end = self.selection
        self.replace("\n", start, end, maintain_selection_offset=False)
