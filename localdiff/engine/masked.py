"""Runner of the masked family (LLaDA, LLaDA-MoE, Dream, DiffuCoder, A2D Qwen3): no cache between generations (the
approximate caches are the ``kv_cache`` option, inside one generation), :mod:`localdiff.decoding.masked_loop` with
the LLaDA or Dream policy."""
from __future__ import annotations

import torch

from localdiff.decoding import masked_loop
from localdiff.decoding.dream import Dream
from localdiff.decoding.llada import LLaDA
from localdiff.decoding.nap import NAP
from localdiff.errors import CheckpointError, UsageError

POLICY_CLASSES = {"llada": LLaDA, "dream": Dream, "nap": NAP}


def prepare(model) -> None:
    """Sets ``model.mask_token_id``.

    Raises:
        CheckpointError: no mask_token_id in config.json, or pad id = mask id (padding would read as masks).
    """
    model.mask_token_id = getattr(model.config, "mask_token_id", None)
    if model.mask_token_id is None:
        raise CheckpointError(f"{model.path}: config.json has no mask_token_id (a masked-diffusion model needs it)")
    if model.pad_token_id == model.mask_token_id:
        raise CheckpointError(f"{model.path}: pad_token_id equals mask_token_id ({model.mask_token_id}); padding "
                              "would read as masks")


def new_cache(model, device_budget_bytes: int | None = None) -> None:
    """None: a masked-diffusion model keeps no cache between generations."""
    return None


def stream(model, req):
    """Masks after the (left-padded) prompt, decoded block by block; yields the loop's events.

    Raises:
        UsageError: a cache passed in (nothing to reuse across generations).
    """
    if req.cache is not None:
        raise UsageError("cache: a masked-diffusion model keeps no cache between generations (its "
                         "approximate caches are the kv_cache option: none, prefix, dual)")
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
    yield from masked_loop.run(model.net, policy, ids, mask, n_new, options.block_length,
                               options.steps, options.kv_cache, model.mask_token_id, model.eos_token_ids,
                               model.pad_token_id, emit_steps=req.emit_steps, decode=req.decode, stats=req.stats)
