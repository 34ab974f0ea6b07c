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
    "llada": ArchEntry("localdiff.arch.llada", "localdiff.arch.masked_spec", "masked"),
    "lladamoe": ArchEntry("localdiff.arch.masked", "localdiff.arch.masked_spec", "masked"),
    "Dream": ArchEntry("localdiff.arch.masked", "localdiff.arch.masked_spec", "masked"),
    "a2d-qwen3": ArchEntry("localdiff.arch.masked", "localdiff.arch.masked_spec", "masked"),
    "llada2_moe": ArchEntry("localdiff.arch.llada2_moe", "localdiff.arch.llada2_spec", "block"),
    "sdar": ArchEntry("localdiff.arch.block", "localdiff.arch.block_spec", "block"),
    "sdar_moe": ArchEntry("localdiff.arch.block", "localdiff.arch.block_spec", "block"),
    "Fast_dLLM_Qwen": ArchEntry("localdiff.arch.block", "localdiff.arch.block_spec", "block"),
    "a2d-qwen3-bd3lm": ArchEntry("localdiff.arch.block", "localdiff.arch.block_spec", "block"),
    "refusion": ArchEntry("localdiff.arch.refusion", "localdiff.arch.refusion_spec", "slots"),
    "qwen3": ArchEntry("localdiff.arch.causal", "localdiff.arch.causal_spec", "causal"),
    "llama": ArchEntry("localdiff.arch.causal", "localdiff.arch.causal_spec", "causal"),
    "dflash": ArchEntry("localdiff.arch.dflash", "localdiff.arch.dflash_spec", "drafts"),
}

#: (model_type, architecture) → registry key, for checkpoints whose model_type names another architecture:
#: LLaDA-MoE's Hub config.json says "llada" with ``LLaDAMoEModelLM``; None matches any architecture.
ALIASES: dict[tuple[str, str | None], str] = {
    ("llada", "LLaDAMoEModelLM"): "lladamoe",
    ("dream", None): "Dream",
    ("qwen3", "DFlashDraftModel"): "dflash",  # DFlash drafts ship a Qwen3 config.json
    ("llama", "DFlashDraftModel"): "dflash",
    ("qwen3", "DFlash2DraftModel"): "dflash",  # refused by its spec with a clear message
}

#: (model_type, config.json key) → registry key, for checkpoints that share another architecture's model_type and
#: differ by a key (set, not null): dllm's Tiny-A2D BD3LM Qwen3 says "a2d-qwen3" like the masked A2D model and
#: carries a ``block_size``; ReFusion's config.json is a Qwen3 one ("qwen3") plus ``mask_token_id``
FIELD_ALIASES: dict[tuple[str, str], str] = {
    ("a2d-qwen3", "block_size"): "a2d-qwen3-bd3lm",
    ("qwen3", "mask_token_id"): "refusion",
}


def _resolve(mt, architectures) -> str | None:
    for arch in list(architectures or []) + [None]:
        if (mt, arch) in ALIASES:
            return ALIASES[(mt, arch)]
    return mt


def supported() -> list[str]:
    """The registered model_types, sorted."""
    return sorted(REGISTRY)


def canonical_type(config: dict | str) -> str | None:
    """The registry key of a config.json dict (or a model_type string) — the one place model_type aliases are
    resolved: :data:`ALIASES` (by ``architectures``), then :data:`FIELD_ALIASES` (by a key the config sets), then a
    nested ``text_config``'s model_type; a type the registry does not know comes back unchanged (specs call this
    too: ``masked_spec`` sees "lladamoe" for LLaDA-MoE's "llada", ``block_spec`` "a2d-qwen3-bd3lm")."""
    if isinstance(config, str):
        return _resolve(config, ())
    mt = _resolve(config.get("model_type"), config.get("architectures"))
    mt = next((key for (t, f), key in FIELD_ALIASES.items() if t == mt and config.get(f) is not None), mt)
    if mt not in REGISTRY:  # a nested text_config may name it
        mt = (config.get("text_config") or {}).get("model_type", mt)
    return mt


def entry_for(config: dict | str) -> ArchEntry:
    """The registry entry of a config.json dict (or a model_type string), after :func:`canonical_type`.

    Raises:
        KeyError: unknown model_type; its message lists the supported ones.
    """
    mt = canonical_type(config)
    if mt not in REGISTRY:
        raise KeyError(f"unknown model_type {mt!r} (supported: {', '.join(supported())})")
    return REGISTRY[mt]


def get_spec(config: dict | str):
    """The torch-free spec module of a config (see :class:`localdiff.arch.base.ArchSpec`). Raises KeyError."""
    return importlib.import_module(entry_for(config).spec)


def get_arch(config: dict | str):
    """The model module of a config or model_type (imports torch). Raises KeyError for unknown types."""
    return importlib.import_module(entry_for(config).model)
