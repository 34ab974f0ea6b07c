"""Runner of the canvas family (DiffusionGemma): exact block KV cache reused across chat turns, the generic loop
(:mod:`localdiff.decoding.loop`) with the canvas policy (:class:`localdiff.decoding.canvas_eb.CanvasEB`)."""

from __future__ import annotations

from localdiff.cache.kv import KVCache
from localdiff.decoding import loop
from localdiff.decoding.canvas_reuse import policy_class
from localdiff.errors import UsageError


def prepare(model) -> None:
    """Nothing to check beyond the config parser; no mask token (the canvas is noised with uniform tokens)."""


def new_cache(model, device_budget_bytes: int | None = None) -> KVCache:
    """A fresh block KV cache (blocks of one canvas; sliding layers keep one canvas of slack for chat prefix reuse).
    Raises UsageError for a negative budget (``localdiff.cache.kv``)."""
    return KVCache(**model.net.cache_layout(), device_budget_bytes=device_budget_bytes)


def stream(model, req):
    """Prefill (only what the reused cache does not hold) then denoise canvas by canvas; yields the loop's events.

    Raises:
        UsageError: cache reuse with a batch.
    """
    cache, rows, ids = req.cache, req.rows, req.ids
    todo, todo_mask = ids, req.mask
    if cache is None:
        cache = new_cache(model)
    elif len(rows) == 1 and getattr(cache, "seq_len", 0):
        lcp = common_prefix(cache.token_ids[0] if cache.token_ids else [], rows[0])
        lcp = min(lcp, len(rows[0]) - 1) if lcp == len(rows[0]) else lcp
        if not cache.truncate(lcp):
            cache.reset()
            lcp = 0
        todo, todo_mask = ids[:, lcp:], None
        req.stats.prefill_tokens_reused = lcp
    elif getattr(cache, "seq_len", 0):
        raise UsageError("cache reuse works for a single prompt; pass cache=None for batches")
    cfg = model.config
    prec = model.precision  # the fast sampler in fp32 where bf16 would be the default
    fast = True if prec is not None and prec.sampler == "fast" else None
    policy = policy_class(req.options)(
        req.options,
        ids.shape[0],
        cfg.canvas_length,
        cfg.vocab_size,
        model.device,
        req.generator,
        _float_dtype(model.net.embed_tokens),
        fast=fast,
    )
    yield from loop.run(model.net, policy, req, cache, prefill=(todo, todo_mask), start_canvas=req.start_canvas)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _float_dtype(emb):
    """The model's float dtype from its token embedding: an nn.Embedding's weight dtype, or a quantized table's
    ``dtype`` (localdiff.quantize.embedding.QuantEmbedding: its weight holds codes)."""
    return emb.weight.dtype if emb.weight.is_floating_point() else emb.dtype
