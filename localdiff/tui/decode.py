"""Keyboard bytes that are not UTF-8 (a Latin-1 terminal, a stray ``\\xff``): shown as "�", never a crash.

Textual's POSIX drivers decode the terminal's input with a strict incremental UTF-8 decoder
(``getincrementaldecoder("utf-8")()`` inside the driver's input thread). One invalid byte raised
``UnicodeDecodeError`` there; Textual turned it into a Rich traceback, closed the chat and exited 0, dropping the
message being typed. :func:`install_lenient_decoder` makes that decoder replace invalid bytes with U+FFFD instead, so
the character shows in the prompt box (it can be deleted) and the chat goes on.
"""

from __future__ import annotations

import codecs
import functools

REPLACEMENT = "\ufffd"  # �


def lenient_incremental_decoder(encoding: str):
    """``codecs.getincrementaldecoder(encoding)`` with ``errors="replace"`` as the default: calling the result
    with no arguments (what Textual does) gives a decoder that turns invalid bytes into U+FFFD."""
    return functools.partial(codecs.getincrementaldecoder(encoding), errors="replace")


def install_lenient_decoder() -> bool:
    """Rebind the name ``getincrementaldecoder`` in Textual's Linux drivers' modules to
    :func:`lenient_incremental_decoder` (idempotent; nothing else in those modules uses the name).

    Returns False when those modules are unavailable (Windows, whose driver reads UTF-16 key events) or no longer
    decode through that name (a Textual release that changed it: tests/tui/test_tui_keyboard.py says so).
    """
    try:
        from textual.drivers import linux_driver, linux_inline_driver
    except Exception:
        return False
    done = True
    for mod in (linux_driver, linux_inline_driver):
        if getattr(mod, "getincrementaldecoder", None) in (codecs.getincrementaldecoder, lenient_incremental_decoder):
            mod.getincrementaldecoder = lenient_incremental_decoder
        else:
            done = False
    return done
