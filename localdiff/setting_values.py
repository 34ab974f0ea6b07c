"""One setting's value, from a TOML value, a flag or an environment string: its conversion to the setting's type and
its range check, with the one-line messages the user sees (``--threads: must be an integer in 1..8 ...``). The config
file, the environment, the command line and the Python API (:mod:`localdiff.inputs`, ``localdiff.load``) all check
values here (:mod:`localdiff.config` layers them)."""

from __future__ import annotations

import os
from typing import Any

from localdiff.errors import UsageError


def coerce(key: str, value: Any, typ: type, where: str) -> Any:
    """Convert ``value`` (a TOML value or an env/flag string) to ``typ`` and range-check it.

    Raises:
        UsageError: naming ``where`` (e.g. "LOCALDIFF_T_MIN" or "config.toml") when it does not fit.
    """
    if key == "threads":
        return check_threads(value, where if where.startswith(("-", "LOCALDIFF_")) else f"{where}: 'threads'")
    try:
        if typ is bool:
            if isinstance(value, bool):
                out = value
            elif str(value).strip().lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).strip().lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError
        elif typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(str(value).strip()) if isinstance(value, str) else int(value)
        elif typ is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if out != out or out in (float("inf"), float("-inf")):
                raise ValueError
        else:
            if not isinstance(value, str):
                raise ValueError
            out = value
    except (TypeError, ValueError):
        raise UsageError(f"{where}: invalid value {value!r} for '{key}' (expected {TYPE_WORDS[typ]})") from None
    _check_range(key, out, where)
    return out


#: what :func:`coerce` says a setting of each type must be (words, never Python's type names)
TYPE_WORDS = {int: "an integer", float: "a number", bool: "on or off", str: "text"}


def max_threads() -> int:
    """The most CPU threads a setting may ask for: 4 × ``os.cpu_count()`` (torch and llama.cpp start one OS thread
    each; 100,000 of them crashed the process with a segmentation fault, 30,000 with a libgomp error)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(value: Any, where: str) -> int:
    """``value`` (an int, or a flag / env / TOML value) as a thread count in 1 … :func:`max_threads`; every place that
    reads one (``--threads`` of gen / chat / serve / bench, ``LOCALDIFF_THREADS``, the config file,
    ``localdiff.load``) checks it here before torch or llama.cpp sees it.

    Raises:
        UsageError: ``"--threads: must be an integer in 1..8 (1 to 4 × the 2 CPUs here) (got 100000)"``.
    """
    n = os.cpu_count() or 1
    bad = UsageError(
        f"{where}: must be an integer in 1..{4 * n} (1 to 4 × the {n} CPU{'s' if n != 1 else ''} here) (got {value!r})"
    )
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        v = int(value.strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if not 1 <= v <= 4 * n:
        raise bad
    return v


def _check_range(key: str, v: Any, where: str) -> None:
    bad = None
    if key == "max_new_tokens" and v <= 0:
        bad = "must be a positive integer"
    elif key == "seed" and not 0 <= v < 2**63:
        bad = "must be in [0, 2**63)"
    elif key == "quant" and v not in QUANTS:
        bad = f"must be one of {', '.join(QUANTS)}"
    if bad:
        raise UsageError(f"{where}: '{key}' {bad} (got {v!r})")


#: weight quantizations a user may name (``--quant``, ``LOCALDIFF_QUANT``, ``quant =``, ``localdiff.load(quant=)``)
QUANTS = ("int8", "int4", "none")

#: compute dtypes a user may name: ``gen --dtype`` and ``LOCALDIFF_DTYPE`` take the same set (:func:`dtype_name`)
DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(value: str, where: str = "--dtype") -> str:
    """``value`` (any case, spaces around) as one of :data:`DTYPES`; ``where`` names the flag or variable.
    Raises UsageError ``--dtype='fp8': use one of float32, bfloat16, float16``."""
    name = str(value).strip().lower()
    if name not in DTYPES:
        raise UsageError(f"{where}={value!r}: use one of {', '.join(DTYPES)}")
    return name
