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
"""
from __future__ import annotations

import torch

from localdiff.decoding import parallel
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


def predictions(logits: torch.Tensor, temperature: float, remasking: str, gen: torch.Generator,
                masked: torch.Tensor, base: torch.Tensor | None = None):
    """LLaDA's per-position proposal and confidence (``generate.py``) at the ``masked`` positions: x0 = argmax of the
    logits, with Gumbel-max noise in float64 when ``temperature`` > 0 (``add_gumbel_noise``); confidence =
    softmax(logits, float64)[x0] (``low_confidence``) or uniform noise (``random``). Vocab-sized work runs on the
    masked rows only (the others are never read; their logits may not be computed); the noise is still drawn over
    the whole block, in upstream's shape and order.

    Args: logits FloatTensor[B, L, V]; masked BoolTensor[B, L]; base LongTensor[B, L] or None: x0's values where
        not masked (None = 0) — the block itself, so the caller needs no ``where`` (a step runs few, small ops: on the
        CPU each costs more than its arithmetic).
    Returns: (x0 LongTensor[B, L], ``base`` (0) where not masked; confidence FloatTensor[B, L], −inf where not
        masked).
    """
    lm = logits[masked]
    cm = None
    if temperature > 0:
        u = torch.rand(logits.shape, dtype=torch.float64, generator=gen, device=logits.device)[masked]
        x0m = (lm.to(torch.float64).exp() / (-torch.log(u)) ** temperature).argmax(-1)
    elif remasking == "low_confidence":
        # greedy: the float64 softmax's max is the probability at the logits' argmax, and its index that argmax
        # (softmax is monotone; ties → the first index in both): one reduction instead of argmax + gather
        cm, x0m = torch.softmax(lm, dim=-1, dtype=torch.float64).max(-1)
    else:
        x0m = lm.argmax(-1)
    if base is None:
        base = torch.zeros(masked.shape, dtype=torch.long, device=logits.device)
    x0 = base.masked_scatter(masked, x0m)            # row-major, as boolean indexing
    if remasking == "low_confidence":
        if cm is None:
            cm = torch.softmax(lm, dim=-1, dtype=torch.float64).gather(-1, x0m[:, None]).squeeze(-1)
        conf = torch.full(masked.shape, -float("inf"), dtype=torch.float64, device=logits.device)
        conf.masked_scatter_(masked, cm)
    else:
        x0_p = torch.rand(masked.shape, generator=gen, device=logits.device)
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
    decide, steps are not capped by the schedule).
    """

    Options = LLaDAOptions

    def __init__(self, options: LLaDAOptions, generator: torch.Generator, mask_id: int):
        self.o, self.gen, self.mask_id = options, generator, mask_id
        self.cfg_scale = options.cfg_scale
        self.parallel = options.threshold is not None or options.factor is not None
        self.dinfer = _dinfer(options, generator, mask_id)
        self.parallel = self.parallel or self.dinfer is not None
        #: blocks at multiples of block_length from the sequence start (dInfer's BlockIterator, start_block_align)
        self.block_align = getattr(options, "start_block_align", False)

    def begin_block(self, masked: torch.Tensor, steps: int, offset: int = 0) -> None:
        """A new block: ``masked`` BoolTensor[B, L] (its masked positions), ``steps`` its step budget, ``offset`` its
        position in the sequence (unused here)."""
        self.steps = steps
        if self.dinfer is not None:
            self.dinfer.begin_block()
        self.schedule = list(zip(*schedule_rows(masked.sum(dim=1).tolist(), steps)))   # per step: k of each row

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor, i: int):
        """One step on a block. ``logits`` FloatTensor[B, L, V] (position-aligned), ``xb`` LongTensor[B, L] the block,
        ``masked`` BoolTensor[B, L] positions that may be committed, ``i`` 0-based step within the block.

        Returns:
            (x0 LongTensor[B, L] proposals (= ``xb`` where not masked), transfer BoolTensor[B, L] ⊆ masked).
        """
        if self.dinfer is not None:
            return self.dinfer.step(logits, xb, masked)
        x0, conf = predictions(logits, self.o.temperature, self.o.remasking, self.gen, masked, xb)
        if self.parallel:
            return x0, parallel.select(conf, masked, None, self.o.threshold, self.o.factor) & masked
        # the schedule's k never exceeds the row's masks (its ks sum to the block's masks; past the budget k = the
        # masks left), and confidence is −inf elsewhere: the top k are masked positions
        k = self.schedule[i] if i < self.steps else masked.sum(1).tolist()
        return x0, parallel.topk_transfer(conf, k)


def _dinfer(o: LLaDAOptions, generator: torch.Generator, mask_id: int):
    """The dInfer decoder part ``o.parallel_decoding`` names (None when off)."""
    kind = getattr(o, "parallel_decoding", None)
    if kind == "threshold":
        return ThresholdDecoder(o.threshold, o.temperature, generator, mask_id)
    if kind == "credit":
        return CreditDecoder(o.threshold, o.temperature, generator, mask_id, o.credit_alpha, o.boost_gamma,
                             o.decay_beta)
    if kind == "hierarchy":
        return HierarchyDecoder(o.threshold, o.low_threshold, o.temperature, generator)
    return None
