"""Decoder policy ``sdar``: SDAR's block decoder (JetAstra/SDAR ``generate.py`` ``block_diffusion_generate``; SDAR,
arXiv 2510.06303) on the generic block loop (:mod:`localdiff.decoding.loop`).

Per block (``B`` = the model's block size): the canvas starts as mask tokens (the first block holds the prompt's
tail before them: blocks sit at absolute positions); the step schedule is upstream's ``get_num_transfer_tokens(B,
steps)`` (``B // steps`` per step, the first ``B % steps`` steps one more). Each step samples every position
(temperature / top-k / top-p as upstream; temperature 0 = the top token, with its probability under
``softmax(logits)`` as the confidence) and commits, among the still-masked positions:

* ``low_confidence_static``: the ``k`` most confident;
* ``low_confidence_dynamic``: every one with confidence > ``confidence_threshold`` when at least ``k`` are, else the
  ``k`` most confident;
* ``sequential``: the first ``k``;
* ``entropy_bounded`` (upstream commit 1c06c39; after the EB-Sampler, Ben-Hamu et al., arXiv 2505.24857): the masked
  positions sorted by the entropy of their sampling distribution, ascending (ties: the earlier position), and the
  longest prefix whose cumulative entropy stays below ``eb_threshold`` (nats; upstream's ``searchsorted(cumsum,
  eb_threshold, right=False)``), at least one; the quota ``k`` is not used, except that the block's last step
  (``steps``) commits every mask left.

Where we differ from upstream, on purpose: upstream takes ``topk(confidence, k)`` over the whole block with
``-inf`` at non-masked positions, so when ``k`` exceeds the masks left — the first block, whose prompt tail already
fills some positions, with ``steps`` < block size — it also "commits" positions that are not masks and overwrites
prompt tokens with the model's guesses. Here ``k`` is capped at the number of masks left in the row: only masks are
ever committed, the prompt is never touched, and every other case (every later block, ``steps`` = B, a prompt
ending on a block boundary) commits exactly upstream's positions. A row whose block is complete commits nothing
(upstream's batch-1 loop has no such rows). The mask token is never a prediction (its logit is set to −inf):
upstream can "commit" the mask id, leaving the position masked after its last scheduled step (and then fails on
the schedule's index). ``entropy_bounded`` as upstream wrote it cannot run: its branch never creates
``transfer_index`` (an UnboundLocalError at the first step), and it takes the "entropy" of ``x0_p`` — the sampled
tokens' probabilities, [batch, block] — summed over the block, one value shared by every position. We compute what
the names and the EB-Sampler say: each masked position's entropy −Σ_v p log p over the vocabulary; and where
upstream stops after ``steps + 1`` forwards with masks possibly left, our last step commits them.

Upstream's extra forward over a completed block (``store_kv=True``) is our fused prefill: the loop prefills the
block together with the next block's first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localdiff.decoding.acceptance import token_entropy
from localdiff.decoding.sampling import top_k_logits, top_p_logits
from localdiff.decoding.draws import categorical
from localdiff.decoding.options import SDAROptions


def transfer_schedule(block: int, steps: int) -> list[int]:
    """Upstream's ``get_num_transfer_tokens``: tokens to commit at each of ``steps`` steps (sums to ``block``)."""
    base, extra = divmod(block, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


@dataclass
class Assessment:
    """One step's logits before any draw: ``probs`` (FloatTensor[B, C, V] after temperature / top-k / top-p),
    ``argmax`` (LongTensor[B, C]: the canvas with every mask set to its top token — the block if it ended now),
    ``masked`` (BoolTensor[B, C]), ``k`` (this step's quota), ``entropy`` (FloatTensor[B, C], nats, of ``probs``) and
    ``eb`` (``entropy_bounded`` only: BoolTensor[B, C], the positions it commits; None otherwise).

    ``entropy`` is computed on first read (eight vocabulary-wide passes: only ``entropy_bounded`` and the step
    events read it, not a temperature-0 ``low_confidence_*`` step without events: about half of this per-request,
    unshared work in a batched ``serve`` step), from ``probs`` as it was then: the same values as when eager."""

    probs: torch.Tensor
    argmax: torch.Tensor
    masked: torch.Tensor
    k: int
    eb: torch.Tensor | None = None
    _entropy: torch.Tensor | None = field(default=None, repr=False)

    @property
    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            self._entropy = token_entropy(torch.log(self.probs.clamp_min(1e-30)))
        return self._entropy


class SDAR:
    """The ``sdar`` policy for one generation (module docstring).

    Args:
        options: :class:`localdiff.decoding.options.SDAROptions`.
        batch, block, mask_id, device: B, the block size C, the mask token id, the device of the canvases.
        generator: torch.Generator for the sampling draws (temperature > 0).
    """

    Options = SDAROptions
    #: top-k / top-p filter the logits at temperature 0 too (LLaDA2.0's generate; SDAR's refuses them there)
    filter_at_zero = False
    #: whether the constructor also takes the answer's budget and the EOS ids (``max_new_tokens=``, ``eos_ids=``)
    TAKES_BUDGET = False

    def __init__(
        self, options: SDAROptions, batch: int, block: int, mask_id: int, device, generator: torch.Generator | None
    ):
        self.o, self.b, self.c, self.mask_id, self.dev, self.gen = options, batch, block, mask_id, device, generator
        self.max_steps = options.steps or block
        self.schedule = transfer_schedule(block, self.max_steps)

    # -- per block ------------------------------------------------------------------------------------------------
    def begin_block(self, start: torch.Tensor | None = None) -> None:
        """A block of masks, or ``start`` (LongTensor[B, C]: the first block, prompt tail then masks)."""
        self.canvas = (
            start.to(self.dev).clone()
            if start is not None
            else torch.full((self.b, self.c), self.mask_id, dtype=torch.long, device=self.dev)
        )
        self.argmax = self.canvas
        self.done = ~(self.canvas == self.mask_id).any(-1)

    def model_inputs(self) -> tuple[torch.Tensor, None]:
        """(canvas LongTensor[B, C], no self-conditioning) for the next forward."""
        return self.canvas, None

    # -- per step -------------------------------------------------------------------------------------------------
    def assess(self, logits: torch.Tensor, step: int) -> Assessment:
        """Sampling distribution and top tokens of this step's logits (FloatTensor[B, C, V]); draws nothing."""
        x = logits.float().clone()
        x[..., self.mask_id] = -torch.inf
        o = self.o
        if o.temperature > 0 or self.filter_at_zero:
            if o.temperature > 0:
                x = x / o.temperature
            if o.top_k:
                x = top_k_logits(x, o.top_k)
            if o.top_p is not None and o.top_p < 1.0:
                x = top_p_logits(x, o.top_p)
        probs = torch.softmax(x, dim=-1)
        masked = self.canvas == self.mask_id
        argmax = torch.where(masked, probs.argmax(-1), self.canvas)
        a = Assessment(probs, argmax, masked, self.schedule[min(step, self.max_steps) - 1])
        if o.remasking_strategy == "entropy_bounded":
            a.eb = masked if step >= self.max_steps else entropy_bounded(a.entropy, masked, o.eb_threshold)
        return a

    def ends_block(self, a: Assessment, step: int) -> bool:
        """True when this step completes the block whatever the draws: temperature 0 and every row's masks fit in
        the step's quota (or it is the last step)."""
        if self.o.temperature > 0:
            return False
        if a.eb is not None:  # its positions do not depend on the draws
            return bool((a.eb == a.masked).all())
        return step == self.max_steps or bool((a.masked.sum(-1) <= a.k).all())

    def advance(self, a: Assessment) -> dict:
        """Pick tokens and commit the step's positions; returns the StepEvent fields (device tensors)."""
        x0, conf = self.draw(a)
        commit = a.eb if a.eb is not None else self._select(conf, a.masked, a.k)
        self.canvas = torch.where(commit, x0, self.canvas)
        self.argmax = self.canvas
        left = self.canvas == self.mask_id
        self.done = ~left.any(-1)
        return self._event(a, x0, conf, left, torch.zeros_like(left))

    def _event(
        self, a: Assessment, x0: torch.Tensor, conf: torch.Tensor, left: torch.Tensor, reopened: torch.Tensor
    ) -> dict:
        """The StepEvent fields after a step: ``left`` (BoolTensor[B, C]) the masks still open, ``reopened`` the
        committed positions this step changed (token editing; none here); ``entropy`` is a callable (the loop calls
        it only for a StepEvent: :attr:`Assessment.entropy`)."""
        return {
            "canvas_ids": self.canvas,
            "argmax_ids": torch.where(a.masked, x0, self.canvas),
            "accepted": ~left,
            "renoised": left,
            "reopened": reopened,
            "confidence": torch.where(a.masked, conf, 1.0),
            "entropy": lambda: a.entropy,  # read (computed) only when the loop builds a StepEvent
            "locked": None,
        }

    def draw(self, a: Assessment) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens LongTensor[B, C], their probabilities FloatTensor[B, C]): sampled from ``a.probs`` (temperature
        > 0, the policy's generator), else the top token and its probability."""
        if self.o.temperature > 0:
            x0 = categorical(a.probs.reshape(-1, a.probs.shape[-1]), self.gen).view(self.b, self.c)
            return x0, a.probs.gather(-1, x0[..., None]).squeeze(-1)
        conf, x0 = a.probs.max(-1)
        return x0, conf

    def _select(self, conf: torch.Tensor, masked: torch.Tensor, k: int) -> torch.Tensor:
        """BoolTensor[B, C] positions to commit: only masked ones, at most the masks left (module docstring)."""
        left = masked.sum(-1)
        kk = torch.clamp(left, max=k)
        if self.o.remasking_strategy == "sequential":
            rank = masked.long().cumsum(-1)
            return masked & (rank <= kk[:, None])
        score = torch.where(masked, conf, torch.tensor(-torch.inf, device=conf.device))
        order = torch.topk(score, min(k, self.c), dim=-1).indices
        top = _first_k_of(order, kk, self.c) & masked
        if self.o.remasking_strategy == "low_confidence_dynamic":
            high = masked & (conf > self.o.confidence_threshold)
            use_high = high.sum(-1) >= kk
            top = torch.where(use_high[:, None], high, top)
        return top

    def all_done(self) -> bool:
        return bool(self.done.all())


def entropy_bounded(entropy: torch.Tensor, masked: torch.Tensor, bound: float) -> torch.Tensor:
    """SDAR's ``entropy_bounded`` choice (module docstring): BoolTensor[B, C] of the masked positions whose
    ascending-entropy prefix sum stays below ``bound`` (nats), at least one per row with a mask; ``entropy``
    FloatTensor[B, C] (nats), ``masked`` BoolTensor[B, C]."""
    e = torch.where(masked, entropy, torch.tensor(torch.inf, device=entropy.device))
    ordered, order = torch.sort(e, dim=-1, stable=True)
    take = torch.cumsum(ordered, dim=-1) < bound
    take[:, 0] = True  # at least one (upstream's max(1, ...))
    take &= torch.isfinite(ordered)  # never past the masks left
    return torch.zeros_like(masked).scatter_(-1, order, take)


def _first_k_of(order: torch.Tensor, kk: torch.Tensor, c: int) -> torch.Tensor:
    """BoolTensor[B, c] with the first ``kk[r]`` indices of ``order[r]`` (LongTensor[B, k]) set."""
    take = torch.arange(order.shape[-1], device=order.device)[None, :] < kk[:, None]
    out = torch.zeros(order.shape[0], c, dtype=torch.bool, device=order.device)
    return out.scatter_(-1, order, take)
