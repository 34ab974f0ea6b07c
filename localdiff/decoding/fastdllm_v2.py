"""Decoder ``fast_dllm_v2``: Fast-dLLM v2's block / sub-block decoding (``Efficient-Large-Model/Fast_dLLM_v2_*``
``modeling.py`` ``Fast_dLLM_QwenForCausalLM.generate``, arXiv 2509.26328) over the exact block KV cache — its own
small loop (DESIGN: a family member whose loop truly differs), reusing the generic loop's stopping and counting.

What differs from the generic loop (:mod:`localdiff.decoding.loop`):

* **token shift**: the model was adapted from an AR model, so position ``j`` of a block is predicted by the logits
  of position ``j − 1`` (upstream ``cat([logits[:, :1], logits[:, :-1]])``; position 0 is never masked);
* a block's **first token is autoregressive**: when a block is complete it is prefilled into the cache (upstream's
  ``update_past_key_values=True`` forward) and the argmax of its last row opens the next block — so the prefill
  cannot ride along with the next block's first step (no fused stage here); the prompt's whole blocks likewise,
  when the prompt ends on a block boundary;
* **sub-blocks**: the block's positions are decoded ``small_block_size`` at a time, left to right; each step (one
  forward over the whole block, reading the cache) commits, among the sub-block's masked positions, every one whose
  confidence (the sampled token's probability) exceeds ``threshold`` and always the most confident one;
* a row stops once an EOS is committed with no mask before it (upstream's ``stop_token`` check).

* **sub-block cache** (``kv_cache="dual"`` or ``use_block_cache``, off by default as upstream): a step whose sub-block starts with a mask
  (or the block's first step) runs the whole block and keeps its K/V (upstream ``block_past_key_values``); any
  other step runs only the sub-block's tokens, writes their K/V over the kept ones (``replace_position``) and attends
  to the prefix cache and the whole kept block — the K/V of the block's other positions are from that last full
  pass, so this is approximate, except with ``small_block_size`` = the block size (then every pass after the first
  rewrites the whole block: exact). The sub-block's own logits are shifted inside the sub-block, as upstream (its
  first row predicts itself, but that position is never a mask on this path). For a batch the full pass runs when
  any row's sub-block starts with a mask (upstream's ``.any()``).

Where we differ from upstream: a prompt of exactly one block is prefilled (upstream's ``input_ids.shape[1] >
block_size`` test skips it and then decodes without the prompt); batches run row-wise (upstream is batch 1).
"""

from __future__ import annotations

import math
import time

import torch

from localdiff.decoding.answer import Answer
from localdiff.decoding.draws import categorical
from localdiff.decoding.request import Request
from localdiff.decoding.sampling import top_p_logits
from localdiff.events import StepEvent


