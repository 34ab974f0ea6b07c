"""Shared helpers for the chat (TUI) tests: the embedded model once per module, and waiting on the app."""
from __future__ import annotations

import time

import pytest

import localdiff


@pytest.fixture(scope="module")
def tiny():
    """The embedded model, loaded once per test module."""
    return localdiff.load("tiny", device="cpu")


async def wait_for(pilot, cond, timeout=60.0):
    """Let the app run until cond() is true; fail after timeout seconds."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)
