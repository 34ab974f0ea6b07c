"""Re-Noising correction (ReMDM, arXiv 2503.00307; the seeds' "inject noise again into low-quality segments"):
reopen locked tokens that lost confidence or form an immediate repetition, so they are denoised again.

Bounded: at most ``max_reopens`` positions per canvas in total, so generation always terminates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CorrectionConfig:
    """enabled: run the pass; floor: reopen a locked token whose probability under the current step's
    (temperature-scaled) distribution is below this; repetition: also reopen the second token of an immediate
    repeat (x[i] == x[i-1]) among locked tokens; max_reopens: cap per canvas and row."""

    enabled: bool = False
    floor: float = 0.05
    repetition: bool = True
    max_reopens: int = 8


def correct(
    locked: torch.Tensor,
    tokens: torch.Tensor,
    probs_of_tokens: torch.Tensor,
    reopened_so_far: torch.Tensor,
    cfg: CorrectionConfig,
) -> torch.Tensor:
    """Positions to reopen this step.

    Args:
        locked: BoolTensor[B, C] currently locked; tokens: LongTensor[B, C] the locked tokens (canvas).
        probs_of_tokens: FloatTensor[B, C] probability of each current token under this step's distribution.
        reopened_so_far: LongTensor[B] reopens already spent in this canvas.
        cfg: CorrectionConfig.
    Returns:
        BoolTensor[B, C] ⊆ locked, with at most ``max_reopens - reopened_so_far`` positions per row (lowest
        probability first).
    """
    if not cfg.enabled:
        return torch.zeros_like(locked)
    bad = locked & (probs_of_tokens < cfg.floor)
    if cfg.repetition and tokens.shape[1] > 1:
        rep = torch.zeros_like(locked)
        rep[:, 1:] = (tokens[:, 1:] == tokens[:, :-1]) & locked[:, 1:] & locked[:, :-1]
        bad |= rep
    budget = (cfg.max_reopens - reopened_so_far).clamp(min=0)
    if not bool(bad.any()):
        return bad
    score = probs_of_tokens.masked_fill(~bad, float("inf"))
    order = score.argsort(dim=-1)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    return bad & (rank < budget[:, None])
