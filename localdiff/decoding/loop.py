"""The generic block loop (docs/ARCHITECTURE.md, "The decoder contract"): block-autoregressive over canvases / blocks,
diffusion within each, for models with an exact block KV cache (the ``prefill`` + ``denoise`` roles).

The loop owns what every such family shares — blocks, the scheduling of prefills (the *fused stage*: tokens still
to prefill ride along with the next block's first denoising step, one forward instead of two), sequence stopping on
EOS / ``max_new_tokens``, events, stats, cancellation (closing the generator stops it between steps) and the token
count. A decoder policy (e.g. :class:`localdiff.decoding.canvas_eb.CanvasEB`) owns corruption, acceptance and its
own state through four calls: ``begin_block``, ``model_inputs``, ``assess`` (no draws) and ``advance`` (draws: the
StepEvent fields, device tensors or zero-argument callables giving one, called only when a StepEvent is built),
and optionally ``head_rows`` (BoolTensor[B, C] or None: the positions whose logits the next forward computes; the
model's ``denoise`` then takes ``head_rows`` and returns FloatTensor[N, V]; never on a block's first step), and
the attribute ``raw_logits`` (True: ``denoise`` gets ``raw_logits=True`` and returns the LM head's output before
soft-capping, :class:`localdiff.arch.soft_embedding.RawLogits`, which the policy's ``assess`` takes).
"""

from __future__ import annotations

import math
import time

import torch

from localdiff.decoding.answer import Answer
from localdiff.decoding.request import Request
from localdiff.events import GenerationStats, StepEvent


def run(
    net,
    policy,
    req: Request,
    cache,
    prefill: tuple | None = None,
    start_canvas: torch.Tensor | None = None,
    lead: int = 0,
):
    """Generate after a prompt; yields StepEvent (when ``req.emit_steps``), CanvasDone per block, then Done.

    Args:
        net: the model (roles ``prefill`` + ``denoise``; ``config.canvas_length``).
        policy: a decoder policy for this generation (see the module docstring).
        req: the generation (:class:`localdiff.decoding.request.Request`): B = ``req.ids``' rows;
            ``max_new_tokens`` spans ceil(max_new_tokens / C) blocks; ``eos_ids`` / ``pad_id``: sequence stopping
            (a row ends at its first EOS; later tokens become pad); ``decode``: ids → text (row 0) for CanvasDone /
            Done; ``cancel``: polled before every denoising step, True ends the generator there (no Done);
            without ``emit_steps``, the step that ends the generation skips the policy's draws (nothing reads
            them): same tokens, the generator just ends earlier in its stream.
        cache: KV cache already holding any reused prefix.
        prefill: (ids LongTensor[B, T'], padding mask Bool[B, T'] or None): the prompt tokens still to prefill
            (fused with the first denoising step), or None.
        start_canvas: optional LongTensor[B, C] for the first block.
        lead: the first ``lead`` positions of ``start_canvas`` are prompt tokens that share the first block (block
            families align blocks to absolute positions): they are not generated, not counted, not returned, and
            are prefilled together with that block once it is final.
    """
    c_len, n_new = net.config.canvas_length, req.max_new_tokens
    dev = policy.dev
    st = req.stats
    batch = req.ids.shape[0]
    pending = prefill if prefill is not None and prefill[0].shape[1] else None
    answer = Answer(req, batch, dev)
    forwards = torch.zeros(batch, dtype=torch.long, device=dev)  # summed once at the end: no per-step host sync
    kw = {"raw_logits": True} if getattr(policy, "raw_logits", False) else {}  # the policy soft-caps (fast path)
    for ci in range(math.ceil((n_new + lead) / c_len)):
        policy.begin_block(start_canvas if ci == 0 else None)
        skip = lead if ci == 0 else 0  # prompt positions at the start of this block
        last_block = (ci + 1) * c_len >= n_new + lead
        steps_used, early = 0, None
        for step in range(1, policy.max_steps + 1):
            if req.cancel is not None and req.cancel():
                return
            forwards += ~(policy.done | answer.finished)
            steps_used += 1
            canvas, sc = policy.model_inputs()
            rows = policy.head_rows() if hasattr(policy, "head_rows") else None
            if rows is not None:  # the policy reads only these positions' logits: FloatTensor[N, V]
                logits = net.denoise(canvas, cache, sc, head_rows=rows, **kw)
            elif pending is None:
                logits = net.denoise(canvas, cache, sc, **kw)
            else:
                logits = _fused_stage(net, canvas, cache, sc, pending, st, kw)
                pending = None
            a = policy.assess(logits, step)
            if not req.emit_steps and policy.ends_block(a, step):
                fin = answer.finalize(a.argmax[:, skip:])
                if last_block or bool(fin[1].all()):  # this step also ends the generation: skip its draws
                    early = fin
                    break
            ev = policy.advance(a)
            if req.emit_steps:
                ev = {k: v() if callable(v) else v for k, v in ev.items()}  # (fields computed only when read)
                yield StepEvent(
                    ci, step, policy.max_steps, **{k: None if v is None else v.cpu() for k, v in ev.items()}
                )
            if policy.all_done():
                break
        yield answer.end_block(ci, policy.argmax[:, skip:], steps_used, early)
        if answer.all_finished or last_block:
            break
        final = answer.blocks[-1]
        pending = (torch.cat([start_canvas[:, :skip].to(final.device), final], 1) if skip else final, None)
    rows = answer.rows()
    st.forwards = int(forwards.sum())
    if hasattr(cache, "stats"):
        st.cache = cache.stats()
    yield answer.done(rows, answer.reason(rows))


def _fused_stage(net, canvas, cache, sc, pending, st: GenerationStats, kw: dict | None = None):
    """The named *fused prefill + first step* stage: prefill ``pending`` (ids, padding mask) in the same forward as
    the block's first denoising step (bit-identical to the two passes); the cache records the ids it commits.
    ``kw``: further denoise keywords (``raw_logits``)."""
    ids, mask = pending
    tp = time.perf_counter()
    logits = net.denoise(canvas, cache, sc, prefill_ids=ids, prefill_mask=mask, **(kw or {}))
    st.prefill_seconds += time.perf_counter() - tp
    st.prefill_tokens_computed += ids.shape[1]
    return logits
