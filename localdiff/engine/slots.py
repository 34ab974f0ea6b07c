"""Runner of the slots family (ReFusion, arXiv 2512.13586): no cache between generations (the reordered K/V buffer
lives inside one generation); the loop, ReFusion's decoder per prompt row, and its events are
:mod:`localdiff.decoding.slots_loop`.
"""

from __future__ import annotations

from localdiff.decoding import slots_loop
from localdiff.engine import masked
from localdiff.errors import UsageError


def prepare(model) -> int:
    """The model's mask token id (the masked family's checks: :func:`localdiff.engine.masked.prepare`).

    Raises:
        CheckpointError: no mask_token_id in config.json, or pad id = mask id.
    """
    return masked.prepare(model)


def new_cache(model, device_budget_bytes: int | None = None) -> None:
    """None: ReFusion's reordered K/V lives inside one generation."""
    if device_budget_bytes is not None and device_budget_bytes < 0:
        raise UsageError("device budget must be ≥ 0 bytes")
    return None


def stream(model, req):
    """Decode every prompt row with ReFusion (:func:`localdiff.decoding.slots_loop.run`); yields StepEvent /
    CanvasDone (row 0) and Done.

    Raises:
        UsageError: a cache passed in (nothing is kept across generations).
    """
    if req.cache is not None:
        raise UsageError(
            "cache: ReFusion keeps no cache between generations (its reordered K/V cache lives inside one generation)"
        )
    yield from slots_loop.run(model.net, req)