def _pick(logits: torch.Tensor, o, gen, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens LongTensor[B, n], their probabilities FloatTensor[B, n]) of upstream ``sample_with_top_p``; the mask
    token is never a prediction (as in :mod:`localdiff.decoding.sdar`)."""
    logits = logits.float().clone()
    logits[..., mask_id] = -torch.inf
    if o.temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        p, x = probs.max(-1)
        return x, p
    probs = torch.softmax(top_p_logits(logits / o.temperature, o.top_p), dim=-1)
    x = categorical(probs.reshape(-1, probs.shape[-1]), gen).view(probs.shape[:-1])
    return x, probs.gather(-1, x[..., None]).squeeze(-1)


def run(net, req: Request, cache, prefill: tuple | None, tail_ids: torch.Tensor):
    """Generate after a prompt; yields StepEvent (when ``req.emit_steps``), CanvasDone per block, then Done.

    Args:
        net: a block model (``prefill(..., last_logits=True)``, ``denoise``; ``config.block_size``).
        req: the generation (:class:`localdiff.decoding.request.Request`): ``options``
            (:class:`localdiff.decoding.options.FastDLLMv2Options`), ``max_new_tokens``, ``eos_ids`` / ``pad_id`` /
            ``mask_id`` as the generic loop, ``generator``, ``cancel`` (polled before every denoising forward; True
            ends the generator there, no Done, as in :func:`localdiff.decoding.loop.run`).
        cache: the block KV cache (holding any reused prefix).
        prefill: (ids LongTensor[B, T'], padding mask Bool[B, T'] or None): the whole blocks still to prefill, or
            None. tail_ids: LongTensor[B, t]: the prompt tokens sharing the first block (t may be 0).
    Raises:
        ValueError: ``small_block_size`` does not divide the block size.
    """
    options, generator, mask_id, pad_id = req.options, req.generator, req.mask_id, req.pad_id
    blk, sbs = net.config.block_size, options.small_block_size
    if blk % sbs:
        raise ValueError(f"small_block_size: must divide the block size {blk} (got {sbs})")
    st = req.stats
    b, dev = tail_ids.shape[0], tail_ids.device
    answer = Answer(req, b, dev)
    forwards = torch.zeros(b, dtype=torch.long, device=dev)
    lead = tail_ids.shape[1]
    last = None
    if prefill is not None and prefill[0].shape[1]:
        tp = time.perf_counter()
        last = net.prefill(prefill[0], cache, prefill[1], last_logits=lead == 0)
        st.prefill_seconds += time.perf_counter() - tp
        st.prefill_tokens_computed += prefill[0].shape[1]
    n_blocks = math.ceil((req.max_new_tokens + lead) / blk)
    for ci in range(n_blocks):
        skip = lead if ci == 0 else 0
        canvas = torch.full((b, blk), mask_id, dtype=torch.long, device=dev)
        if skip:
            canvas[:, :skip] = tail_ids
        if not skip:  # the block's first token, autoregressively
            if last is None:
                raise ValueError("a block without prompt tokens needs the previous row's logits")
            canvas[:, 0] = _pick(last[:, None], options, generator, mask_id)[0][:, 0]
        stop = torch.zeros(b, dtype=torch.bool, device=dev)
        steps, block_kv = 0, None
        for s0 in range(0, blk, sbs):
            while True:
                masked = canvas == mask_id
                sub = masked[:, s0 : s0 + sbs] & ~stop[:, None]
                if not bool(sub.any()):
                    break
                if req.cancel is not None and req.cancel():
                    return
                forwards += ~(stop | answer.finished)
                steps += 1
                if block_kv is not None and not bool((canvas[:, s0] == mask_id).any()):
                    logits = net.denoise_sub(canvas[:, s0 : s0 + sbs], cache, block_kv, s0)
                    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                else:
                    if options.sub_block_cache:
                        logits, block_kv = net.denoise_capture(canvas, cache)
                    else:
                        logits = net.denoise(canvas, cache)
                    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1)[:, s0 : s0 + sbs]
                x1, p1 = _pick(shifted, options, generator, mask_id)
                conf = torch.where(sub, p1, torch.tensor(-torch.inf, device=dev))
                commit = conf > options.threshold
                commit[torch.arange(b, device=dev), conf.argmax(-1)] = True
                commit &= sub
                canvas[:, s0 : s0 + sbs] = torch.where(commit, x1, canvas[:, s0 : s0 + sbs])
                stop |= _stopped(canvas, skip, mask_id, answer.eos_t)
                if req.emit_steps:
                    yield _event(ci, steps, canvas, sub, p1, s0, mask_id)
        block = torch.where(canvas == mask_id, torch.full_like(canvas, pad_id if pad_id is not None else 0), canvas)
        yield answer.end_block(ci, block[:, skip:], steps)
        if answer.all_finished or ci + 1 == n_blocks:
            break
        tp = time.perf_counter()
        last = net.prefill(block, cache, None, last_logits=True)
        forwards += ~answer.finished
        st.prefill_seconds += time.perf_counter() - tp
        st.prefill_tokens_computed += blk
    rows = answer.rows()
    st.forwards = int(forwards.sum())
    if hasattr(cache, "stats"):
        st.cache = cache.stats()
    yield answer.done(rows, answer.reason(rows))


def _event(
    ci: int, step: int, canvas: torch.Tensor, sub: torch.Tensor, p1: torch.Tensor, s0: int, mask_id: int
) -> StepEvent:
    """The StepEvent of one step over LongTensor[B, blk] ``canvas`` (CPU tensors): accepted = the committed
    positions, renoised = the masks left; confidence = the sampled tokens' probabilities ``p1`` at the sub-block's
    masked positions ``sub`` (BoolTensor[B, sbs] from ``s0``), 1 elsewhere."""
    b, blk = canvas.shape
    left = canvas == mask_id
    conf = torch.ones(b, blk, device=canvas.device)
    conf[:, s0 : s0 + sub.shape[1]] = torch.where(sub, p1, 1.0)
    return StepEvent(
        ci,
        step,
        blk,
        canvas_ids=canvas.cpu(),
        argmax_ids=canvas.cpu(),
        accepted=(~left).cpu(),
        renoised=left.cpu(),
        reopened=torch.zeros_like(left).cpu(),
        confidence=conf.cpu(),
        entropy=torch.zeros(b, blk),
    )


def _stopped(canvas: torch.Tensor, skip: int, mask_id: int, eos_t) -> torch.Tensor:
    """BoolTensor[B]: rows whose generated part of the block holds an EOS with no mask before it."""
    if eos_t is None:
        return torch.zeros(canvas.shape[0], dtype=torch.bool, device=canvas.device)
    gen = canvas[:, skip:]
    is_eos = torch.isin(gen, eos_t)
    masks_before = (gen == mask_id).long().cumsum(-1)
    return (is_eos & (masks_before == 0)).any(-1)
