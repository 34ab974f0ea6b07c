"""Shared helpers for the chat (TUI) tests: making the app, waiting on it, sending a turn, parking the worker
(the ``tiny`` fixture lives in conftest)."""

from __future__ import annotations

import threading
import time

from localdiff.tui.app import ChatApp
from localdiff.tui.settings import ChatSettings
from localdiff.tui.store import ChatStore


async def wait_for(pilot, cond, timeout=60.0):
    """Let the app run until cond() is true; fail after timeout seconds."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


def make_app(model, tmp_path, **kw):
    """A ChatApp on ``model`` (any name loads it) with its history in ``tmp_path``; ``seed=`` or ``settings=``."""
    kw.setdefault("settings", ChatSettings(seed=kw.pop("seed", 0)))
    return ChatApp("tiny", store=ChatStore(tmp_path / "h.sqlite3"), loader=lambda name, **_: model, **kw)


async def send(pilot, app, text):
    """Type ``text`` once the model is ready, press enter, wait for the answer; the prompt is cleared and the app
    idle after it. Returns ``app.last_finish``."""
    await wait_for(pilot, lambda: app.model is not None and not app.generating)
    done = app.finished_count
    await pilot.press(*text)
    assert app.prompt.text == text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.finished_count > done)
    assert not app.generating and app.prompt.text == ""
    return app.last_finish


def hold_first_step(app):
    """A step hook that parks the worker after the first denoising step until released (or the app cancels).
    Returns (hook, paused, release): ``paused`` is set when the worker parks; set ``release`` to let it go."""
    paused, release = threading.Event(), threading.Event()

    def hook(ev):
        if not paused.is_set():
            paused.set()
            while not release.wait(0.05) and not app.cancel_event.is_set():
                pass

    return hook, paused, release
