"""Architecture registry: ``model_type`` (config.json) → its spec and model modules (imported lazily).

Adding an architecture is one entry here plus its files (docs/ARCHITECTURE.md); see :mod:`localdiff.arch.base` for
the contract. ``architectures`` disambiguates when one ``model_type`` covers two architectures.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchEntry:
    """``model``: module with ``MODEL_CLASS``, ``checkpoint_names`` and ``keeps_checkpoint_dtype``; ``spec``: the
    torch-free module with ``parse_config`` / ``tensor_shapes`` / ``layer_geometry``; ``family``: decoding family."""

    model: str
    spec: str
    family: str


REGISTRY: dict[str, ArchEntry] = {
    "diffusion_gemma": ArchEntry("localdiff.arch.diffusion_gemma", "localdiff.arch.diffusion_gemma_spec", "canvas"),
}


def supported() -> list[str]:
    """The registered model_types, sorted."""
    return sorted(REGISTRY)


def entry_for(config: dict | str) -> ArchEntry:
    """The registry entry of a config.json dict (or a model_type string).

    Raises:
        KeyError: unknown model_type; its message lists the supported ones.
    """
    mt = config if isinstance(config, str) else config.get("model_type")
    if not isinstance(config, str) and mt not in REGISTRY:   # a nested text_config may name it
        mt = (config.get("text_config") or {}).get("model_type", mt)
    if mt not in REGISTRY:
        raise KeyError(f"unknown model_type {mt!r} (supported: {', '.join(supported())})")
    return REGISTRY[mt]


def get_spec(config: dict | str):
    """The torch-free spec module of a config (see :class:`localdiff.arch.base.ArchSpec`). Raises KeyError."""
    return importlib.import_module(entry_for(config).spec)


def get_arch(config: dict | str):
    """The model module of a config or model_type (imports torch). Raises KeyError for unknown types."""
    return importlib.import_module(entry_for(config).model)
