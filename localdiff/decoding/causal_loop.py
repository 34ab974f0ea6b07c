"""The causal family's loop: autoregressive decoding over an exact KV cache, plain or with DFlash drafts
(z-lab/dflash ``dflash_generate``; arXiv 2602.06036). Batch 1.

prefill the prompt (target, K/V cached, logits of the last position) → first token; then per step:
block = [last token, mask × (n − 1)] (n = min(block_size, what is left)) → one draft pass over it, conditioned on
the context features of the positions the draft has not seen yet → drafted block → one target forward over the
block with its cache → the policy (:class:`localdiff.decoding.dflash.DFlash`) accepts a prefix (+1 token from the
target) → the target cache is cropped to the accepted tokens, the next context features are the block's first
``produced`` rows. Without a draft (``draft=None``) the block is the last token alone: plain AR decoding, one
target forward per token.

The token after the accepted ones is not in the target cache; it opens the next block (as upstream). Stopping: the
first EOS among the new tokens ends the answer (kept); ``max_new_tokens`` caps it. Events per step: with a draft, a
StepEvent whose canvas is the drafted block (accepted = the last token and the accepted drafts, renoised = the
rejected drafts, confidence = the draft's top-1 probability), then a CanvasDone with the new tokens and their text.
Stats: ``forwards`` = target forwards (prefill included), ``canvases`` = steps, ``acceptance_lengths`` = tokens each
step produced (upstream's list), ``acceptance_length`` τ = their mean, ``draft_forwards``.

Across turns (``localdiff.cache.causal.CausalCache``): the target cache may already hold the positions before
``prompt_ids`` (then only these are prefilled, at the positions after), and ``pending`` may carry the target features
of positions the draft cache does not hold yet (those right before ``prompt_ids``): the first draft pass reads them
and the prompt's features together. ``pending.keep_features`` is told after every change, so a cache left by a
finished or cancelled generation is consistent for the next one.
"""

from __future__ import annotations

import time

import torch

from localdiff.decoding.answer import Answer
from localdiff.decoding.dflash import DFlash, pick
from localdiff.decoding.request import Request
from localdiff.events import CanvasDone, StepEvent


