"""Pasted text that holds escape sequences or control characters: shown as visible text, never acted on.

Two layers:

* :class:`PasteGuardParser` wraps Textual's xterm input parser. Textual collects a bracketed paste
  (``ESC [200~ … ESC [201~``) into one Paste event, but an ESC *inside* the pasted text starts its escape-sequence
  reader, which swallows the following characters and re-issues them as key presses (an Enter among them sends a
  half message). The guard replaces every ESC between the paste markers with "␛" before Textual's parser sees it,
  so the whole paste arrives as one Paste event.
* :func:`visible_controls` turns the remaining control characters of a paste (or of a message shown on screen) into
  their visible Unicode "control pictures" (``\\x07`` → "␇", ESC → "␛"); newlines and tabs stay.

A paste never sends: only the Enter key does (see ``widgets/prompt.py``).
"""

from __future__ import annotations

from localdiff.safetext import visible

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
ESC_PICTURE = "\u241b"  # ␛


def visible_controls(text: str) -> str:
    """Pasted / typed text for display: CR and CRLF become newlines, then the one sanitizer
    (:func:`localdiff.safetext.visible`) makes every other control character visible."""
    return visible(text.replace("\r\n", "\n").replace("\r", "\n"))


class PasteGuard:
    """Stateful filter over the raw input text: ESC inside a bracketed paste becomes "␛".

    Outside a paste the input passes unchanged (so a lone Esc key is never delayed). Inside one, a tail that could
    be the start of the end marker is held back until the next chunk decides it. ``filter("")`` (end of input)
    flushes what is held.
    """

    def __init__(self) -> None:
        self.in_paste = False
        self._held = ""
        self._recent = ""  # the last characters passed outside a paste (a start marker split across chunks)

    def filter(self, data: str) -> str:
        """Return ``data`` with ESC inside pastes replaced; call with every chunk in order."""
        text, self._held = self._held + data, ""
        out: list[str] = []
        i = 0
        while i < len(text):
            if not self.in_paste:
                window = self._recent + text[i:]
                j = window.find(PASTE_START)
                if j < 0:
                    out.append(text[i:])
                    self._recent = (self._recent + text[i:])[-(len(PASTE_START) - 1) :]
                    break
                end = j + len(PASTE_START) - len(self._recent)  # index in text[i:] just after the marker
                out.append(text[i : i + end])
                i += end
                self._recent = ""
                self.in_paste = True
            else:
                j = text.find(PASTE_END, i)
                if j < 0:
                    chunk = text[i:]
                    keep = _marker_prefix_len(chunk, PASTE_END) if data else 0
                    body, self._held = chunk[: len(chunk) - keep], chunk[len(chunk) - keep :]
                    out.append(body.replace("\x1b", ESC_PICTURE))
                    break
                out.append(text[i:j].replace("\x1b", ESC_PICTURE) + PASTE_END)
                i = j + len(PASTE_END)
                self.in_paste = False
        return "".join(out)


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def guarded_parser_class():
    """A subclass of Textual's ``XTermParser`` whose ``feed`` runs the input through a :class:`PasteGuard`."""
    from textual._xterm_parser import XTermParser

    class PasteGuardParser(XTermParser):
        """Textual's xterm parser with ESC inside bracketed pastes made visible (see the module docstring)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._guard = PasteGuard()

        def feed(self, data: str):
            text = self._guard.filter(data)
            if data and not text:  # all held back: feeding "" would tell the parser the input ended
                return []
            return super().feed(text)

    return PasteGuardParser


def install_paste_guard() -> bool:
    """Make Textual's POSIX drivers build their input parser from :func:`guarded_parser_class` (idempotent).

    Textual creates the parser inside the driver's input thread from the module-level name ``XTermParser``; this
    rebinds that name in the Linux drivers' modules only. Returns False when those modules are unavailable (Windows).
    """
    try:
        from textual.drivers import linux_driver, linux_inline_driver
    except Exception:
        return False
    cls = guarded_parser_class()
    for mod in (linux_driver, linux_inline_driver):
        if getattr(mod.XTermParser, "__name__", "") != "PasteGuardParser":
            mod.XTermParser = cls
    return True
