"""The transcript: finished turns as Markdown; the answer in flight grows one finished canvas at a time."""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from localdiff.safetext import visible


def _hard_breaks(text: str) -> str:
    """Keep the user's line breaks (Markdown would join single newlines into one paragraph line)."""
    return text.replace("\r\n", "\n").replace("\n", "  \n")


class ChatMessage(Markdown):
    """One turn rendered as Markdown; ``role`` is "user" or "assistant" (also a CSS class). ``text`` keeps the exact
    text; what is rendered has control characters made visible (:func:`localdiff.safetext.visible`), so model
    output never reaches the terminal as escape sequences."""

    def __init__(self, role: str, text: str = "", **kwargs) -> None:
        shown = visible(text)
        super().__init__(_hard_breaks(shown) if role == "user" else shown, classes=role, **kwargs)
        self.role = role
        self.text = text
        self.border_title = "you" if role == "user" else "assistant"

    async def append_text(self, fragment: str) -> None:
        """Append a finished canvas's text (incremental Markdown parse of the tail only)."""
        if fragment:
            self.text += fragment
            await self.append(visible(fragment))

    async def set_text(self, text: str) -> None:
        """Replace the whole text (once per turn, when the answer is final); an empty answer says so."""
        if text != self.text or not text:
            self.text = text
            await self.update(visible(text) or "*(empty answer)*")


class Transcript(VerticalScroll):
    """Scrollable list of ChatMessage / note widgets; stays scrolled to the bottom unless the user scrolls up."""

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 1; }
    Transcript > ChatMessage { margin: 0 0 1 0; padding: 0 1; border-left: thick $accent; background: $surface; }
    Transcript > ChatMessage.assistant { border-left: thick $primary; background: $background; }
    Transcript > ChatMessage.user { border-left: double $accent; }
    Transcript > ChatMessage > MarkdownBlock:last-child { margin-bottom: 0; }
    Transcript > .note { color: $text-muted; margin: 0 0 1 0; padding: 0 1; }
    Transcript > .error { color: $error; text-style: bold; border-left: thick $error; }
    """

    def on_mount(self) -> None:
        self.anchor()

    @property
    def messages(self) -> list[ChatMessage]:
        """The chat turns on screen, in order."""
        return [w for w in self.children if isinstance(w, ChatMessage)]

    async def add_message(self, role: str, text: str) -> ChatMessage:
        """Append a finished turn."""
        msg = ChatMessage(role, text)
        await self.mount(msg)
        self.scroll_end(animate=False)
        return msg

    async def add_note(self, text: str, *, error: bool = False) -> Static:
        """Append a one-line system note (settings changes, errors); not part of the conversation."""
        note = Static(visible(text), classes="note error" if error else "note", markup=False)
        await self.mount(note)
        self.scroll_end(animate=False)
        return note

    async def clear_all(self) -> None:
        """Remove every message and note."""
        await self.remove_children()
