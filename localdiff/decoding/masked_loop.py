"""The masked family's loop (docs/FAMILIES.md, masked): a canvas of mask tokens after the prompt, decoded in
semi-autoregressive blocks by a bidirectional model (the ``logits`` + ``window`` roles), with no exact KV cache.

It differs from :mod:`localdiff.decoding.loop` (prefill + denoise over an exact block cache) enough to be its own
small loop. It owns: the sequence x = prompt + ``max_new_tokens`` masks (LLaDA ``generate.py``; Dream pads to
``max_length`` with masks), blocks of ``block_length`` and the split of ``steps`` over them, the forwards — full
recompute (``kv_cache="none"``), or Fast-dLLM's approximate caches (NVlabs/Fast-dLLM ``generate_with_prefix_cache`` /
``generate_with_dual_cache``, arXiv 2505.22618): each block starts with a full pass that refreshes the per-layer
K/V, then ``prefix`` recomputes the block and everything after it over the cached prefix, ``dual`` recomputes only the
block over the cached prefix and suffix, ``vicinity`` (dInfer: :mod:`localdiff.decoding.vicinity`) the block and its
neighbours on dInfer's refresh schedule; blocks may start at multiples of ``block_length`` from the sequence start
(dInfer's ``start_block_align``, the policy's ``block_align``: the first block is shorter) — Dream's logit shift (the raw logit at i − 1 predicts token i), classifier-free
guidance, stopping (a finished block holding EOS ends the row; nothing after it is decoded or counted: Fast-dLLM issue
#10), events (a block is a "canvas" in :mod:`localdiff.events`) and stats, including the decoding order
(``stats.commit_step``). A decoder policy (:class:`localdiff.decoding.llada.LLaDA`,
:class:`localdiff.decoding.dream.Dream`) decides per step which masked positions to commit (``begin_window`` / ``step``).

The mask token's own logit is set to −inf before the policy sees the logits: upstream can "commit" a predicted mask
(the position stays masked and later blocks may fill it); trained models give it ~0 probability, random ones do not.

A step that commits nothing leaves x unchanged, so its logits are reused instead of recomputed (same tokens as
upstream, which runs the forward again; forwards count what was run).
"""

from __future__ import annotations

import time

import torch

from localdiff.decoding import arness
from localdiff.decoding.answer import Answer, kept_positions
from localdiff.decoding.llada import guided
from localdiff.decoding.request import Request
from localdiff.decoding.vicinity import VicinityRefresh
from localdiff.events import StepEvent


