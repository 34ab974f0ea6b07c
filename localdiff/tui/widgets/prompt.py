"""The prompt box: Enter sends; ctrl+j or alt+enter inserts a newline; Up/Down recall earlier prompts; Tab completes
slash commands; a paste is inserted as text (control characters made visible) and never sends."""

from __future__ import annotations

from typing import Callable

from textual import events
from textual.binding import Binding
from textual.events import Key
from textual.message import Message
from textual.widgets import TextArea

from localdiff.tui.paste import visible_controls

#: Keys the prompt hands to the transcript (scrolling) instead of moving its own cursor. Home/End only when the
#: prompt is empty (in a typed line they move the cursor, as in any editor).
SCROLL_KEYS = {"pageup": "page_up", "pagedown": "page_down", "home": "home", "end": "end"}


class PromptArea(TextArea):
    """Multi-line prompt. Posts ``Submitted`` (and clears itself) on Enter, ``ScrollRequest`` for PageUp/PageDown
    (Home/End on an empty prompt), ``QuitRequest`` for ctrl+d on an empty prompt, ``Completions`` for Tab.

    Attributes:
        prompt_history: earlier prompts, oldest first (the app fills it from the history database); Up/Down walk it.
        completer: ``completer(text) -> list[str]`` of full-text candidates for a text starting with "/"; None = off.
    """

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

    class ScrollRequest(Message):
        """Scroll the transcript: ``action`` is "page_up", "page_down", "home" or "end"."""

        def __init__(self, action: str) -> None:
            super().__init__()
            self.action = action

    class QuitRequest(Message):
        """ctrl+d on an empty prompt."""

    class Completions(Message):
        """Tab found several candidates (``options``) or none (empty list) for ``text``."""

        def __init__(self, text: str, options: list[str]) -> None:
            super().__init__()
            self.text, self.options = text, options

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.border_title = "message"
        self.placeholder = "Type a message · /help · ctrl+p commands"
        self.prompt_history: list[str] = []
        self.completer: Callable[[str], list[str]] | None = None
        self._hist_pos: int | None = None  # index into history while walking it, None when editing a draft
        self._draft = ""

    async def _on_key(self, event: Key) -> None:
        key = event.key
        handled = True
        if key == "enter":
            self.action_submit()
        elif key in ("ctrl+j", "alt+enter"):
            self.action_newline()
        elif key == "ctrl+d" and not self.text:
            self.post_message(self.QuitRequest())
        elif key in ("pageup", "pagedown") or (key in ("home", "end") and not self.text):
            self.post_message(self.ScrollRequest(SCROLL_KEYS[key]))
        elif key == "up" and self.cursor_location[0] == 0 and self.prompt_history:
            self.recall(-1)
        elif key == "down" and self._hist_pos is not None and self.cursor_location[0] == self.document.line_count - 1:
            self.recall(+1)
        elif key == "tab" and self.text.startswith("/") and self.completer is not None:
            self.complete()
        else:
            handled = False
        if handled:
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        """Insert the pasted text with control characters made visible; a paste never sends."""
        event.stop()
        event.prevent_default()
        clean = visible_controls(event.text)
        if clean and not self.read_only:
            result = self._replace_via_keyboard(clean, *self.selection)
            if result:
                self.move_cursor(result.end_location)
            self.focus()

    def recall(self, direction: int) -> None:
        """Up (-1) / Down (+1) through ``prompt_history``; past the newest entry the draft typed before comes back."""
        if self._hist_pos is None:
            if direction > 0:
                return
            self._draft, self._hist_pos = self.text, len(self.prompt_history)
        pos = min(max(self._hist_pos + direction, 0), len(self.prompt_history))
        self._hist_pos = pos
        text = self.prompt_history[pos] if pos < len(self.prompt_history) else self._draft
        if pos == len(self.prompt_history):
            self._hist_pos = None
        self.load_text(text)
        self.move_cursor(self.document.end)

    def remember(self, text: str) -> None:
        """Add a sent prompt to ``prompt_history`` (consecutive duplicates once) and stop walking it."""
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._hist_pos, self._draft = None, ""

    def complete(self) -> None:
        """Tab: complete the text from ``completer``; one candidate replaces the text, several extend it to their
        common prefix and are listed (``Completions``)."""
        text = self.text
        options = self.completer(text) if self.completer else []
        if len(options) == 1:
            self.load_text(options[0])
        else:
            prefix = _common_prefix(options) if options else text
            if len(prefix) > len(text):
                self.load_text(prefix)
            self.post_message(self.Completions(text, options))
        self.move_cursor(self.document.end)

    def action_submit(self) -> None:
        """Send the text unless it is blank."""
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(self, text))
            self.remember(text)
            self.clear()

    def action_newline(self) -> None:
        """Insert a line break at the cursor."""
        start, end = self.selection
        self.replace("\n", start, end, maintain_selection_offset=False)


def _common_prefix(words: list[str]) -> str:
    first, last = min(words), max(words)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]
