"""``Request``: one validated generation, as :class:`localdiff.engine.Model` hands it to a family runner. The
dataclass lives in :mod:`localdiff.decoding.request` (the loops take it; decoding never imports the engine)."""

from __future__ import annotations

from localdiff.decoding.request import Request

__all__ = ["Request"]
