"""dInfer's credit decoder (inclusionAI/dInfer ``python/dinfer/decoding/parallel_strategy.py``
``CreditThresholdParallelDecoder``; arXiv 2510.08666), a part of the ``llada`` policy (``parallel_decoding credit``).

A per-block credit matrix C FloatTensor[B, L, V] (zeros when the block starts): each step C ← β·C (not at the first
step), then at each masked position the top-1 token of softmax(logits, float32) gains its probability^γ; the rule is
dInfer's threshold decoder (:mod:`localdiff.decoding.dinfer_threshold`) on the fused logits logits + α·log(1 + C) —
tokens proposed again and again gain confidence. Defaults (the class's): α = 0.7, γ = 0.2, β = 0.8.
"""

from __future__ import annotations

import torch

from localdiff.decoding.dinfer_threshold import ThresholdDecoder


class CreditDecoder(ThresholdDecoder):
    """``parallel_decoding credit``. Args: as :class:`ThresholdDecoder`, plus ``alpha`` (credit_alpha), ``gamma``
    (boost_gamma), ``beta`` (decay_beta)."""

    def __init__(self, threshold, temperature, generator, mask_id, alpha: float, gamma: float, beta: float):
        super().__init__(threshold, temperature, generator, mask_id)
        self.alpha, self.gamma, self.beta = alpha, gamma, beta
        self.credit: torch.Tensor | None = None

    def begin_block(self) -> None:
        """A new block: a new credit matrix at its first step (dInfer keys its matrices by the block's range)."""
        self.credit = None

    def fuse(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """dInfer's ``_apply_credit_fusion``: updates the block's credit with this step's ``logits``
        FloatTensor[B, L, V] at ``masked`` BoolTensor[B, L] positions; returns the fused logits (float32)."""
        if self.credit is None or self.credit.shape != logits.shape:
            self.credit = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        else:
            self.credit.mul_(self.beta)
        top_p, top_i = torch.softmax(logits.to(torch.float32), dim=-1).max(dim=-1)
        gain = top_p.pow(self.gamma) * masked.to(top_p.dtype)
        self.credit.scatter_add_(2, top_i.unsqueeze(-1), gain.unsqueeze(-1))
        return logits + self.alpha * torch.log(self.credit + 1)