def run(
    target, req: Request, cache, draft=None, draft_cache=None, prompt_ids: torch.Tensor | None = None, pending=None
):
    """Generate after ``prompt_ids`` (default ``req.ids``) LongTensor[1, P]; yields StepEvent (with a draft and
    ``req.emit_steps``), CanvasDone per step, then Done (token ids: the new tokens, EOS kept).

    Args:
        target: a :class:`localdiff.arch.causal.CausalLM` (``prefill`` with ``layers``, ``embed_tokens``,
            ``head_weight()``).
        req: the generation (:class:`localdiff.decoding.request.Request`): ``options`` (CausalOptions; its
            ``block_size``: tokens per block, default the draft's, 1 = plain AR even with a draft),
            ``generator``, ``max_new_tokens``, ``eos_ids``, ``cancel`` (polled before every target forward, the
            prefill and each step; True ends the generator there, no Done, as the other families' loops).
        cache: the target's block KV cache (empty, or holding the positions before ``prompt_ids``).
        draft / draft_cache: a :class:`localdiff.arch.dflash.DFlashDraft` and its cache (empty, or holding the
            context K/V of the positions before ``pending``'s features), or None (plain AR).
        prompt_ids: the tokens not yet in ``cache`` (a conversation cache's new part), default ``req.ids``.
        pending: a :class:`localdiff.cache.causal.CausalCache` (``feats`` / ``feat_ids`` of the positions after
            ``draft_cache``, before ``prompt_ids``; ``keep_features``) or None.
    """
    options, generator, st = req.options, req.generator, req.stats
    prompt_ids = req.ids if prompt_ids is None else prompt_ids
    answer = Answer(req, 1, prompt_ids.device)
    p = prompt_ids.shape[1]
    past = cache.seq_len
    max_length = past + p + req.max_new_tokens
    bs = 1 if draft is None else int(options.block_size or draft.block_size)
    layers = draft.target_layer_ids if bs > 1 else None
    policy = DFlash(options, generator)
    eos = set(answer.eos_ids)
    if req.cancel is not None and req.cancel():
        return
    tp = time.perf_counter()
    logits, feats = target.prefill(prompt_ids, cache, layers=layers, last_only=True)
    st.prefill_seconds += time.perf_counter() - tp
    st.prefill_tokens_computed += p
    st.forwards += 1
    last = int(pick(logits[:, -1], options, generator)[0])
    out = [last]
    ctx_ids = prompt_ids
    if layers is not None and pending is not None:
        if pending.feats is not None and pending.feats.shape[1]:
            feats, ctx_ids = torch.cat([pending.feats, feats], 1), torch.cat([pending.feat_ids, ctx_ids], 1)
        pending.keep_features(feats, ctx_ids)
    yield CanvasDone(
        0, torch.tensor([[last]]), answer.detok.add([last] if last not in eos else []), 1, torch.tensor([last in eos])
    )
    start, step, reason = past + p, 0, "length"
    stopped = last in eos
    dev = prompt_ids.device
    while start + 1 < max_length and not stopped:
        if req.cancel is not None and req.cancel():
            return
        n = min(bs, max_length - start)
        block = torch.full((1, n), draft.mask_token_id if n > 1 else 0, dtype=torch.long, device=dev)
        block[0, 0] = last
        conf = None
        if n > 1:
            w = target.embed_tokens.weight
            dl = draft.draft(draft.embed(block, w), feats, draft_cache, target.head_weight(), feature_ids=ctx_ids)
            st.draft_forwards += 1
            if pending is not None:
                pending.keep_features(None, None)
            block[:, 1:] = policy.propose(dl[:, 1:])
            if req.emit_steps:
                conf = torch.softmax(dl[0, 1:], -1).max(-1).values
        tl, new_feats = target.prefill(block, cache, layers=layers if n > 1 else None)
        st.forwards += 1
        acc, bonus = policy.verify(block, tl)
        new = block[0, 1 : acc + 1].tolist() + [bonus]
        produced = min(acc + 1, max_length - start - 1)
        for k, t in enumerate(new[:produced]):
            if t in eos:
                produced, stopped, reason = k + 1, True, "eos"
                break
        new = new[:produced]
        out += new
        start += produced
        cache.truncate(start)
        if bs > 1:
            st.acceptance_lengths.append(produced)
        if n > 1:
            feats, ctx_ids = new_feats[:, :produced], block[:, :produced]
            if pending is not None:
                pending.keep_features(feats, ctx_ids)
        last = new[-1]
        step += 1
        if req.emit_steps and n > 1:
            yield _event(step, block, acc, conf)
        yield CanvasDone(
            step, torch.tensor([new]), answer.detok.add([t for t in new if t not in eos]), 1, torch.tensor([stopped])
        )
    if last in eos:
        reason = "eos"
    st.canvases = step + 1
    st.acceptance_length = sum(st.acceptance_lengths) / max(len(st.acceptance_lengths), 1)
    st.cache = cache.stats() if hasattr(cache, "stats") else {}
    yield answer.done([out], reason)


def _event(step: int, block: torch.Tensor, acc: int, conf: torch.Tensor | None) -> StepEvent:
    """The StepEvent of one drafted block [1, n]: accepted = positions 0..acc, renoised = the rejected drafts."""
    n = block.shape[1]
    accepted = (torch.arange(n) <= acc)[None]
    rejected = ~accepted
    c = torch.ones(1, n)
    if conf is not None:
        c[0, 1:] = conf.float().cpu()
    none = torch.zeros(1, n, dtype=torch.bool)
    return StepEvent(
        step,
        1,
        1,
        canvas_ids=block.cpu().clone(),
        argmax_ids=block.cpu().clone(),
        accepted=accepted,
        renoised=rejected,
        reopened=none,
        confidence=c,
        entropy=torch.zeros(1, n),
        drafted=True,
    )
