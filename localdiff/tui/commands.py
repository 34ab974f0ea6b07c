"""Command palette entries (ctrl+p) for ``localdiff chat`` and the list of models one can switch to."""

from __future__ import annotations

from functools import partial
from typing import Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider


def _entry_name(item) -> str | None:
    """Name of one ``hub.list_models()`` item: a str, a dict or an object with alias / name / repo_id / repo."""
    if isinstance(item, str):
        return item
    for key in ("name", "alias", "repo_id", "repo"):
        value = item.get(key) if isinstance(item, dict) else getattr(item, key, None)
        if isinstance(value, str) and value:
            return value
    return None


def available_models() -> list[str]:
    """Models that load without a download: ``localdiff.hub.models.list_models()`` (embedded + fully pulled), by name.
    Falls back to the embedded ``tiny`` alone when the hub module is unavailable or fails."""
    try:
        from localdiff.engine import installed_models

        items = installed_models()
    except Exception:
        return ["tiny"]
    names: list[str] = []
    for item in items:
        name = _entry_name(item)
        if name and name not in names:
            names.append(name)
    return names


class ChatCommands(Provider):
    """New chat, clear, regenerate, theme, canvas panel, and one "Switch model" entry per available model."""

    async def startup(self) -> None:
        import asyncio

        self._models = await asyncio.to_thread(self.app.model_choices)

    def _commands(self) -> list[tuple[str, str, Callable]]:
        app = self.app
        cmds = [
            ("New chat", "Start a new conversation (the current one stays in the history)", app.action_new_chat),
            (
                "Clear conversation",
                "Delete this conversation's turns from screen, context and history",
                app.action_clear_chat,
            ),
            ("Regenerate last answer", "Drop the last answer and generate it again", app.action_regenerate),
            (
                "Toggle dark / light theme",
                "Switch between the dark and the light theme (ctrl+t)",
                app.action_toggle_theme,
            ),
            (
                "Toggle canvas panel",
                "Show or hide the last canvas when idle (ctrl+o); it always shows while answering",
                app.action_toggle_canvas,
            ),
        ]
        for name in getattr(self, "_models", []):
            cmds.append(
                (
                    f"Switch model: {name}",
                    f"Load {name} and continue this conversation with it",
                    partial(app.switch_model, name),
                )
            )
        return cmds

    async def discover(self) -> Hits:
        for name, help_text, callback in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
