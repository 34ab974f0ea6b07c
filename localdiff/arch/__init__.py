"""Architecture registry: ``model_type`` (config.json) → module under ``localdiff/arch`` (imported lazily).

Each module exposes ``MODEL_TYPE``, a config class with ``from_dict``, a model class, ``checkpoint_names(local)``
and ``is_skipped_checkpoint_tensor(name)``.
"""
from __future__ import annotations

import importlib

REGISTRY = {"diffusion_gemma": "localdiff.arch.diffusion_gemma"}


def get_arch(model_type: str):
    """Return the architecture module for ``model_type``. Raises KeyError for unknown types."""
    if model_type not in REGISTRY:
        raise KeyError(model_type)
    return importlib.import_module(REGISTRY[model_type])


def model_and_config_classes(model_type: str):
    """(model class, config class) of ``model_type``."""
    mod = get_arch(model_type)
    if model_type == "diffusion_gemma":
        return mod.DiffusionGemma, mod.DiffusionGemmaConfig
    raise KeyError(model_type)
