"""DiffusionGemma's self-conditioning soft embedding ``softmax(sc) · E`` — exact, or from the top-k of each
distribution (opt-in approximation, issue #24).

Exact (the reference, transformers 5.23 ``DiffusionGemmaModel``: ``softmax(sc, fp32).to(E.dtype) @ E``): a
[C, V] × [V, H] product per step — as many FLOPs as the LM head, 15.6 % of the flagship's step — plus a softmax over
the vocabulary. Top-k: ``softmax(topk(sc, k).values) · E[topk(sc, k).indices]`` — the distribution renormalised
over its k largest logits (the dropped tail's mass is the error), C·k·H multiply-adds instead of C·V·H. Measured
error and eval accuracy per k: ``localdiff bench --only approx``. Never used unless asked (``sc_topk``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Probabilities(NamedTuple):
    """Self-conditioning input given as the distribution itself instead of logits: ``probs`` Tensor[B, C, V] =
    ``softmax(previous step's temperature-scaled logits)``, already computed by the sampler (the 16-bit fast path
    of :class:`localdiff.decoding.canvas_eb.CanvasEB`), so the model skips its own softmax pass. On the exact path
    ``probs`` is the sampler's ``softmax(proc, fp32)`` — the very op the model would run on the same tensor, so the
    result is bit-identical — and ``logits`` the logits themselves, which the top-k approximation reads."""

    probs: torch.Tensor
    logits: torch.Tensor | None = None


class RawLogits(NamedTuple):
    """A denoising step's logits as the LM head made them, before soft-capping and any cast (asked for with
    ``denoise(..., raw_logits=True)`` by the 16-bit fast path, whose fused vocab pass
    :mod:`localdiff.decoding.vocab_pass` soft-caps while it reads them once).

    values: Tensor[..., V] in the compute dtype (the fp32 logits are ``softcap · tanh(values.float() / softcap)``);
    softcap: the final-logit soft-cap, or None for none.
    """

    values: torch.Tensor
    softcap: float | None


def raw_head(h: torch.Tensor, weight: torch.Tensor, softcap: float | None, buffers: dict) -> RawLogits:
    """The LM head ``h · weightᵀ`` (h Tensor[..., H], weight Tensor[V, H], same dtype) as :class:`RawLogits`, written
    into a buffer of ``buffers`` reused per shape (a fresh 16 MiB output per step costs its page faults: ~2 ms of a
    15 ms head at [256, 448] × [448, 32768] bf16 here). Bit-identical to ``F.linear(h, weight)`` (tests); the values
    are valid until the next call with the same ``buffers`` — the fast path reads them within their step."""
    key = (tuple(h.shape[:-1]), weight.shape[0], h.dtype, h.device)
    out = buffers.get(key)
    if out is None:
        buffers.clear()
        out = buffers[key] = torch.empty(*key[0], key[1], dtype=h.dtype, device=h.device)
    torch.mm(h.reshape(-1, h.shape[-1]), weight.t(), out=out.view(-1, key[1]))
    return RawLogits(out, softcap)


def soft_embedding(sc_logits, weight: torch.Tensor, topk: int | None = None) -> torch.Tensor:
    """Soft embedding of self-conditioning logits.

    Args:
        sc_logits: FloatTensor[B, C, V] (the previous step's temperature-scaled logits), or :class:`Probabilities`.
        weight: the embedding matrix Tensor[V, H] (its dtype is the compute dtype), or a quantized table with
            ``dtype``, ``weighted_sum(p)`` (= p @ table) and ``__call__(ids)`` (row lookup), e.g.
            ``localdiff.quantize.embedding.QuantEmbedding`` (the same computation on the dequantized table).
        topk: None = exact; k = only the k largest logits of each position (renormalised).
    Returns:
        Tensor[B, C, H] in weight's dtype (not yet multiplied by the embedding scale).
    """
    if isinstance(sc_logits, Probabilities):
        probs = sc_logits.probs
        if topk is None or topk >= probs.shape[-1]:
            return _weighted(probs.to(weight.dtype), weight)
        # the top-k of the distribution renormalised, as below (of the logits where they came along)
        sc_logits = sc_logits.logits if sc_logits.logits is not None else probs.float().log()
    if topk is None or topk >= sc_logits.shape[-1]:
        probs = torch.softmax(sc_logits, dim=-1, dtype=torch.float32).to(weight.dtype)
        # F.linear(p, Eᵀ): the layout that is fast in bf16 on every CPU measured (torch.matmul(p, E) took 35 s per
        # step in bf16 on an AVX2-only CPU, this 1 s); bit-identical to p @ E in fp32 and bf16 here
        return _weighted(probs, weight)
    vals, idx = sc_logits.topk(topk, dim=-1)
    p = torch.softmax(vals, dim=-1, dtype=torch.float32).to(weight.dtype)  # [B, C, k]
    b, c, k = idx.shape
    ids = idx.reshape(b * c, k)
    rows = F.embedding(ids, weight) if isinstance(weight, torch.Tensor) else weight(ids)  # [B·C, k, H]
    return torch.bmm(p.reshape(b * c, 1, k), rows).reshape(b, c, -1)


def _weighted(p: torch.Tensor, weight) -> torch.Tensor:
    """p Tensor[..., V] @ the table Tensor[V, H] (or a quantized table's ``weighted_sum``)."""
    return F.linear(p, weight.t()) if isinstance(weight, torch.Tensor) else weight.weighted_sum(p)
