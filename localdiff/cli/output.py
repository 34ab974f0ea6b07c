"""How the commands write to stdout: JSON, aligned tables and indented trees, with every name, label and path made
visible (:func:`localdiff.safetext.visible`: they come from the cache, config.json files and the user)."""

from __future__ import annotations

import json
import sys

from localdiff.safetext import visible


def print_json(obj) -> None:
    """``obj`` as indented JSON on stdout (values JSON does not know as their ``str``)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(rows: list[list[str]], header: list[str]) -> None:
    """``rows`` under ``header``, columns aligned (two spaces apart), trailing spaces cut."""
    rows = [[visible(c) for c in r] for r in rows]  # names, quant labels, paths come from the cache / config.json
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        sys.stdout.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def plain(v, unset: str = "none") -> str:
    """A value as a user reads (and TOML writes) it: ``true`` / ``false``, ``unset`` for None, "(none)" for an empty
    table or list — never Python's ``None`` / ``True`` / ``{}``."""
    if v is None:
        return unset
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list, tuple)) and not v:
        return "(none)"
    return str(v)


def print_tree(d: dict, indent: str, unset: str = "none") -> None:
    """``d`` as ``key: value`` lines, nested tables indented two more spaces (values as :func:`plain` writes them)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            sys.stdout.write(f"{indent}{visible(k)}:\n")
            print_tree(v, indent + "  ", unset)
        else:
            sys.stdout.write(f"{indent}{visible(k)}: {visible(plain(v, unset))}\n")