def block_plan(
    gen_length: int, block_length: int | None, steps: int | None, first: int | None = None
) -> list[tuple[int, int, int]]:
    """(offset, length, steps) per block of the answer: blocks of ``block_length`` (None or longer than the answer =
    one block; the last block is shorter when it does not divide; ``first``: the first block's length when it
    differs — aligned blocks), ``steps`` (None = one per token) split over the blocks as evenly as LLaDA's
    ``steps // num_blocks`` (the first ``steps % num_blocks`` blocks one more), ≥ 1."""
    bl = gen_length if block_length is None else min(block_length, gen_length)
    sizes = [min(first, gen_length)] if first else []
    while sum(sizes) < gen_length:
        sizes.append(min(bl, gen_length - sum(sizes)))
    nb = len(sizes)
    total = gen_length if steps is None else steps
    out = []
    for b, length in enumerate(sizes):
        out.append((sum(sizes[:b]), length, max(1, total // nb + (1 if b < total % nb else 0))))
    return out


def run(net, policy, req: Request, store=None):
    """Generate after a left-padded prompt; yields StepEvent (when ``req.emit_steps``), CanvasDone per block, then
    Done.

    Args:
        net: roles ``logits`` + ``window`` (:mod:`localdiff.arch.base`); ``net.shift_logits``.
        policy: LLaDA / Dream / NAP policy (module docstring); its optional ``template`` (LongTensor[max_new_tokens],
            mask id where masked) prefills the answer region.
        req: the generation (:class:`localdiff.decoding.request.Request`): ``ids`` LongTensor[B, P] the prompt (left
            padding must not be ``mask_id``) with ``mask`` BoolTensor[B, P] or None; ``max_new_tokens``: the
            answer's length in masks (LLaDA's gen_length); ``mask_id`` / ``eos_ids`` / ``pad_id`` (pad replaces
            tokens after EOS in CanvasDone, as in the canvas loop); ``cancel``: polled before every denoising step
            (True ends the generator there, no Done). From ``req.options``: ``block_length`` / ``steps`` (see
            :func:`block_plan`), ``kv_cache`` "none" | "prefix" | "dual" | "vicinity" (with ``prefix_look``,
            ``after_look``, ``warmup_steps``) and ``stop_at_eos`` (default True: end after the block where every
            row has an EOS; False: every block is decoded, for every row, as LLaDA ``generate.py`` and llama.cpp
            ``examples/diffusion``; the returned rows are the same, cut at each row's first EOS: later blocks never
            change earlier ones).
        store: where the prefix / dual caches' K/V live: ``store.place(per-layer (K, V) list)`` returns the
            indexable K/V with ``.prefix(end)`` (the engine passes :class:`localdiff.cache.window.WindowStore`: device
            budget, host tier); None = the list as returned, on the device.
    """
    o, st = req.options, req.stats
    block_length, cache, mask_id = o.block_length, o.kv_cache, req.mask_id
    stop_at_eos = getattr(o, "stop_at_eos", True)  # (NAP's canvas is one block: no such option)
    prompt_ids, prompt_mask = req.ids, req.mask
    dev = prompt_ids.device
    store = store if store is not None else _OnDevice()
    b, p = prompt_ids.shape
    g = req.max_new_tokens
    answer = Answer(req, b, dev)
    x = torch.cat([prompt_ids, torch.full((b, g), mask_id, dtype=torch.long, device=dev)], dim=1)
    if policy.template is not None:  # a canvas with prefilled tokens (NAP's tags)
        x[:, p:] = policy.template.to(dev)[:g]
    amask = (
        None
        if prompt_mask is None
        else torch.cat([prompt_mask.bool(), torch.ones(b, g, dtype=torch.bool, device=dev)], dim=1)
    )
    shift = 1 if getattr(net, "shift_logits", False) else 0
    commit = torch.zeros(b, g, dtype=torch.long, device=dev)  # global step at which each position was committed
    forwards, gstep = 0, 0
    align = policy.block_align and block_length is not None
    vic = None
    if cache == "vicinity":
        vic = VicinityRefresh(o.prefix_look, o.after_look, o.warmup_steps)
    for ci, (off, length, n_steps) in enumerate(
        block_plan(g, block_length, o.steps, block_length - p % block_length if align else None)
    ):
        start, end = p + off, p + off + length
        ws = max(0, end - block_length) if align and ci == 0 else start  # the block as dInfer's iterator has it
        if vic is not None:
            vic.begin_block(ci, ws, end)
        active = ~answer.finished if stop_at_eos else torch.ones_like(answer.finished)
        n_active = int(active.sum())  # rows still decoding (fixed within a block)
        all_active = n_active == b
        xv = x[:, start:end]  # a view: commits write x through it
        cv = commit[:, off : off + length]  # the block's commit steps (a view)
        masked = xv == mask_id if all_active else (xv == mask_id) & active[:, None]
        policy.begin_window(masked, n_steps, start)
        kv, logits, used = None, None, 0
        i = 0
        cap = n_steps + length if policy.parallel else n_steps  # parallel rules commit ≥ 1 per step
        while bool(masked.any()) and i < cap:
            if req.cancel is not None and req.cancel():
                return
            with torch.inference_mode():  # the step's ops skip autograd's dispatch (nothing needs gradients)
                if logits is None:
                    sel = masked if SKIP_COMMITTED else None
                    tp = time.perf_counter() if i == 0 else 0.0
                    logits, kv = _block_logits(
                        net,
                        policy,
                        x,
                        amask,
                        start,
                        end,
                        shift,
                        cache,
                        kv,
                        i == 0 if vic is None else (vic.next(), vic.window(x.shape[1])),
                        p,
                        mask_id,
                        store,
                        sel,
                        ws,
                    )
                    if i == 0:  # prefill time: the block's first pass (over the prompt and the blocks before
                        st.prefill_seconds += time.perf_counter() - tp  # it; the caches' refresh)
                    logits = _no_mask(logits, mask_id)
                    forwards += n_active
                    used += 1
                gstep += 1
                xb = xv
                x0, transfer = policy.step(logits, xb, masked, i)
                transfer &= masked
                if bool(transfer.any()):
                    torch.where(transfer, x0, xb, out=xv)  # xb is xv: elementwise, in place
                    cv.masked_fill_(transfer, gstep)
                    new_logits = None
                else:
                    new_logits = logits
                now = xv == mask_id if all_active else (xv == mask_id) & active[:, None]
            if req.emit_steps:  # outside inference mode: the consumer runs between yields
                yield _event(ci, used, n_steps, x[:, start:end], logits, xb, masked, mask_id)
            logits, masked = new_logits, now
            i += 1
        yield answer.end_block(ci, x[:, start:end], used)
        if answer.all_finished and stop_at_eos:
            break
    out = torch.cat(answer.blocks, dim=1)
    rows, order = [], []
    for r in range(b):
        keep = kept_positions(out[r].tolist(), answer.eos_ids, req.pad_id)[:g]
        rows.append([int(out[r, k]) for k in keep])
        order.append([int(commit[r, k]) for k in keep])
    st.forwards = forwards
    if cache != "none" and hasattr(store, "accounting"):
        st.cache = store.accounting()
    st.commit_step = order if b > 1 else order[0]
    st.arness = arness.summary(st.commit_step)
    yield answer.done(rows, "eos" if answer.all_finished else "length")


#: the LM head runs only on the block's still-masked positions (committed positions' logits are never read by the
#: policies; their rows come back as 0). Exact: the tokens are identical with and without (tests).
SKIP_COMMITTED = True


def _block_logits(net, policy, x, amask, start, end, shift, cache, kv, first, p, mask_id, store, sel=None, ws=None):
    """Position-aligned logits FloatTensor[B, L, V] of the block [start, end) and the (possibly refreshed) per-layer
    K/V (a :class:`WindowKV` placed in ``store``'s tiers). ``first``: the block's first step (the cache refresh: a
    full pass), or with ``cache`` "vicinity" the step's kind (:meth:`VicinityRefresh.next`). ``sel``: BoolTensor[B, L]
    positions whose logits are read (the LM head skips the others, which are 0), or None (all). ``ws``: where the
    cached windows start (≤ ``start``: an aligned block's part in the prompt is recomputed too; None = start)."""
    lo = start - shift  # with shifted logits the raw row lo predicts position start
    n = end - start
    d = start - (start if ws is None else ws)  # the block's rows within a window from ws

    def call(fn, rows, *args, select=sel, **kw):  # the head on `rows` (and `select`) when the net can, else sliced
        if getattr(net, "selects_rows", False):
            return fn(*args, rows=rows, select=select, **kw)
        out = fn(*args, **kw)
        return (out[0][:, rows[0] : rows[1]], out[1]) if kw.get("return_kv") else out[:, rows[0] : rows[1]]

    if cache == "vicinity":
        kind, (a, z) = first
        if kind == "full":
            return call(net.logits_full, (lo, lo + n), x, amask), kv
        if kind == "window":
            a = min(a, lo)
            return call(net.forward_window, (lo - a, lo - a + n), x[:, a:z], a, kv, amask), kv
        first = True  # a refresh: as the dual cache's
    if cache == "none" or first:
        if policy.cfg_scale > 0:
            un = x.clone()
            un[:, :p] = mask_id  # LLaDA: the prompt masked
            m2 = None if amask is None else torch.cat([amask, amask])
            both = call(
                net.logits_full,
                (lo, lo + n),
                torch.cat([x, un]),
                m2,
                select=None if sel is None else torch.cat([sel, sel]),
            )
            cond, unc = both.chunk(2)
            return guided(cond, unc, policy.cfg_scale), kv
        if cache == "none":
            return call(net.logits_full, (lo, lo + n), x, amask), kv
        raw, fresh = call(net.forward_window, (lo, lo + n), x, 0, None, amask, return_kv=True)
        return raw, store.place(fresh)
    if shift and policy.window_at_block:  # Fast-dLLM's Dream block loop (see there)
        return _shifted_in_window(call, net, x, amask, start, end, cache, kv, sel), kv
    w = lo - d
    if cache == "prefix":
        return call(net.forward_window, (d, d + n), x[:, w:], w, kv.prefix(w), amask), kv
    return call(net.forward_window, (d, d + n), x[:, w:end], w, kv, amask), kv  # dual


def _shifted_in_window(call, net, x, amask, start, end, cache, kv, sel):
    """Fast-dLLM v1's cached Dream pass (``generation_utils_block.py``): the window starts at the block (prefix:
    the block and the rest of the sequence; dual: the block) and its raw logits are shifted inside it — position
    start + j gets raw row j − 1, the block's first position the window's first row (that position is committed by
    the refresh pass; its logits are never read). Returns FloatTensor[B, end − start, V]."""
    n = end - start
    raw_sel = None
    if sel is not None:
        raw_sel = torch.zeros_like(sel)
        raw_sel[:, :-1] = sel[:, 1:]
        raw_sel[:, 0] |= sel[:, 0]
    win = x[:, start:] if cache == "prefix" else x[:, start:end]
    raw = call(
        net.forward_window, (0, n), win, start, kv.prefix(start) if cache == "prefix" else kv, amask, select=raw_sel
    )
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)


def _no_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``logits`` with the mask token's column at −inf: in place (the pass's logits are the loop's own; one op
    less per step), or a copy for an inference tensor outside inference mode (torch refuses to update those)."""
    if logits.is_inference() and not torch.is_inference_mode_enabled():
        return logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -torch.inf)
    logits.select(-1, mask_id).fill_(-torch.inf)
    return logits


class _OnDevice:
    """The approximate K/V kept as returned (no budget): ``place`` wraps the list, ``prefix`` cuts it."""

    def place(self, kv):
        return _Prefixable(kv)


class _Prefixable(list):
    def prefix(self, end: int) -> list:
        return [(k[:, :, :end], v[:, :, :end]) for k, v in self]


def _event(ci, step, max_steps, block, logits, before, masked, mask_id) -> StepEvent:
    """The StepEvent of one step (CPU tensors): canvas = the block (mask id where still masked), argmax = the
    predictions at positions masked before this step, accepted = committed by now; confidence and entropy of those
    predictions (1 and 0 at positions committed earlier, whose logits are not computed)."""
    probs = torch.softmax(logits[masked].float(), dim=-1)
    conf = torch.ones(masked.shape, dtype=probs.dtype, device=probs.device)
    ent = torch.zeros_like(conf)
    arg = torch.zeros(masked.shape, dtype=torch.long, device=probs.device)
    conf[masked], arg[masked] = probs.max(-1)
    ent[masked] = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    acc = block != mask_id
    none = torch.zeros_like(acc)
    return StepEvent(
        ci,
        step,
        max_steps,
        canvas_ids=block.clone().cpu(),
        argmax_ids=torch.where(masked, arg, before).cpu(),
        accepted=acc.cpu(),
        renoised=none.cpu(),
        reopened=none.cpu(),
        confidence=conf.cpu(),
        entropy=ent.cpu(),
    )
