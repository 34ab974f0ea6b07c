"""Runner of the masked family (LLaDA, LLaDA-MoE, Dream, DiffuCoder, A2D Qwen3): no cache between generations (the
approximate caches are the ``kv_cache`` option, inside one generation), :mod:`localdiff.decoding.masked_loop` with
the LLaDA or Dream policy."""
from __future__ import annotations

from dataclasses import replace

import torch

from localdiff.cache.window import WindowStore
from localdiff.decoding import masked_loop
from localdiff.decoding.dream import Dream
from localdiff.decoding.llada import LLaDA
from localdiff.decoding.nap import NAP
from localdiff.errors import CheckpointError, UsageError

POLICY_CLASSES = {"llada": LLaDA, "dream": Dream, "nap": NAP}


def prepare(model, kind: str = "masked-diffusion") -> int:
    """The model's mask token id (``Model.mask_token_id``), checked (``kind`` names the family in the error; the
    block and slots families' runners use it too).

    Raises:
        CheckpointError: no mask_token_id in config.json, or pad id = mask id (padding would read as masks).
    """
    mask = getattr(model.config, "mask_token_id", None)
    if mask is None:
        raise CheckpointError(f"{model.path}: config.json has no mask_token_id (a {kind} model needs it)")
    if model.pad_token_id == mask:
        raise CheckpointError(f"{model.path}: pad_token_id equals mask_token_id ({mask}); padding would read as "
                              "masks")
    return mask


def new_cache(model, device_budget_bytes: int | None = None) -> WindowStore | None:
    """A masked-diffusion model keeps no K/V between generations; with a device budget, the
    :class:`~localdiff.cache.window.WindowStore` where the ``kv_cache`` prefix / dual K/V of each generation live
    (whole layers past the budget on the host tier). None for an unlimited budget.

    Raises:
        UsageError: a negative budget, or a budget for a net whose K/V live in its own memory (a GGUF model's
            llama.cpp context: ``kv_in_backend``).
    """
    if device_budget_bytes is not None and getattr(model.net, "kv_in_backend", False):
        raise UsageError("--kv-budget: a GGUF model's K/V live in llama.cpp's memory (no device budget)")
    return None if device_budget_bytes is None else WindowStore(model.device, device_budget_bytes)


def stream(model, req):
    """Masks after the (left-padded) prompt, decoded block by block; yields the loop's events.

    Raises:
        UsageError: a cache object other than this family's WindowStore (nothing is reused across generations).
    """
    if req.cache is not None and not isinstance(req.cache, WindowStore):
        raise UsageError("cache: a masked-diffusion model keeps no cache between generations (its "
                         "approximate caches are the kv_cache option: none, prefix, dual; pass "
                         "model.new_cache(device_budget_bytes=...) to give them a device budget)")
    ids, mask, options = req.ids, req.mask, req.options
    if mask is not None:   # left padding must not read as masks
        pad = model.pad_token_id if model.pad_token_id is not None else next(
            t for t in (*model.eos_token_ids, 0, 1) if t != model.mask_token_id)
        ids = torch.where(mask, ids, torch.full_like(ids, pad))
    n_new = req.max_new_tokens
    if options.POLICY == "nap":     # the canvas is NAP's template (max_new_tokens does not apply)
        encode = None if model.tokenizer is None else model.tokenizer.encode
        policy = NAP(options, req.generator, model.mask_token_id, encode, model.eos_token_ids)
        n_new = len(policy.template)
        if ids.shape[1] + n_new > model.config.max_position_embeddings:
            raise UsageError(f"prompt ({ids.shape[1]} tokens) + the multi-trajectory canvas ({n_new} tokens) exceeds "
                             f"the model's context ({model.config.max_position_embeddings} tokens)")
    else:
        policy = POLICY_CLASSES[options.POLICY](options, req.generator, model.mask_token_id)
        policy.length = ids.shape[1] + n_new          # LLaDA's noise="upstream" draws over the whole sequence
    try:
        yield from masked_loop.run(model.net, policy, replace(req, ids=ids, max_new_tokens=n_new), store=req.cache)
    finally:
        if req.cache is not None:
            req.cache.release()
