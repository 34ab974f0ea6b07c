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

from localdiff.decoding.sampling import top_p_logits
from localdiff.decoding.detok import IncrementalText
from localdiff.decoding.draws import categorical
from localdiff.decoding.loop import done_event, strip_generated
from localdiff.decoding.stopping import finalize_canvas
from localdiff.events import CanvasDone, GenerationStats, StepEvent


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


def run(net, options, cache, max_new_tokens: int, eos_ids: list[int], pad_id: int | None, mask_id: int,
        prefill_ids, prefill_mask, tail_ids, generator=None, emit_steps: bool = True, decode=None,
        stats: GenerationStats | None = None, cancel=None):
    """Generate after a prompt; yields StepEvent (when ``emit_steps``), CanvasDone per block, then Done.

    Args:
        net: a block model (``prefill(..., last_logits=True)``, ``denoise``; ``config.block_size``).
        options: :class:`localdiff.decoding.options.FastDLLMv2Options`.
        cache: the block KV cache (holding any reused prefix). ``prefill_ids`` LongTensor[B, T'] (whole blocks
            still to prefill, maybe empty) with its padding mask Bool[B, T'] or None; ``tail_ids`` LongTensor[B, t]:
            the prompt tokens sharing the first block (t may be 0).
        max_new_tokens / eos_ids / pad_id / mask_id: as the generic loop.
        cancel: ``cancel() -> bool`` polled before every denoising forward; True ends the generator there (no Done),
            as in :func:`localdiff.decoding.loop.run`.
    Raises:
        ValueError: ``small_block_size`` does not divide the block size.
    """
    blk, sbs = net.config.block_size, options.small_block_size
    if blk % sbs:
        raise ValueError(f"small_block_size: must divide the block size {blk} (got {sbs})")
    st = stats or GenerationStats()
    detok = IncrementalText(decode)   # row 0's text, block by block
    t0 = time.perf_counter()
    b, dev = tail_ids.shape[0], tail_ids.device
    eos_t = torch.tensor(eos_ids, device=dev) if eos_ids else None
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    forwards = torch.zeros(b, dtype=torch.long, device=dev)
    lead = tail_ids.shape[1]
    last = None
    if prefill_ids is not None and prefill_ids.shape[1]:
        tp = time.perf_counter()
        last = net.prefill(prefill_ids, cache, prefill_mask, last_logits=lead == 0)
        st.prefill_seconds += time.perf_counter() - tp
        st.prefill_tokens_computed += prefill_ids.shape[1]
    generated, reason, made = [], "length", 0
    n_blocks = math.ceil((max_new_tokens + lead) / blk)
    for ci in range(n_blocks):
        skip = lead if ci == 0 else 0
        canvas = torch.full((b, blk), mask_id, dtype=torch.long, device=dev)
        if skip:
            canvas[:, :skip] = tail_ids
        if not skip:                                   # the block's first token, autoregressively
            if last is None:
                raise ValueError("a block without prompt tokens needs the previous row's logits")
            canvas[:, 0] = _pick(last[:, None], options, generator, mask_id)[0][:, 0]
        stop = torch.zeros(b, dtype=torch.bool, device=dev)
        steps, block_kv = 0, None
        for s0 in range(0, blk, sbs):
            while True:
                masked = canvas == mask_id
                sub = masked[:, s0:s0 + sbs] & ~stop[:, None]
                if not bool(sub.any()):
                    break
                if cancel is not None and cancel():
                    return
                forwards += ~(stop | finished)
                steps += 1
                if block_kv is not None and not bool((canvas[:, s0] == mask_id).any()):
                    logits = net.denoise_sub(canvas[:, s0:s0 + sbs], cache, block_kv, s0)
                    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                else:
                    if options.sub_block_cache:
                        logits, block_kv = net.denoise_capture(canvas, cache)
                    else:
                        logits = net.denoise(canvas, cache)
                    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1)[:, s0:s0 + sbs]
                x1, p1 = _pick(shifted, options, generator, mask_id)
                conf = torch.where(sub, p1, torch.tensor(-torch.inf, device=dev))
                commit = conf > options.threshold
                commit[torch.arange(b, device=dev), conf.argmax(-1)] = True
                commit &= sub
                canvas[:, s0:s0 + sbs] = torch.where(commit, x1, canvas[:, s0:s0 + sbs])
                stop |= _stopped(canvas, skip, mask_id, eos_t)
                if emit_steps:
                    left = canvas == mask_id
                    full_conf = torch.ones(b, blk, device=dev)
                    full_conf[:, s0:s0 + sbs] = torch.where(sub, p1, 1.0)
                    yield StepEvent(ci, steps, blk, canvas.cpu(), canvas.cpu(), (~left).cpu(), left.cpu(),
                                    torch.zeros_like(left).cpu(), full_conf.cpu(), torch.zeros(b, blk))
        block = torch.where(canvas == mask_id, torch.full_like(canvas, pad_id if pad_id is not None else 0),
                            canvas)
        final, finished = finalize_canvas(block[:, skip:], finished, eos_t, pad_id)
        generated.append(final)
        st.canvases += 1
        room = max_new_tokens - made
        made += final.shape[1]
        text = detok.add(strip_generated(final[0, :room], eos_ids, pad_id))
        yield CanvasDone(ci, final.cpu(), text, steps, finished.cpu())
        if bool(finished.all()):
            reason = "eos"
            break
        if ci + 1 == n_blocks:
            break
        tp = time.perf_counter()
        last = net.prefill(block, cache, None, last_logits=True)
        forwards += ~finished
        st.prefill_seconds += time.perf_counter() - tp
        st.prefill_tokens_computed += blk
    yield done_event(generated, b, max_new_tokens, eos_ids, pad_id, forwards, st, t0, cache, decode, reason)


def _stopped(canvas: torch.Tensor, skip: int, mask_id: int, eos_t) -> torch.Tensor:
    """BoolTensor[B]: rows whose generated part of the block holds an EOS with no mask before it."""
    if eos_t is None:
        return torch.zeros(canvas.shape[0], dtype=torch.bool, device=canvas.device)
    gen = canvas[:, skip:]
    is_eos = torch.isin(gen, eos_t)
    masks_before = (gen == mask_id).long().cumsum(-1)
    return (is_eos & (masks_before == 0)).any(-1)
