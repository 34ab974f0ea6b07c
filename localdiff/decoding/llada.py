"""Decoder policy ``llada``: LLaDA's masked-diffusion sampling (ML-GSAI/LLaDA ``generate.py``, arXiv 2502.09992) with
Fast-dLLM's parallel decoding (NVlabs/Fast-dLLM ``llada/generate.py``, arXiv 2505.22618).

Per block (the loop :mod:`localdiff.decoding.masked_loop` owns blocks, forwards, caches, stopping and events): the
block's step budget is split as ``get_num_transfer_tokens`` does (masked count // steps each step, the remainder one
more in the first steps). Per step: predictions x0 = argmax of the logits — with Gumbel-max noise in float64 when
``temperature`` > 0 (``add_gumbel_noise``: exp(logits) / (−log u)^T) — and a confidence per masked position:
softmax(logits, float64)[x0] (``low_confidence``) or uniform noise (``random``); then the schedule's k most confident
are committed, or Fast-dLLM's threshold / factor rule (:mod:`localdiff.decoding.parallel`) decides, or one of dInfer's
decoders (``parallel_decoding``: :mod:`~localdiff.decoding.dinfer_threshold`, :mod:`~localdiff.decoding.dinfer_credit`,
:mod:`~localdiff.decoding.dinfer_hierarchy`) makes the whole step's proposal and decision. Classifier-free
guidance (``cfg_scale``) is applied by the loop before the logits arrive here (``guided``).

The random numbers (``noise``). ``block`` (default): each step draws u, float64 [B, L, V], and for ``random``
remasking r, float32 [B, L], over the block only. ``upstream``: each step draws what the upstream function for the
options draws, from the same generator in the same order, and uses the block's part — so with ``seed=S`` the tokens
are those of upstream run after ``torch.manual_seed(S)`` (same device; a seed makes a ``torch.Generator`` on the
model's device, which draws as the default one seeded alike):

* ``kv_cache`` none, step schedule: LLaDA ``generate.py`` — u over the whole sequence [B, P + gen_length, V] (then r
  over [B, P + gen_length]) at every step, and every block runs all its steps: steps a block does not need (its
  masks fewer than its steps) still draw, and their draws are skipped when the next block begins;
* ``kv_cache`` none with ``threshold`` / ``factor``: Fast-dLLM ``generate`` — the same shapes, no idle steps;
* ``kv_cache`` prefix: ``generate_with_prefix_cache`` — the block's first step over the whole sequence, later steps
  over [B, P + gen_length − block start] and u twice (upstream adds noise once, unused, before
  ``get_transfer_index`` adds its own);
* ``kv_cache`` dual: ``generate_with_dual_cache`` — the first step over the whole sequence, later steps the block.

LLaDA's ``logits_eos_inf`` sets the EOS token's logit to −inf before anything reads the logits;
``confidence_eos_eot_inf`` does what ``generate.py`` (ML-GSAI/LLaDA at b7e6c35) does: once x0 is chosen, the
end-of-turn token's logit is −inf in the confidence softmax (its chained assignment also writes −inf into the noised
logits, which nothing reads after the argmax). The runner gives the ids (upstream hard-codes LLaDA-8B's 126081 and
126348): :func:`localdiff.engine.masked.eos_and_eot`.

Not reproduced: upstream's softmax for ``low_confidence`` in LLaDA ``generate.py`` runs in the logits' dtype (bf16
for the released checkpoints); ours is float64, as Fast-dLLM's — the same token unless two confidences tie in bf16.
"""

from __future__ import annotations

import torch

from localdiff.decoding import parallel
from localdiff.decoding.draws import uniform_rows
from localdiff.decoding.dinfer_credit import CreditDecoder
from localdiff.decoding.dinfer_hierarchy import HierarchyDecoder
from localdiff.decoding.dinfer_threshold import ThresholdDecoder
from localdiff.decoding.options import LLaDAOptions


