"""The command line before argparse sees it: a negative number given as a flag's value joined to its flag; the
line for a name too long for the file system."""

from __future__ import annotations

import argparse
import os


def _value_flags(build_parser) -> set[str]:
    """Every option string of ``localdiff`` and ``localdiff bench`` that takes one value (not a switch)."""
    from localdiff.bench.args import build_parser as bench_parser

    flags, todo = set(), [build_parser(), bench_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:  # argparse keeps its options here (no public accessor)
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
            elif action.option_strings and action.nargs is None:
                flags.update(action.option_strings)
    return flags


def _negative_number(text: str) -> bool:
    """ "-1", "-0.5", "-1e3", "-inf", "-nan", "-1GiB", "-1:0.5": a value that starts with "-" and reads as a number
    (or a size or pair that starts with one), never an option name."""
    if not text.startswith("-") or text.startswith("--"):
        return False
    if text[1:2].isdigit() or (text[1:2] == "." and text[2:3].isdigit()):
        return True
    try:
        float(text.split(":", 1)[0])
    except ValueError:
        return False
    return True


def join_negative_values(argv: list[str], build_parser) -> list[str]:
    """``--entropy-bound -inf`` → ``--entropy-bound=-inf`` (and ``--kv-budget -1GiB``, ``--seed -1e3``, ``-n -5``):
    argparse takes a value starting with "-" that is not a plain number for an option and reports "expected one
    argument"; joined, the option's own check names the real problem (a range error, or the value is used)."""
    out, i, flags = [], 0, None
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        if a.startswith("-") and i + 1 < len(argv) and _negative_number(argv[i + 1]):
            flags = _value_flags(build_parser) if flags is None else flags
            if a in flags:
                out.append(f"{a}={argv[i + 1]}")
                i += 2
                continue
        out.append(a)
        i += 1
    return out


def name_too_long(name) -> str:
    """The line for a name the file system cannot hold (ENAMETOOLONG: a part over 255 bytes, or over 4096 in
    all), with the name cut short (it may be thousands of characters)."""
    text = os.fsdecode(name) if isinstance(name, (str, bytes)) else ""
    shown = repr(text if len(text) <= 60 else text[:40] + "…" + text[-12:])
    return (
        f"name too long for a file or folder: {shown} ({len(text)} characters; the file system allows 255 "
        "bytes per part of a path): give a shorter model name or path"
    )
