"""dInfer's threshold parallel decoder (inclusionAI/dInfer ``python/dinfer/decoding/parallel_strategy.py``
``ThresholdParallelDecoder`` / ``get_transfer_index_threshold``; arXiv 2510.08666), a part of the ``llada`` policy
(``parallel_decoding threshold``).

Per step on a block: x0 = argmax of the logits (Gumbel-max of exp(logits64) / (−log u)^T when temperature > 0, as
dInfer's ``add_gumbel_noise``); confidence = softmax(logits, **float32**)[x0] at masked positions whose x0 is not the
mask token (``rm_mask``), −inf elsewhere; committed: every position with confidence ≥ min(max − 1e-5, τ) — the most
confident position (and any within 1e-5 of it) always, plus every confidence ≥ τ. It differs from Fast-dLLM's rule
(:func:`localdiff.decoding.parallel.threshold_transfer`) in the float32 softmax and the 1e-5 tie band.
"""

from __future__ import annotations

import torch

#: dInfer's entry points' default τ (``benchmarks/benchmark.py`` / ``evaluations/eval_dinfer.py`` ``--threshold``)
DEFAULT_THRESHOLD = 0.9


def proposals(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """x0 LongTensor[B, L]: argmax of ``logits`` FloatTensor[B, L, V], or of dInfer's Gumbel-noised
    exp(logits64) / (−log u)^T with u ~ U(0, 1) drawn in float64 from ``generator`` over the block when
    temperature > 0."""
    if temperature > 0:
        u = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=logits.device)
        return (logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature).argmax(-1)
    return logits.argmax(-1)


def threshold_transfer(
    logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, mask_id: int, threshold: float
) -> torch.Tensor:
    """dInfer's ``get_transfer_index_threshold`` decision: BoolTensor[B, L] ⊆ ``masked`` (BoolTensor[B, L]).

    Args: logits FloatTensor[B, L, V] (the confidences' softmax, float32); x0 LongTensor[B, L] proposals.
    """
    p = torch.softmax(logits.to(torch.float32), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
    cand = masked & (x0 != mask_id)
    conf = torch.where(cand, p, torch.tensor(-float("inf"), dtype=p.dtype, device=p.device))
    actual = (conf.max(dim=1).values - 1e-5).clamp(-1000, threshold).unsqueeze(-1)
    return (conf >= actual) & cand & masked


class ThresholdDecoder:
    """``parallel_decoding threshold``: per step :func:`threshold_transfer` at τ (``threshold``, default 0.9).

    Args: threshold τ or None (0.9); temperature; generator (Gumbel draws); mask_id.
    """

    def __init__(self, threshold: float | None, temperature: float, generator: torch.Generator | None, mask_id: int):
        self.threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        self.temperature, self.gen, self.mask_id = temperature, generator, mask_id

    def begin_block(self) -> None:
        """A new block (no state)."""

    def fuse(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """The logits the rule reads (threshold: unchanged; credit overrides)."""
        return logits

    def step(self, logits: torch.Tensor, xb: torch.Tensor, masked: torch.Tensor):
        """(x0 LongTensor[B, L] = ``xb`` where not masked, transfer BoolTensor[B, L] ⊆ ``masked``) from the block's
        ``logits`` FloatTensor[B, L, V]."""
        used = self.fuse(logits, masked)
        x0 = proposals(used, self.temperature, self.gen)
        transfer = threshold_transfer(used, x0, masked, self.mask_id, self.threshold)
        return torch.where(masked, x0, xb), transfer
