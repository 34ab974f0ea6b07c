"""The answer as a decoding loop builds it: the block ending every loop shares (docs/ARCHITECTURE.md, "The decoder
contract") and the final ``Done``.

Every loop (:mod:`localdiff.decoding.loop`, ``masked_loop``, ``fastdllm_v2``, ``slots_loop``; ``causal_loop`` for
the text and ``Done``) decodes blocks — canvases, semi-autoregressive blocks, serial blocks — and, when one is
final, hands it to :meth:`Answer.end_block`: sequence stopping (:func:`localdiff.decoding.stopping.finalize_canvas`:
a row ends at its first EOS, later tokens become pad), row 0's new text
(:class:`localdiff.decoding.detok.IncrementalText`, cut at ``max_new_tokens``), ``stats.canvases`` and the
``CanvasDone`` event. At the end :meth:`Answer.done` counts the returned tokens (:func:`count_tokens`, the one
place), decodes each row's text and gives the ``Done`` event.
"""

from __future__ import annotations

import time

import torch

from localdiff.decoding.detok import IncrementalText
from localdiff.decoding.request import Request
from localdiff.decoding.stopping import finalize_canvas
from localdiff.events import CanvasDone, Done, GenerationStats


class Answer:
    """The blocks of one generation's answer so far.

    Args:
        req: the generation (``eos_ids``, ``pad_id``, ``max_new_tokens``, ``decode``, ``stats``).
        batch: B, the rows that share the blocks. device: where ``finished`` and the EOS ids live.
    Attributes:
        finished: BoolTensor[B] rows that ended (an EOS, or a block of nothing but pad) in the blocks so far.
        blocks: the final blocks, LongTensor[B, L] each (L may differ per block), in order.
        eos_t: LongTensor[K] the EOS ids on ``device``, or None without any.
        t0: ``time.perf_counter()`` at the start (the stats' seconds).
    """

    def __init__(self, req: Request, batch: int, device) -> None:
        self.req = req
        self.eos_ids = list(req.eos_ids or ())
        self.pad_id = req.pad_id
        self.eos_t = torch.tensor(self.eos_ids, device=device) if self.eos_ids else None
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.blocks: list[torch.Tensor] = []
        self.made = 0  # generated positions of the blocks so far
        self.detok = IncrementalText(req.decode)  # row 0's text, block by block
        self.known: tuple | None = None  # (ids, text) of row 0 when the first block's text is all of it
        self.t0 = time.perf_counter()

    def finalize(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block with sequence stopping applied, ``finished`` updated) for LongTensor[B, L] ``block``, without
        recording it (a loop may test whether this step ends the generation first)."""
        return finalize_canvas(block, self.finished, self.eos_t, self.pad_id)

    def end_block(
        self,
        index: int,
        block: torch.Tensor | None,
        steps: int,
        finalized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> CanvasDone:
        """Record a final block; returns its CanvasDone (CPU tensors).

        Args:
            index: the block's index in the generation. block: LongTensor[B, L] as decoded (generated positions
                only), or None with ``finalized``: what :meth:`finalize` returned for it.
            steps: denoising steps the block used.
        The text is what the block adds to row 0's answer: its tokens within ``max_new_tokens``, up to the first
        EOS, pad removed; "" once row 0 had ended in an earlier block.
        """
        ended = bool(self.finished[0])
        final, self.finished = finalized if finalized is not None else self.finalize(block)
        self.blocks.append(final)
        self.req.stats.canvases += 1
        room = max(self.req.max_new_tokens - self.made, 0)  # the answer stops at max_new_tokens inside a block
        self.made += final.shape[1]
        text = ""
        if not ended:
            kept = strip_generated(final[0, :room], self.eos_ids, self.pad_id)
            text = self.detok.add(kept)
            if len(self.blocks) == 1 and not self.detok.pending:
                self.known = (kept, text)  # Done's text when the answer is this block
        return CanvasDone(index, final.cpu(), text, steps, self.finished.cpu())

    @property
    def all_finished(self) -> bool:
        """Whether every row has ended."""
        return bool(self.finished.all())

    def rows(self) -> list[list[int]]:
        """Per row, the ids returned: the blocks joined, up to and including the first EOS, pad removed, at most
        ``max_new_tokens`` (:func:`strip_generated`)."""
        b = self.finished.shape[0]
        if len(self.blocks) == 1:
            out = self.blocks[0]
        else:
            out = torch.cat(self.blocks, dim=1) if self.blocks else torch.zeros(b, 0, dtype=torch.long)
        return [
            strip_generated(out[r], self.eos_ids, self.pad_id, keep_eos=True)[: self.req.max_new_tokens]
            for r in range(b)
        ]

    def reason(self, rows: list[list[int]]) -> str:
        """ "length" only when the token limit cut an answer: a row that never ended, or one returned with
        ``max_new_tokens`` ids and no EOS (an EOS past the limit, in a block that ran on); else "eos" — every row
        ended by its EOS or by a canvas of nothing but pad before the limit (0 new tokens under a limit of 256 said
        "length")."""
        limit = self.req.max_new_tokens
        if self.all_finished and all((r and r[-1] in self.eos_ids) or len(r) < limit for r in rows):
            return "eos"
        return "length"

    def done(self, rows: list[list[int]], reason: str) -> Done:
        """The generation's Done event: ``rows`` (per row the ids returned: no pad, at most one EOS, its last id)
        counted into the stats (``stats.forwards`` must be set), each row's text decoded without its EOS (row 0's
        from the first block's CanvasDone when that was the whole answer, not decoded twice); ``reason``: "eos" |
        "length". One row: Done's text and ids are that row's, not lists."""
        st = self.req.stats
        count_tokens(st, rows, time.perf_counter() - self.t0)
        known = self.known if len(self.blocks) == 1 else None
        decode, texts = self.req.decode, []
        for r in rows:
            ids = r[:-1] if r and self.eos_ids and r[-1] in self.eos_ids else r
            texts.append(
                known[1] if known is not None and not texts and ids == known[0] else decode(ids) if decode else ""
            )
        one = len(rows) == 1
        return Done(texts[0] if one else texts, rows[0] if one else rows, st, reason)


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
    if pad_id is not None and out.count(pad_id):  # (an id that is also an EOS never comes before the cut)
        out = [t for t in out if t != pad_id]
    if keep_eos and cut < len(row):
        out.append(row[cut])
    return out
