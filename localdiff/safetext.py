"""One sanitizer for text that reaches a terminal: model output (``gen`` on stdout, the chat transcript) and
model-provided strings (``list`` / ``show`` fields, error messages quoting a checkpoint's files).

A model (or a downloaded checkpoint's tokenizer / config) can produce any code point. Written raw to a terminal,
C0 / C1 control characters are commands: ``ESC ] 0 ; … BEL`` retitles the window (OSC), ``ESC [ … m`` recolours,
``BS`` / ``CR`` overwrite what was printed, ``CSI`` (U+009B) starts a sequence on terminals that read C1 codes.
:func:`visible` replaces every C0 control except ``\\n`` and ``\\t`` — and DEL and every C1 control — with a visible
stand-in, character by character (so sanitizing fragments and joining them equals sanitizing the whole):

- C0 (U+0000–U+001F) → the Unicode "control pictures" (U+2400 + code: ESC → ␛, BEL → ␇, BS → ␈, CR → ␍);
- DEL (U+007F) → ␡;
- C1 (U+0080–U+009F) → the text ``<U+009B>`` (no control picture exists for them);
- the bidirectional embedding / override / isolate controls (U+202A–U+202E, U+2066–U+2069) → ``<U+202E>`` too:
  the terminal does not run them, but they reorder what it shows ("Trojan Source", CVE-2021-42574), so text
  printed after a model's U+202E reads backwards. The marks U+200E / U+200F stay (ordinary right-to-left text).

``--json`` output is escaped instead (:func:`json_dumps`: ``\\u001b`` etc., C1, DEL and the bidi controls included).
"""

from __future__ import annotations

import json
import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_JSON_EXTRA = re.compile(r"[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # json.dumps escapes U+0000–U+001F


def _picture(m: re.Match) -> str:
    c = ord(m.group())
    if c < 0x20:
        return chr(0x2400 + c)
    if c == 0x7F:
        return "\u2421"
    return f"<U+{c:04X}>"


def visible(text: str) -> str:
    """``text`` with C0 controls other than ``\\n`` / ``\\t``, DEL, C1 and bidi controls replaced by visible stand-ins
    (see the module docstring). Other characters, newlines and tabs are kept. Non-str input is ``str()``-ed."""
    if not isinstance(text, str):
        text = str(text)
    return _CONTROL.sub(_picture, text)


def has_controls(text: str) -> bool:
    """True when :func:`visible` would change ``text``."""
    return bool(_CONTROL.search(text))


def json_dumps(obj, **kw) -> str:
    """``json.dumps(obj, ensure_ascii=False, **kw)`` with DEL, C1 and bidi controls escaped as ``\\uXXXX`` too, so the
    text is safe on a terminal and still the same JSON value (they can only occur inside strings)."""
    kw.setdefault("ensure_ascii", False)
    return json_escape(json.dumps(obj, **kw))


def json_escape(text: str) -> str:
    """JSON text (``ensure_ascii=False``) with DEL, C1 and bidi controls escaped as ``\\uXXXX`` (JSON escapes C0
    itself): the same JSON value, safe to print. Returns ``text`` itself when there is none (one regex search)."""
    if _JSON_EXTRA.search(text) is None:
        return text
    return _JSON_EXTRA.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
