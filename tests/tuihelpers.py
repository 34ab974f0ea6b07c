"""Shared helpers for the chat (TUI) tests: waiting on the app (the ``tiny`` fixture lives in conftest)."""
from __future__ import annotations

import time


async def wait_for(pilot, cond, timeout=60.0):
    """Let the app run until cond() is true; fail after timeout seconds."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)
