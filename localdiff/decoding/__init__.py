"""Composable sampler parts working on logits and ids only (docs/ARCHITECTURE.md, "The decoder contract"): canvas init and renoising,
temperature schedules, categorical draws, acceptance (entropy bound, confidence locking), Re-Noising correction,
stopping.

The names below load on first use (PEP 562), so importing a submodule that needs no torch — the option schema
(:mod:`localdiff.decoding.options`), read by ``list`` / ``show`` / ``config`` — does not import torch (~1 s)."""

from importlib import import_module

_WHERE = {
    "AcceptanceConfig": "acceptance",
    "accept": "acceptance",
    "token_entropy": "acceptance",
    "init_canvas": "canvas",
    "renoise": "canvas",
    "CorrectionConfig": "correction",
    "correct": "correction",
    "categorical": "draws",
    "linear_temperature": "schedules",
    "StableAndConfident": "stopping",
    "finalize_canvas": "stopping",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"localdiff.decoding.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'localdiff.decoding' has no attribute {name!r}")