def num_transfer_tokens(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's ``get_num_transfer_tokens``: LongTensor[B, steps], per row masked // steps each step, the first
    masked % steps steps one more. ``masked``: BoolTensor[B, L]."""
    return torch.tensor(schedule_rows(masked.sum(dim=1).tolist(), steps), dtype=torch.int64, device=masked.device)


def schedule_rows(counts: list[int], steps: int) -> list[list[int]]:
    """:func:`num_transfer_tokens` in Python ints: per row with ``counts[j]`` masks, the k of each of ``steps``."""
    return [[c // steps + (1 if s < c % steps else 0) for s in range(steps)] for c in counts]


def predictions(
    logits: torch.Tensor,
    temperature: float,
    remasking: str,
    gen: torch.Generator,
    masked: torch.Tensor,
    base: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    r: torch.Tensor | None = None,
    drop_in_confidence: int | None = None,
):
    """LLaDA's per-position proposal and confidence (``generate.py``) at the ``masked`` positions: x0 = argmax of the
    logits, with Gumbel-max noise in float64 when ``temperature`` > 0 (``add_gumbel_noise``); confidence =
    softmax(logits, float64)[x0] (``low_confidence``) or uniform noise (``random``). Vocab-sized work runs on the
    masked rows only (the others are never read; their logits may not be computed); the noise is still drawn over
    the whole block, in upstream's shape and order.

    Args: logits FloatTensor[B, L, V]; masked BoolTensor[B, L]; base LongTensor[B, L] or None: x0's values where
        not masked (None = 0) — the block itself, so the caller needs no ``where`` (a step runs few, small ops: on the
        CPU each costs more than its arithmetic).
        u: FloatTensor[B, L, V] float64 / r: FloatTensor[B, L]: the Gumbel uniforms / random remasking's numbers
        already drawn (``noise="upstream"``), or None to draw them here.
        drop_in_confidence: a token id whose logit is −inf in the confidence softmax only (after x0 is chosen:
            LLaDA's ``confidence_eos_eot_inf``), or None.
    Returns: (x0 LongTensor[B, L], ``base`` (0) where not masked; confidence FloatTensor[B, L], −inf where not
        masked).
    """
    lm = logits[masked]
    cm = None
    if temperature > 0:
        if u is None:
            u = torch.rand(logits.shape, dtype=torch.float64, generator=gen, device=logits.device)
        u = u[masked]
        x0m = (lm.to(torch.float64).exp() / (-torch.log(u)) ** temperature).argmax(-1)
    elif remasking == "low_confidence" and drop_in_confidence is None:
        # greedy: the float64 softmax's max is the probability at the logits' argmax, and its index that argmax
        # (softmax is monotone; ties → the first index in both): one reduction instead of argmax + gather
        cm, x0m = torch.softmax(lm, dim=-1, dtype=torch.float64).max(-1)
    else:
        x0m = lm.argmax(-1)
    if base is None:
        base = torch.zeros(masked.shape, dtype=torch.long, device=logits.device)
    x0 = base.masked_scatter(masked, x0m)  # row-major, as boolean indexing
    if remasking == "low_confidence":
        if cm is None:
            lc = (
                lm
                if drop_in_confidence is None
                else lm.index_fill(-1, torch.tensor([drop_in_confidence], device=lm.device), -torch.inf)
            )
            cm = torch.softmax(lc, dim=-1, dtype=torch.float64).gather(-1, x0m[:, None]).squeeze(-1)
        conf = torch.full(masked.shape, -float("inf"), dtype=torch.float64, device=logits.device)
        conf.masked_scatter_(masked, cm)
    else:
        x0_p = torch.rand(masked.shape, generator=gen, device=logits.device) if r is None else r
        conf = torch.where(masked, x0_p, torch.tensor(-float("inf"), dtype=x0_p.dtype, device=x0_p.device))
    return x0, conf


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """LLaDA's unsupervised classifier-free guidance: uncond + (scale + 1) · (cond − uncond)."""
    return uncond + (scale + 1) * (cond - uncond)


class LLaDA:
    """The ``llada`` policy for one generation.

    Args:
        options: :class:`LLaDAOptions`. generator: torch.Generator for Gumbel noise / random remasking.
        mask_id: the model's mask token id.
    Attributes the loop reads: ``cfg_scale`` (> 0: give guided logits), ``parallel`` (True: threshold / factor
    decide, steps are not capped by the schedule). ``length``: the sequence's length P + gen_length, which the runner
    sets (``noise="upstream"`` draws over it).
    """

    Options = LLaDAOptions
    template = None  # (the masked loop's policy attributes: decoding/protocols.WindowPolicy)
    window_at_block = False

    def __init__(self, options: LLaDAOptions, generator: torch.Generator, mask_id: int):
        self.o, self.gen, self.mask_id = options, generator, mask_id
        self.cfg_scale = options.cfg_scale
        self.parallel = options.threshold is not None or options.factor is not None
        self.length, self.span, self.idle = None, (0, 0), 0
        #: the EOS / EoT ids of logits_eos_inf / confidence_eos_eot_inf (the runner sets them)
        self.eos_id = self.eot_id = None
        self.dinfer = dinfer_decoder(options, generator, mask_id)
        self.parallel = self.parallel or self.dinfer is not None
        #: blocks at multiples of block_length from the sequence start (dInfer's BlockIterator, start_block_align)
        self.block_align = getattr(options, "start_block_align", False)

    def begin_window(self, masked: torch.Tensor, steps: int, offset: int = 0) -> None:
        """A new block: ``masked`` BoolTensor[B, L] (its masked positions), ``steps`` its step budget, ``offset`` its
        position in the sequence."""
        if self.idle and self.o.noise == "upstream":
            self._skip_idle_steps()
        self.steps, self.span = steps, (offset, offset + masked.shape[1])
        self.idle = steps if self.o.kv_cache == "none" and not self.parallel else 0
        if self.dinfer is not None:
            self.dinfer.begin_block()
        self.schedule = list(zip(*schedule_rows(masked.sum(dim=1).tolist(), steps)))  # per step: k of each row

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor, i: int):
        """One step on a block. ``logits`` FloatTensor[B, L, V] (position-aligned), ``xb`` LongTensor[B, L] the block,
        ``masked`` BoolTensor[B, L] positions that may be committed, ``i`` 0-based step within the block.

        Returns:
            (x0 LongTensor[B, L] proposals (= ``xb`` where not masked), transfer BoolTensor[B, L] ⊆ masked).
        """
        if self.o.logits_eos_inf and self.eos_id is not None:  # never predicted (LLaDA's logits_eos_inf)
            logits[..., self.eos_id] = -torch.inf
        if self.dinfer is not None:
            return self.dinfer.step(logits, xb, masked)
        u = r = None
        if self.o.noise == "upstream":
            u, r = self._upstream_draws(logits, i)
        self.idle = max(0, self.idle - 1)
        drop = self.eot_id if self.o.confidence_eos_eot_inf else None
        x0, conf = predictions(logits, self.o.temperature, self.o.remasking, self.gen, masked, xb, u, r, drop)
        if self.parallel:
            return x0, parallel.select(conf, masked, None, self.o.threshold, self.o.factor) & masked
        # the schedule's k never exceeds the row's masks (its ks sum to the block's masks; past the budget k = the
        # masks left), and confidence is −inf elsewhere: the top k are masked positions
        k = self.schedule[i] if i < self.steps else masked.sum(1).tolist()
        return x0, parallel.topk_transfer(conf, k)

    def _upstream_draws(self, logits: torch.Tensor, i: int):
        """(u, r) of step ``i`` as upstream draws them (module docstring), cut to the block: FloatTensor[B, L, V]
        float64 or None (temperature 0), FloatTensor[B, L] or None (``low_confidence``)."""
        (start, end), kv = self.span, self.o.kv_cache
        lo = 0 if kv == "none" or i == 0 else start
        hi = end if kv == "dual" and i > 0 else self.length
        b, v, dev = logits.shape[0], logits.shape[-1], logits.device
        self.shape = (b, v, dev)
        u = r = None
        if self.o.temperature > 0:
            if kv == "prefix" and i > 0:  # upstream's unused add_gumbel_noise
                uniform_rows((b, hi - lo, v), 0, 0, self.gen, dev)
            u = uniform_rows((b, hi - lo, v), start - lo, end - lo, self.gen, dev)
        if self.o.remasking == "random":
            r = torch.rand((b, hi - lo), generator=self.gen, device=dev)[:, start - lo : end - lo]
        return u, r

    def _skip_idle_steps(self) -> None:
        """Draw and drop the previous block's steps that LLaDA ``generate.py`` runs and this loop did not."""
        b, v, dev = self.shape
        for _ in range(self.idle):
            if self.o.temperature > 0:
                uniform_rows((b, self.length, v), 0, 0, self.gen, dev)
            if self.o.remasking == "random":
                torch.rand((b, self.length), generator=self.gen, device=dev)
        self.idle = 0


def dinfer_decoder(o, generator: torch.Generator, mask_id: int):
    """The dInfer decoder ``o.parallel_decoding`` names (None when off), shared by the ``llada`` and ``llada2``
    policies: ``o`` has ``parallel_decoding``, ``threshold``, ``temperature``, ``low_threshold``, ``credit_alpha``,
    ``boost_gamma``, ``decay_beta`` (:class:`LLaDAOptions` or
    :class:`localdiff.decoding.options_llada2.LLaDA2Options`). Returns an object with ``begin_block()`` and
    ``step(logits FloatTensor[B, L, V], block LongTensor[B, L], masked BoolTensor[B, L]) -> (x0, transfer)``."""
    kind = getattr(o, "parallel_decoding", None)
    if kind == "threshold":
        return ThresholdDecoder(o.threshold, o.temperature, generator, mask_id)
    if kind == "credit":
        return CreditDecoder(
            o.threshold, o.temperature, generator, mask_id, o.credit_alpha, o.boost_gamma, o.decay_beta
        )
    if kind == "hierarchy":
        return HierarchyDecoder(o.threshold, o.low_threshold, o.temperature, generator)
    return None
