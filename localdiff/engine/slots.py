"""Runner of the slots family (ReFusion, arXiv 2512.13586): no cache between generations (the reordered K/V buffer
lives inside one generation), :class:`localdiff.decoding.refusion.Refusion` per prompt row.

Events: one ``StepEvent`` per plan-and-fill round whose canvas is the current serial block (filled positions =
accepted, the rest masks) and whose ``slots`` says which slots were picked (index order), how they were filled
(global verify or parallel infill) and which were committed (commit order); one ``CanvasDone`` per serial block
(a block is final once all its slots are filled: tokens in position order, pad after the first EOS and where a slot
was dropped); ``Done`` with the answer in position order up to the first EOS, at most ``max_new_tokens``, and
``stats.commit_step`` = the round at which each returned token was committed (ARness). A batch runs row by row
(upstream decodes one prompt at a time); step events are emitted for row 0 only.
"""
from __future__ import annotations

import time

import torch

from localdiff.decoding.detok import IncrementalText
from localdiff.decoding.loop import count_tokens, kept_positions, strip_generated
from localdiff.decoding.refusion import Refusion
from localdiff.decoding.stopping import finalize_canvas
from localdiff.engine import masked
from localdiff.errors import UsageError
from localdiff.events import CanvasDone, Done, StepEvent


def prepare(model) -> None:
    """Sets ``model.mask_token_id`` (the masked family's checks: :func:`localdiff.engine.masked.prepare`).

    Raises:
        CheckpointError: no mask_token_id in config.json, or pad id = mask id.
    """
    masked.prepare(model)


def new_cache(model, device_budget_bytes: int | None = None) -> None:
    """None: ReFusion's reordered K/V lives inside one generation."""
    if device_budget_bytes is not None and device_budget_bytes < 0:
        raise UsageError("device budget must be ≥ 0 bytes")
    return None


def stream(model, req):
    """Decode every prompt row with ReFusion; yields StepEvent / CanvasDone (row 0) and Done.

    Raises:
        UsageError: a cache passed in (nothing is kept across generations).
    """
    if req.cache is not None:
        raise UsageError("cache: ReFusion keeps no cache between generations (its reordered K/V cache lives "
                         "inside one generation)")
    t0 = time.perf_counter()
    st = req.stats
    eos, pad = list(model.eos_token_ids), model.pad_token_id
    outs, orders, reason = [], [], "length"
    for ri, prompt in enumerate(req.rows):
        dec = Refusion(model.net, req.options, model.mask_token_id, tuple(eos), req.generator)
        if not (yield from _row(dec, prompt, req, emit=ri == 0 and req.emit_steps, row0=ri == 0, eos=eos, pad=pad)):
            return                                      # cancelled (``req.cancel``): no Done
        st.forwards += dec.forwards
        row, order = _final(dec, req.max_new_tokens, eos, pad)
        outs.append(row)
        orders.append(order)
        if row and row[-1] in eos:
            reason = "eos"
    st.commit_step = orders if len(outs) > 1 else orders[0]
    count_tokens(st, outs, time.perf_counter() - t0)
    texts = [req.decode(strip_generated(r, eos, pad)) if req.decode else "" for r in outs]
    yield Done(texts[0] if len(outs) == 1 else texts, outs if len(outs) > 1 else outs[0], st, reason)


def _row(dec: Refusion, prompt, req, emit: bool, row0: bool, eos, pad):
    """One prompt row's rounds and finished blocks; returns False when ``req.cancel()`` (polled before every
    plan-and-fill round) asked to stop, else True."""
    o = req.options
    k = int(o.slot_size)
    filled: dict[int, int] = {}
    rounds: dict[int, int] = {}
    block, n_round, steps = 0, 0, 0
    finished = torch.zeros(1, dtype=torch.bool)
    eos_t = torch.tensor(eos) if eos else None
    detok = IncrementalText(req.decode)               # the text block by block
    rounds_left = dec.run(list(prompt), req.max_new_tokens)
    while True:
        if req.cancel is not None and req.cancel():
            return False
        tp = time.perf_counter()
        info = next(rounds_left, None)                  # (the round runs here)
        if n_round == 0:                                # the first round passes over the prompt too: prefill
            req.stats.prefill_seconds += time.perf_counter() - tp
        if info is None:
            break
        bl = dec.gen_length // int(o.serial_num_blocks)
        while info.block > block:                       # blocks before this round's are final
            yield from _block_done(dec, block, bl, filled, steps, row0, req, finished, eos_t, pad, detok)
            block, steps = block + 1, 0
        n_round += 1
        steps += 1
        _record(dec, info, filled, rounds, n_round)
        dec.rounds = rounds
        if emit:
            yield _event(dec, info, block, bl, k, filled, steps)
    bl = dec.gen_length // int(o.serial_num_blocks)
    dec.rounds = rounds
    yield from _block_done(dec, block, bl, filled, steps, row0, req, finished, eos_t, pad, detok)
    return True


def _record(dec, info, filled, rounds, n_round) -> None:
    """Positions (answer-relative) filled by this round → token, and → round number."""
    c, p = dec.cache, dec.prompt_len
    n = len(info.tokens)
    for pos, t in zip(c.positions[len(c.positions) - n:], c.token_ids[len(c.token_ids) - n:]):
        filled[pos - p] = t
        rounds[pos - p] = n_round


def _canvas(filled, lo, bl, fill_id):
    return torch.tensor([[filled.get(lo + j, fill_id) for j in range(bl)]])


def _event(dec, info, block, bl, k, filled, step) -> StepEvent:
    lo = block * bl
    ids = _canvas(filled, lo, bl, dec.mask_id)
    acc = torch.tensor([[lo + j in filled for j in range(bl)]])
    none = torch.zeros_like(acc)
    first = lo // k
    slots = {"slot_size": k, "picked": [s - first for s in info.picked], "how": info.how,
             "committed": [s - first for s in info.committed]}
    ones = acc.float()
    return StepEvent(block, step, max(step, bl // k), ids, ids.clone(), acc, none, none.clone(), ones,
                     torch.zeros_like(ones), slots=slots)


def _block_done(dec, block, bl, filled, steps, row0, req, finished, eos_t, pad, detok: IncrementalText):
    if not row0:
        return
    fill = pad if pad is not None else dec.mask_id
    ids = _canvas(filled, block * bl, bl, fill)
    done_before = bool(finished[0])
    final, now = finalize_canvas(ids, finished, eos_t, pad)
    finished.copy_(now)
    req.stats.canvases += 1
    eos = list(eos_t.tolist()) if eos_t is not None else []
    room = max(req.max_new_tokens - block * bl, 0)     # the answer stops at max_new_tokens inside a block too
    text = detok.add(strip_generated(final[0, :room], eos, pad)) if not done_before else ""
    yield CanvasDone(block, final.cpu(), text, steps, now.cpu())


def _final(dec: Refusion, max_new: int, eos, pad) -> tuple[list[int], list[int]]:
    """The returned ids (position order, up to and including the first EOS, at most max_new) and their rounds."""
    pairs = [(pos, t) for pos, t in dec.answer_positions() if pos < max_new]
    toks = [t for _, t in pairs]
    keep = kept_positions(toks, eos, pad)
    rounds = getattr(dec, "rounds", {})
    return [toks[i] for i in keep], [int(rounds.get(pairs[i][0], 0)) for i in keep]
