"""Runner of the block family (SDAR, SDAR-MoE, Tiny-A2D BD3LM, Fast-dLLM v2; LLaDA2.x builds on it): the exact block
KV cache (``localdiff.cache.kv.KVCache``: device budget, host offload) reused across chat turns, the generic block
loop (:mod:`localdiff.decoding.loop`) with the family's decoder policy (the class its declaration names,
:func:`localdiff.decoding.options.policy_class`) — or Fast-dLLM v2's own loop (:mod:`localdiff.decoding.fastdllm_v2`:
token shift, AR first token).

Blocks sit at absolute positions (block k = positions k·B .. k·B + B − 1, as upstream SDAR / Fast-dLLM v2 / dllm
align them). The cache holds whole blocks only: the prompt's complete blocks are prefilled (fused with the first
denoising step); the prompt's tail — ``T mod B`` tokens — opens the first canvas before its masks (the loop's
``lead``) and is prefilled with that block once it is final. A batch with left padding is padded further on the
left to a whole number of blocks (padding occupies positions, as in the canvas family), so no canvas holds padding.
"""

from __future__ import annotations

import torch

from localdiff.cache.kv import KVCache
from localdiff.decoding import fastdllm_v2, loop
from localdiff.decoding.options import DECODERS, policy_class
from localdiff.engine import masked
from localdiff.engine.canvas import common_prefix
from localdiff.errors import UsageError


def prepare(model) -> int:
    """The model's mask token id (``Model.mask_token_id``; the chat shows still-masked cells of the block being
    denoised).

    Raises:
        CheckpointError: no mask id, or pad id = mask id (padding would read as masks).
    """
    return masked.prepare(model, "block-diffusion")


def new_cache(model, device_budget_bytes: int | None = None) -> KVCache:
    """A fresh block KV cache (blocks of one block size; see ``localdiff.cache.kv``) — or the net's own when its
    K/V live elsewhere (a GGUF model: llama.cpp's memory, ``localdiff.backends.gguf_block``). Raises UsageError
    for a negative budget, or any budget for such a net (it has no device tier)."""
    if hasattr(model.net, "new_cache"):
        if device_budget_bytes is not None:
            raise UsageError("--kv-budget: a GGUF model's K/V live in llama.cpp's memory (no device budget)")
        return model.net.new_cache()
    return KVCache(**model.net.cache_layout(), device_budget_bytes=device_budget_bytes)


def split_prompt(ids: torch.Tensor, mask, block: int, pad: int):
    """(ids, mask) of a left-padded batch → (prompt ids LongTensor[B, T'], mask or None, tail length t): T' = T when
    nothing is padding, else T rounded up to whole blocks with extra left padding (then t = 0)."""
    if mask is None:
        return ids, None, ids.shape[1] % block
    extra = (-ids.shape[1]) % block
    if extra:
        ids = torch.cat([torch.full((ids.shape[0], extra), pad, dtype=ids.dtype, device=ids.device), ids], 1)
        mask = torch.cat([torch.zeros(mask.shape[0], extra, dtype=torch.bool, device=mask.device), mask], 1)
    return ids, mask, 0


def stream(model, req):
    """Prefill the prompt's whole blocks (only what a reused cache does not hold), then denoise block by block;
    yields the loop's events.

    Raises:
        UsageError: cache reuse with a batch; a decoder this family's runner does not know; Fast-dLLM v2's
            ``small_block_size`` not dividing the block size.
    """
    cfg, net = model.config, model.net
    options = req.options
    v2 = options.POLICY == "fast_dllm_v2"
    if v2 and cfg.block_size % options.small_block_size:
        raise UsageError(
            f"small_block_size: must divide the model's block size {cfg.block_size} (got {options.small_block_size})"
        )
    if v2 and options.use_block_cache and not hasattr(net, "denoise_capture"):
        raise UsageError(
            "use_block_cache: not on a GGUF model (llama.cpp cannot rewrite cells inside a block); "
            "leave it off (the exact block cache is used)"
        )
    if not v2 and (DECODERS[options.POLICY].family != "block" or not DECODERS[options.POLICY].policy):
        raise UsageError(f"the {options.POLICY} decoder does not run on block-diffusion models")
    blk = cfg.block_size
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    ids, mask, tail = split_prompt(req.ids, req.mask, blk, pad)
    whole = ids.shape[1] - tail
    cache, start = req.cache, 0
    if cache is None:
        cache = new_cache(model)
    elif len(req.rows) == 1 and getattr(cache, "seq_len", 0):
        held = cache.token_ids[0] if cache.token_ids else []
        start = min(common_prefix(held, ids[0].tolist()), whole) // blk * blk
        if v2 and not tail and start >= whole:  # Fast-dLLM v2 needs the last prompt block's logits
            start = max(whole - blk, 0)
        if not cache.truncate(start):
            cache.reset()
            start = 0
        req.stats.prefill_tokens_reused = start
    elif getattr(cache, "seq_len", 0):
        raise UsageError("cache reuse works for a single prompt; pass cache=None for batches")
    todo = ids[:, start:whole]
    todo_mask = None if mask is None else mask[:, start:whole]
    if v2:
        yield from fastdllm_v2.run(net, req, cache, (todo, todo_mask), ids[:, whole:])
        return
    first = torch.full((ids.shape[0], blk), model.mask_token_id, dtype=torch.long, device=ids.device)
    first[:, :tail] = ids[:, whole:]
    cls = policy_class(options.POLICY)  # a class ``(options, batch, block, mask_id, device, generator)``
    context = {"max_new_tokens": req.max_new_tokens, "eos_ids": model.eos_token_ids} if cls.TAKES_BUDGET else {}
    policy = cls(options, ids.shape[0], blk, model.mask_token_id, model.device, req.generator, **context)
    yield from loop.run(net, policy, req, cache, prefill=(todo, todo_mask), start_canvas=first, lead=tail)
