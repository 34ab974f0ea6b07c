"""The slots family's loop (ReFusion, arXiv 2512.13586): :class:`localdiff.decoding.refusion.Refusion` per prompt
row, with no cache between generations (the reordered K/V buffer lives inside one generation).

Events: one ``StepEvent`` per plan-and-fill round whose canvas is the current serial block (filled positions =
accepted, the rest masks) and whose ``slots`` says which slots were picked (index order), how they were filled
(global verify or parallel infill) and which were committed (commit order); one ``CanvasDone`` per serial block
(a block is final once all its slots are filled: tokens in position order, pad after the first EOS and where a slot
was dropped; :meth:`localdiff.decoding.answer.Answer.end_block`); ``Done`` with the answer in position order up to
the first EOS, at most ``max_new_tokens``, and ``stats.commit_step`` = the round at which each returned token was
committed (ARness). A batch runs row by row (upstream decodes one prompt at a time); step and block events are
emitted for row 0 only.
"""

from __future__ import annotations

import time

import torch

from localdiff.decoding.answer import Answer, kept_positions
from localdiff.decoding.refusion import Refusion
from localdiff.decoding.request import Request
from localdiff.events import StepEvent


def run(net, req: Request):
    """Decode every prompt row of ``req`` (``rows``, ``options``: ReFusionOptions, ``mask_id``, ``eos_ids``,
    ``pad_id``, ``generator``, ``cancel`` polled before every plan-and-fill round: True ends the generator there, no
    Done) with ReFusion on ``net`` (:class:`localdiff.arch.refusion.RefusionLM`); yields StepEvent / CanvasDone
    (row 0) and Done."""
    st = req.stats
    answer = Answer(req, 1, "cpu")  # row 0's blocks; Done for every row
    eos, pad = answer.eos_ids, req.pad_id
    outs, orders, reason = [], [], "length"
    for ri, prompt in enumerate(req.rows):
        dec = Refusion(net, req.options, req.mask_id, tuple(eos), req.generator)
        rounds = yield from _row(dec, prompt, req, answer if ri == 0 else None)
        if rounds is None:
            return  # cancelled (``req.cancel``): no Done
        st.forwards += dec.forwards
        row, order = _final(dec, rounds, req.max_new_tokens, eos, pad)
        outs.append(row)
        orders.append(order)
        if row and row[-1] in eos:
            reason = "eos"
    st.commit_step = orders if len(outs) > 1 else orders[0]
    yield answer.done(outs, reason)


def _row(dec: Refusion, prompt, req: Request, answer: Answer | None):
    """One prompt row's rounds and finished blocks (events only with ``answer``: row 0); returns the round number
    of each filled position (answer-relative position → round), or None when ``req.cancel()`` (polled before every
    plan-and-fill round) asked to stop."""
    o = req.options
    k = int(o.slot_size)
    emit = answer is not None and req.emit_steps
    filled: dict[int, int] = {}
    rounds: dict[int, int] = {}
    block, n_round, steps = 0, 0, 0
    rounds_left = dec.run(list(prompt), req.max_new_tokens)
    while True:
        if req.cancel is not None and req.cancel():
            return None
        tp = time.perf_counter()
        info = next(rounds_left, None)  # (the round runs here)
        if n_round == 0:  # the first round passes over the prompt too: prefill
            req.stats.prefill_seconds += time.perf_counter() - tp
        if info is None:
            break
        bl = dec.gen_length // int(o.serial_num_blocks)
        while info.block > block:  # blocks before this round's are final
            yield from _block_done(dec, answer, block, bl, filled, steps, req.pad_id)
            block, steps = block + 1, 0
        n_round += 1
        steps += 1
        _record(dec, info, filled, rounds, n_round)
        if emit:
            yield _event(dec, info, block, bl, k, filled, steps)
    bl = dec.gen_length // int(o.serial_num_blocks)
    yield from _block_done(dec, answer, block, bl, filled, steps, req.pad_id)
    return rounds


def _record(dec, info, filled, rounds, n_round) -> None:
    """Positions (answer-relative) filled by this round → token, and → round number."""
    c, p = dec.cache, dec.prompt_len
    n = len(info.tokens)
    for pos, t in zip(c.positions[len(c.positions) - n :], c.token_ids[len(c.token_ids) - n :]):
        filled[pos - p] = t
        rounds[pos - p] = n_round


def _canvas(filled, lo, bl, fill_id):
    return torch.tensor([[filled.get(lo + j, fill_id) for j in range(bl)]])


def _event(dec, info, block, bl, k, filled, step) -> StepEvent:
    """The StepEvent of one round over serial block ``block`` (``bl`` positions, slots of ``k``)."""
    lo = block * bl
    ids = _canvas(filled, lo, bl, dec.mask_id)
    acc = torch.tensor([[lo + j in filled for j in range(bl)]])
    none = torch.zeros_like(acc)
    first = lo // k
    slots = {
        "slot_size": k,
        "picked": [s - first for s in info.picked],
        "how": info.how,
        "committed": [s - first for s in info.committed],
    }
    ones = acc.float()
    return StepEvent(
        block,
        step,
        max(step, bl // k),
        canvas_ids=ids,
        argmax_ids=ids.clone(),
        accepted=acc,
        renoised=none,
        reopened=none.clone(),
        confidence=ones,
        entropy=torch.zeros_like(ones),
        slots=slots,
    )


def _block_done(dec, answer: Answer | None, block, bl, filled, steps, pad):
    """Serial block ``block`` is final: its CanvasDone (row 0 only; unfilled positions read as pad, or masks
    without a pad id)."""
    if answer is None:
        return
    ids = _canvas(filled, block * bl, bl, pad if pad is not None else dec.mask_id)
    yield answer.end_block(block, ids, steps)


def _final(dec: Refusion, rounds: dict, max_new: int, eos, pad) -> tuple[list[int], list[int]]:
    """The returned ids (position order, up to and including the first EOS, at most max_new) and their rounds."""
    pairs = [(pos, t) for pos, t in dec.answer_positions() if pos < max_new]
    toks = [t for _, t in pairs]
    keep = kept_positions(toks, eos, pad)
    return [toks[i] for i in keep], [int(rounds.get(pairs[i][0], 0)) for i in keep]
