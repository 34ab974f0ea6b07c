"""The generic block loop (docs/ARCHITECTURE.md, "The decoder contract"): block-autoregressive over canvases / blocks,
diffusion within each, for models with an exact block KV cache (the ``prefill`` + ``denoise`` roles).

The loop owns what every such family shares — blocks, the scheduling of prefills (the *fused stage*: tokens still
to prefill ride along with the next block's first denoising step, one forward instead of two), sequence stopping on
EOS / ``max_new_tokens``, events, stats, cancellation (closing the generator stops it between steps) and the token
count. A decoder policy (e.g. :class:`localdiff.decoding.canvas_eb.CanvasEB`) owns corruption, acceptance and its
own state through four calls: ``begin_block``, ``model_inputs``, ``assess`` (no draws) and ``advance`` (draws),
and optionally ``head_rows`` (BoolTensor[B, C] or None: the positions whose logits the next forward computes; the
model's ``denoise`` then takes ``head_rows`` and returns FloatTensor[N, V]; never on a block's first step), and
the attribute ``raw_logits`` (True: ``denoise`` gets ``raw_logits=True`` and returns the LM head's output before
soft-capping, :class:`localdiff.arch.soft_embedding.RawLogits`, which the policy's ``assess`` takes).
"""
from __future__ import annotations

import math
import time

import torch

from localdiff.decoding.detok import IncrementalText
from localdiff.decoding.stopping import finalize_canvas
from localdiff.events import CanvasDone, Done, GenerationStats, StepEvent


def run(net, policy, cache, batch: int, max_new_tokens: int, eos_ids: list[int], pad_id: int | None,
        prefill_ids=None, prefill_mask=None, start_canvas=None, emit_steps: bool = True, decode=None,
        stats: GenerationStats | None = None, lead: int = 0, cancel=None):
    """Generate after a prompt; yields StepEvent (when ``emit_steps``), CanvasDone per block, then Done.

    Args:
        net: the model (roles ``prefill`` + ``denoise``; ``config.canvas_length``).
        policy: a decoder policy for this generation (see the module docstring).
        cache: KV cache already holding any reused prefix; ``prefill_ids`` (LongTensor[B, T'] or None) are the
            prompt tokens still to prefill, with their padding mask ``prefill_mask`` (Bool[B, T'] or None).
        batch: B. max_new_tokens: spans ceil(max_new_tokens / C) blocks.
        eos_ids / pad_id: sequence stopping (a row ends at its first EOS; later tokens become pad).
        start_canvas: optional LongTensor[B, C] for the first block.
        lead: the first ``lead`` positions of ``start_canvas`` are prompt tokens that share the first block (block
            families align blocks to absolute positions): they are not generated, not counted, not returned, and
            are prefilled together with that block once it is final.
        emit_steps: yield StepEvents. Without them, the step that ends the generation skips the policy's draws
            (nothing reads them): same tokens, the generator just ends earlier in its stream.
        decode: ids → text (row 0) for CanvasDone / Done, or None.
        cancel: ``cancel() -> bool`` polled before every denoising step; True ends the generator there (no Done).
    """
    c_len = net.config.canvas_length
    dev = policy.dev
    st = stats or GenerationStats()
    t0 = time.perf_counter()
    pending = (prefill_ids, prefill_mask) if prefill_ids is not None and prefill_ids.shape[1] else None
    eos_t = torch.tensor(eos_ids, device=dev) if eos_ids else None
    finished = torch.zeros(batch, dtype=torch.bool, device=dev)
    forwards = torch.zeros(batch, dtype=torch.long, device=dev)  # summed once at the end: no per-step host sync
    generated: list[torch.Tensor] = []
    reason = "length"
    made = 0                                        # generated positions of the blocks so far
    detok = IncrementalText(decode)                 # row 0's text, block by block
    kw = {"raw_logits": True} if getattr(policy, "raw_logits", False) else {}   # the policy soft-caps (fast path)
    for ci in range(math.ceil((max_new_tokens + lead) / c_len)):
        policy.begin_block(start_canvas if ci == 0 else None)
        skip = lead if ci == 0 else 0               # prompt positions at the start of this block
        last_block = (ci + 1) * c_len >= max_new_tokens + lead
        steps_used, early = 0, None
        for step in range(1, policy.max_steps + 1):
            if cancel is not None and cancel():
                return
            forwards += ~(policy.done | finished)
            steps_used += 1
            canvas, sc = policy.model_inputs()
            rows = policy.head_rows() if hasattr(policy, "head_rows") else None
            if rows is not None:       # the policy reads only these positions' logits: FloatTensor[N, V]
                logits = net.denoise(canvas, cache, sc, head_rows=rows, **kw)
            elif pending is None:
                logits = net.denoise(canvas, cache, sc, **kw)
            else:
                logits = _fused_stage(net, canvas, cache, sc, pending, st, kw)
                pending = None
            a = policy.assess(logits, step)
            if not emit_steps and policy.ends_block(a, step):
                fin = finalize_canvas(a.argmax[:, skip:], finished, eos_t, pad_id)
                if last_block or bool(fin[1].all()):     # this step also ends the generation: skip its draws
                    early = fin
                    break
            ev = policy.advance(a)
            if emit_steps:
                yield StepEvent(ci, step, policy.max_steps, *(None if v is None else v.cpu() for v in ev.values()))
            if policy.all_done():
                break
        final, finished = early or finalize_canvas(policy.argmax[:, skip:], finished, eos_t, pad_id)
        generated.append(final)
        st.canvases += 1
        room = max_new_tokens - made                # tokens of this block within max_new_tokens
        made += final.shape[1]
        kept = strip_generated(final[0, :room], eos_ids, pad_id)
        text = detok.add(kept)                      # what this block adds to the answer's text
        known = (kept, text) if ci == 0 and not detok.pending else None   # Done's text: the answer is this block
        yield CanvasDone(ci, final.cpu(), text, steps_used, finished.cpu())
        if bool(finished.all()):
            reason = "eos"
            break
        if last_block:
            break
        pending = (torch.cat([start_canvas[:, :skip].to(final.device), final], 1) if skip else final, None)
    yield done_event(generated, batch, max_new_tokens, eos_ids, pad_id, forwards, st, t0, cache, decode, reason,
                     known if len(generated) == 1 else None)


