"""Byte sizes as users write them (``24GiB``, ``1.5GB``, ``512MiB``, ``0``) and as localdiff prints memory (binary
units), shared by the CLI, the KV-cache budget, the memory plan and the quantization recipes. Torch-free."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "p": 10**15,
    "pb": 10**15,
    "pib": 2**50,
}


def parse_size(text, error=ValueError) -> int:
    """``"2GiB"`` → 2·2³⁰, ``"1.5GB"`` → 1.5·10⁹, ``"512MiB"``, ``"0"``, or a non-negative number → int bytes.

    Raises:
        ``error`` (default ValueError) with a one-line message naming the text: not a size, negative, or over
        :data:`MAX_SIZE`.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text != text:  # NaN passes both range checks below
            raise error(f"not a size: {text!r} (examples: 24GiB, 16GB, 512MiB)")
        if text < 0:
            raise error(f"size must not be negative: {text}")
        if text > MAX_SIZE:
            raise error(f"size too large: {text} (at most 1024 PiB)")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise error(f"not a size: {text!r} (examples: 24GiB, 16GB, 512MiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n > MAX_SIZE:
        raise error(f"size too large: {text!r} (at most 1024 PiB)")
    return n


#: the largest size any flag, setting or recipe may state (1024 PiB = 2⁶⁰ bytes; larger ones printed as 10²⁹ TiB plans)
MAX_SIZE = 2**60


def format_size(n: int | float) -> str:
    """Bytes of memory in binary units, as ``--gpu-mem`` / ``--kv-budget`` take them: ``1.50 GiB``, ``336.00 KiB``,
    ``96 B`` (two decimals from KiB up)."""
    n = float(n)
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
