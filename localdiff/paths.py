"""Where the package's data lives: the model catalog (``models/``) and quantization recipes (``quant/``).

One resolver for both an editable / source checkout (the folders sit beside the package at the repo root) and a
built wheel (hatch force-includes them as ``localdiff/_data/models`` and ``localdiff/_data/quant``).
"""

from __future__ import annotations

import json
from pathlib import Path

from localdiff.errors import CheckpointError

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Return the folder of package data ``name`` ("models" or "quant").

    Raises:
        FileNotFoundError: neither the wheel location nor the source-checkout location exists.
    """
    for cand in (_PKG / "_data" / name, _PKG.parent / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"localdiff data folder '{name}' not found (looked in {_PKG / '_data'} and {_PKG.parent})")


def models_dir() -> Path:
    """The catalog and embedded-model folder (``models/``)."""
    return data_dir("models")


def quant_dir() -> Path:
    """The quantization-recipe folder (``quant/``)."""
    return data_dir("quant")


def read_json(path: Path) -> dict:
    """Parse a JSON file; raises CheckpointError naming it when missing or corrupt."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