def done_event(generated: list, batch: int, max_new_tokens: int, eos_ids, pad_id, forwards: torch.Tensor,
               st: GenerationStats, t0: float, cache, decode, reason: str, known: tuple | None = None) -> Done:
    """The generation's Done event from its blocks (LongTensors[B, C] in order; pad / EOS handling as
    :func:`strip_generated`): per-row tokens (at most ``max_new_tokens``), texts, ``st`` completed (forwards
    from LongTensor[B] ``forwards``, tokens, seconds since ``t0`` (perf_counter), cache accounting). ``known``:
    (ids, their text) already decoded (a one-block answer's CanvasDone): row 0's text when its ids are those, not
    decoded twice. ``reason``: "eos" stays only when every returned row ends with its EOS."""
    if len(generated) == 1:
        out = generated[0]
    else:
        out = torch.cat(generated, dim=1) if generated else torch.zeros(batch, 0, dtype=torch.long)
    rows = [strip_generated(out[r], eos_ids, pad_id, keep_eos=True)[:max_new_tokens] for r in range(batch)]
    if reason == "eos" and not all(r and r[-1] in eos_ids for r in rows):
        reason = "length"         # an EOS past max_new_tokens (the block ran on): the answer was cut by the length
    st.forwards = int(forwards.sum())
    count_tokens(st, rows, time.perf_counter() - t0)
    if hasattr(cache, "stats"):
        st.cache = cache.stats()
    # a row holds no pad and at most one EOS, its last id: the text's ids are the row without that EOS
    texts = []
    for r in rows:
        ids = r[:-1] if r and eos_ids and r[-1] in eos_ids else r
        texts.append(known[1] if known is not None and not texts and ids == known[0] else
                     decode(ids) if decode else "")
    return Done(texts[0] if batch == 1 else texts, rows if batch > 1 else rows[0], st, reason)


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


def count_tokens(st: GenerationStats, rows: list[list[int]], seconds: float) -> None:
    """The one place generated tokens are counted: exactly the ids returned (``rows``: per row, up to and including
    the first EOS, pad removed, at most max_new_tokens), so ``new_tokens`` = len of what the caller gets, whatever
    the pad / EOS ids are. Sets new_tokens, tokens_per_forward, seconds, tokens_per_second."""
    st.new_tokens = sum(len(r) for r in rows)
    st.tokens_per_forward = st.new_tokens / max(st.forwards, 1)
    st.seconds = seconds
    st.tokens_per_second = st.new_tokens / seconds if seconds > 0 else 0.0


def kept_positions(ids: list[int], eos_ids, pad_id, keep_eos: bool = True) -> list[int]:
    """Indices of a generated row that the caller gets: up to the first EOS (included when keep_eos), pad skipped."""
    keep = []
    for k, t in enumerate(ids):
        if eos_ids and t in eos_ids:
            if keep_eos:
                keep.append(k)
            break
        if pad_id is not None and t == pad_id:
            continue
        keep.append(k)
    return keep


def strip_generated(ids, eos_ids, pad_id, keep_eos: bool = False) -> list[int]:
    """Generated ids (LongTensor[T] or list) up to the first EOS (included when keep_eos), without pad: the ids at
    :func:`kept_positions`, found with ``list.index`` / ``count`` (C loops) instead of a Python loop per position
    (a 256-position canvas: ~20 µs less, twice per answer's end)."""
    row = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    cut = len(row)
    for e in eos_ids or ():
        try:
            cut = row.index(e, 0, cut)
        except ValueError:
            pass
    out = row[:cut]
    if pad_id is not None and out.count(pad_id):   # (an id that is also an EOS never comes before the cut)
        out = [t for t in out if t != pad_id]
    if keep_eos and cut < len(row):
        out.append(row[cut])
    return out
