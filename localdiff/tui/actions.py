"""Key and palette actions of ``localdiff chat``: ctrl+c / ctrl+d / scrolling / Tab completion from the prompt box,
copying the last answer, new chat, clear (asks first), regenerate, theme (saved) and the canvas panel toggle.
Mixed into :class:`localdiff.tui.app.ChatApp`."""

from __future__ import annotations

import time

from localdiff.tui.slash import clipboard_note
from localdiff.tui.widgets import PromptArea


class ActionsMixin:
    """Actions for ChatApp (uses its transcript, prompt, store, model, settings and generation state)."""

    async def action_interrupt(self) -> None:
        """ctrl+c (as in ``ollama run``): stop the answer in flight; pressed again while it stops, or when idle, quit."""
        if self.generating and not self.cancel_event.is_set():
            self.action_cancel()
            self._stop_requested_at = time.monotonic()
            self.notify("stopping — ctrl+c again quits", timeout=2)
            return
        await self.action_quit()

    async def on_prompt_area_quit_request(self, _: PromptArea.QuitRequest) -> None:
        """ctrl+d on an empty prompt quits (stopping an answer in flight)."""
        await self.action_quit()

    def on_prompt_area_scroll_request(self, event: PromptArea.ScrollRequest) -> None:
        """PageUp/PageDown (Home/End on an empty prompt) scroll the transcript; the prompt keeps the focus."""
        t = self.transcript
        {"page_up": t.scroll_page_up, "page_down": t.scroll_page_down, "home": t.scroll_home, "end": t.scroll_end}[
            event.action
        ](animate=False)

    async def on_prompt_area_completions(self, event: PromptArea.Completions) -> None:
        """Tab with several candidates lists them; with none, says so."""
        if event.options:
            await self.transcript.add_note("  ".join(o.strip() for o in event.options))
        else:
            await self.transcript.add_note(f"nothing completes {event.text.strip()!r}")

    async def action_copy_last(self) -> None:
        """f2 / ``/copy``: put the last answer on the clipboard (OSC 52) and say how that went."""
        last = next((m for m in reversed(self.messages) if m["role"] == "assistant" and m["content"]), None)
        if last is None:
            await self.transcript.add_note("no answer to copy yet")
            return
        self.copy_to_clipboard(last["content"])
        await self.transcript.add_note(clipboard_note(len(last["content"])))

    async def _idle_or_note(self) -> bool:
        if self.generating:
            await self.transcript.add_note("still answering — press Esc or ctrl+c to stop it first")
            return False
        return True

    async def action_new_chat(self) -> None:
        """Start a new conversation with a fresh engine cache; the current one stays saved."""
        if not await self._idle_or_note():
            return
        await self._reset_conversation()
        await self.transcript.add_note("new chat")

    async def action_clear_chat(self) -> None:
        """Delete the current conversation's turns (screen, context, history) and start it over. Asks first: the
        first call only asks, a second call in a row (``/clear`` again, or the palette entry again) clears."""
        if not await self._idle_or_note():
            return
        if not self._clear_pending:
            self._clear_pending = True
            n = len(self.messages)
            await self.transcript.add_note(
                f"clear this conversation ({n} turn{'' if n == 1 else 's'}, deleted from "
                "the history too)? /clear again confirms; anything else keeps it"
            )
            return
        self._clear_pending = False
        if self.conversation_id is not None:
            self.store.clear_turns(self.conversation_id)
        keep = self.conversation_id
        await self._reset_conversation()
        self.conversation_id = keep
        await self.transcript.add_note("conversation cleared")

    async def _reset_conversation(self) -> None:
        await self.transcript.clear_all()
        self.messages, self.turn_ids, self.conversation_id = [], [], None
        self.cache = self.model.new_cache() if self.model is not None else None
        self.canvas.reset()
        self.status.show_stats(None)

    async def action_regenerate(self) -> None:
        """Drop the last answer (screen, context, history) and generate it again from the same messages; after a
        resume whose last answer was lost, just generate it."""
        if not await self._idle_or_note():
            return
        if self.model is None or not self.messages:
            await self.transcript.add_note("no answer to regenerate")
            return
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            self.store.delete_turn(self.turn_ids.pop())
            await self.transcript.messages[-1].remove()
        await self._start_generation()

    def action_toggle_theme(self) -> None:
        """ctrl+t: switch between the dark and the light theme (saved to the config file)."""
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def _on_theme_changed(self, theme) -> None:
        """Any theme change (ctrl+t or the palette's theme picker) is written to the config file."""
        note = self._save_prefs({"theme": theme.name})
        if note.startswith("  (not saved"):
            self.notify(note.strip(" ()"), severity="error")

    def action_toggle_canvas(self) -> None:
        """ctrl+o: keep the canvas panel visible when idle, or hide it when idle (it always shows while answering)."""
        self.pin_canvas = not self.pin_canvas
        self.canvas.set_class(not (self.pin_canvas or self.generating), "-hidden")
