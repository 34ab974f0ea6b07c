"""A multi-trajectory answer (NAP's ``<think 1> … <think m> … <summary> …``, :mod:`localdiff.decoding.nap`) as
Markdown for the transcript: the think blocks side by side (a table, one column per block) when the widget is wide
enough, else one labelled section per block; the summary below. Any other answer comes back unchanged."""

from __future__ import annotations

from localdiff.decoding.nap import blocks_of

#: columns narrower than this are unreadable: below it the blocks are stacked
MIN_COLUMN = 22


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") or " "


def render(text: str, width: int) -> str:
    """Markdown of ``text`` for a transcript ``width`` cells wide (see the module docstring)."""
    blocks = blocks_of(text)
    thinks = [(label, body) for label, body in blocks if label.startswith("think")]
    if not thinks:
        return text
    rest = [(label, body) for label, body in blocks if not label.startswith("think")]
    if len(thinks) > 1 and width >= MIN_COLUMN * len(thinks):
        out = [
            "| " + " | ".join(f"**{label}**" for label, _ in thinks) + " |",
            "|" + "---|" * len(thinks),
            "| " + " | ".join(_cell(body) for _, body in thinks) + " |",
            "",
        ]
    else:
        out = [line for label, body in thinks for line in (f"**{label}** {_cell(body)}", "")]
    out += [line for label, body in rest for line in (f"**{label}** {_cell(body)}", "")]
    return "\n".join(out).rstrip() + "\n"
