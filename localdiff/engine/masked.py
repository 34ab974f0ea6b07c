"""Runner of the masked family (LLaDA, LLaDA-MoE, Dream, DiffuCoder, A2D Qwen3): no cache between generations (the
approximate caches are the ``kv_cache`` option, inside one generation), :mod:`localdiff.decoding.masked_loop` with
the decoder's policy (LLaDA's, Dream's, NAP's or any masked-family declaration's:
:func:`localdiff.decoding.options.policy_class`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from localdiff.cache.window import WindowStore
from localdiff.decoding import masked_loop
from localdiff.decoding.nap import NAP
from localdiff.decoding.options import policy_class
from localdiff.errors import CheckpointError, UsageError


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
        raise CheckpointError(f"{model.path}: pad_token_id equals mask_token_id ({mask}); padding would read as masks")
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
        raise UsageError(
            "cache: a masked-diffusion model keeps no cache between generations (its "
            "approximate caches are the kv_cache option: none, prefix, dual; pass "
            "model.new_cache(device_budget_bytes=...) to give them a device budget)"
        )
    ids, mask, options = req.ids, req.mask, req.options
    if mask is not None:  # left padding must not read as masks
        pad = (
            model.pad_token_id
            if model.pad_token_id is not None
            else next(t for t in (*model.eos_token_ids, 0, 1) if t != model.mask_token_id)
        )
        ids = torch.where(mask, ids, torch.full_like(ids, pad))
    n_new = req.max_new_tokens
    if options.POLICY == "nap":  # the canvas is NAP's template (max_new_tokens does not apply)
        encode = None if model.tokenizer is None else model.tokenizer.encode
        policy = NAP(options, req.generator, model.mask_token_id, encode, model.eos_token_ids)
        n_new = len(policy.template)
        if ids.shape[1] + n_new > model.config.max_position_embeddings:
            raise UsageError(
                f"prompt ({ids.shape[1]} tokens) + the multi-trajectory canvas ({n_new} tokens) exceeds "
                f"the model's context ({model.config.max_position_embeddings} tokens)"
            )
    else:
        policy = policy_class(options.POLICY)(options, req.generator, model.mask_token_id)
        policy.length = ids.shape[1] + n_new  # LLaDA's noise="upstream" draws over the whole sequence
        if getattr(options, "logits_eos_inf", False) or getattr(options, "confidence_eos_eot_inf", False):
            policy.eos_id, policy.eot_id = eos_and_eot(model, options.confidence_eos_eot_inf)
    try:
        yield from masked_loop.run(model.net, policy, replace(req, ids=ids, max_new_tokens=n_new), store=req.cache)
    finally:
        if req.cache is not None:
            req.cache.release()


def eos_and_eot(model, need_eot: bool) -> tuple[int | None, int | None]:
    """The ids LLaDA's ``logits_eos_inf`` / ``confidence_eos_eot_inf`` name (its generate.py hard-codes LLaDA-8B's
    126081 and 126348): EOS = config.json's (first) ``eos_token_id``; EoT = the tokenizer's ``<|eot_id|>``, else the
    model's first other EOS id (a generation_config list), else None.

    Raises:
        UsageError: ``need_eot`` and the model has no EoT token.
    """
    eos_cfg = getattr(model.config, "eos_token_id", None)
    eos_list = list(eos_cfg) if isinstance(eos_cfg, (list, tuple)) else [eos_cfg]
    eos = next((int(e) for e in eos_list if e is not None), model.eos_token_ids[0] if model.eos_token_ids else None)
    eot = model.tokenizer.token_id("<|eot_id|>") if hasattr(model.tokenizer, "token_id") else None
    if eot is None:
        eot = next((e for e in model.eos_token_ids if e != eos), None)
    if need_eot and eot is None:
        raise UsageError(
            "confidence_eos_eot_inf: this model has no end-of-turn token (no <|eot_id|> in its "
            "tokenizer, no second EOS id)"
        )
    return eos, eot
