"""Opt-in approximation of the canvas decoder (issue #24): a locked position keeps the distribution of the step
that locked it — its argmax, entropy, confidence and self-conditioning input — so later steps run the LM head and
the vocabulary-sized sampler work only on the positions still free (``reuse_locked``, needs ``threshold``).

Not reference-exact (the reference recomputes every position's distribution every step; locking itself is ours,
:mod:`localdiff.decoding.acceptance`): what it changes is measured by ``localdiff bench --only approx`` (the logit
error of a locked position's reused distribution against the fresh one on random models, and the embedded eval's
accuracy with and without it). Draws take random numbers for the accepted positions only, as on the fast path
without reuse.
"""

from __future__ import annotations

import torch

from localdiff.arch.soft_embedding import Probabilities
from localdiff.decoding.canvas_eb import Assessment, CanvasEB, draw_rows


class CanvasEBReuse(CanvasEB):
    """:class:`CanvasEB` whose next forward computes logits only at :meth:`head_rows` (always the fast path)."""

    def __init__(self, *args, fast: bool | None = None, **kw):
        super().__init__(*args, fast=True, **kw)
        self._rows: torch.Tensor | None = None
        self._own: torch.Tensor | None = None  # the self-conditioning buffer updated in place at head rows

    def head_rows(self) -> torch.Tensor | None:
        """BoolTensor[B, C] of the positions whose logits the next forward must compute (free positions of rows
        still denoising), or None for all (the canvas's first step, nothing locked yet)."""
        self._rows = None
        if self.sc is not None and self.locked is not None and bool(self.locked.any()):
            self._rows = ~self.locked & ~self.done[:, None]
        return self._rows

    def assess(self, logits: torch.Tensor, step: int) -> Assessment:
        """As :meth:`CanvasEB.assess`; with head rows, ``logits`` is FloatTensor[N, V] of those positions (row-major)
        and the other positions keep their argmax, entropy and confidence."""
        rows = self._rows
        if rows is None:
            return super().assess(logits, step)
        r = self.vocab_pass.run(logits, self.temps[self.max_steps - step + 1])
        full = [t.clone() for t in (self.argmax, self.entropy, self.conf)]
        for dst, src in zip(full, (r.argmax, r.entropy, r.confidence)):
            dst[rows] = src
        stop = self.stopper(full[0], None, full[1]) if not self.n_done else None
        return Assessment(None, full[0], full[1], stop, r.probs, full[2], r.rows)

    def _draw(self, probs, read: torch.Tensor, valid: bool) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            return super()._draw(probs, read, valid)
        draft = torch.zeros(self.b, self.c, dtype=torch.long, device=read.device)
        draft[rows] = draw_rows(probs, read[rows], self.gen)
        return draft

    def _carry_fast(self, a: Assessment, new_canvas: torch.Tensor) -> tuple:
        rows = self._rows
        if rows is None:
            out = super()._carry_fast(a, new_canvas)
        else:
            if self.n_done:
                new_canvas = torch.where(self.done[:, None], self.canvas, new_canvas)
            p16 = self.sc.probs
            if p16 is not self._own:  # the previous input may be a vocab-pass buffer: keep a copy of our own
                p16 = self._own = p16.to(self.sc_dtype, copy=True)
            p16[rows] = a.probs.to(self.sc_dtype)
            self.done |= self.stopper(a.argmax, None, a.entropy) if a.stop is None else a.stop
            self.sc, self.entropy = Probabilities(p16), a.entropy
            out = a.argmax, a.entropy, new_canvas
        self.conf = a.confidence
        return out


def policy_class(options) -> type[CanvasEB]:
    """The canvas policy class for ``options`` (:class:`localdiff.decoding.options.CanvasEBOptions`)."""
    return CanvasEBReuse if getattr(options, "reuse_locked", False) else CanvasEB
