"""The transcript: the user's turns verbatim, answers as Markdown; the answer in flight grows one finished canvas at a
time. Control characters are shown as visible symbols, never sent to the terminal."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from localdiff.safetext import visible
from localdiff.tui import blocks


class UserMessage(Static):
    """The user's turn, shown exactly as typed (no Markdown, no markup; line breaks kept); ``role`` is "user"."""

    def __init__(self, text: str, **kwargs) -> None:
        super().__init__(visible(text), markup=False, classes="user", **kwargs)
        self.role = "user"
        self.text = text


class ChatMessage(Markdown):
    """An answer rendered as Markdown; ``role`` is "assistant" (also a CSS class)."""

    def __init__(self, role: str = "assistant", text: str = "", **kwargs) -> None:
        super().__init__(visible(text), classes=role, **kwargs)
        self.role = role
        self.text = text

    async def append_text(self, fragment: str) -> None:
        """Append a finished canvas's text (incremental Markdown parse of the tail only)."""
        if fragment:
            self.text += fragment
            await self.append(visible(fragment))

    async def set_text(self, text: str) -> None:
        """Replace the whole text (once per turn, when the answer is final); an empty answer says so."""
        shown = blocks.render(visible(text), self.size.width or 80)  # NAP's think blocks side by side
        if text != self.text or not text or shown != visible(text):
            self.text = text
            await self.update(shown or "*(empty answer)*")


class Transcript(VerticalScroll):
    """Scrollable list of ChatMessage / note widgets; stays scrolled to the bottom unless the user scrolls up."""

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 1; }
    Transcript > ChatMessage { margin: 0 0 1 0; padding: 0 1; border-left: thick $primary; background: $background; }
    Transcript > UserMessage { margin: 0 0 1 0; padding: 0 1; border-left: double $accent; background: $surface; }
    Transcript > ChatMessage > MarkdownBlock:last-child { margin-bottom: 0; }
    Transcript > .note { color: $text-muted; margin: 0 0 1 0; padding: 0 1; }
    Transcript > .error { color: $error; text-style: bold; border-left: thick $error; }
    """

    def on_mount(self) -> None:
        self.anchor()

    @property
    def messages(self) -> list[UserMessage | ChatMessage]:
        """The chat turns on screen, in order."""
        return [w for w in self.children if isinstance(w, (UserMessage, ChatMessage))]

    async def add_message(self, role: str, text: str) -> UserMessage | ChatMessage:
        """Append a turn: "user" verbatim, "assistant" as Markdown."""
        msg = UserMessage(text) if role == "user" else ChatMessage(role, text)
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
