"""Which positions of a denoised canvas are accepted this step.

* Entropy bound (EB, arXiv 2505.24857; reference ``EntropyBoundSampler.accept_canvas``): sort positions by entropy
  and accept the longest prefix whose summed entropy minus its largest entropy is ≤ ``entropy_bound``.
* Confidence-gated locking (ours): positions whose top-1 probability ≥ τ (``threshold``) are locked — they keep
  their token in every later step of the canvas (only the Re-Noising correction may reopen them). With locking on,
  at least one new position is locked per step, so every canvas progresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptanceConfig:
    """entropy_bound: nats (> 0); threshold: τ in (0, 1] for locking, or None for no locking (reference sampler)."""

    entropy_bound: float = 0.1
    threshold: float | None = None


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats per position of FloatTensor[..., V] logits (same formula as torch Categorical)."""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(logp, dim=-1)
    return -(logp.clamp_(min=torch.finfo(logp.dtype).min) * p).sum(-1)  # logp is fresh: clamp in place


def entropy_bound_mask(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """EB acceptance: BoolTensor[B, C] from entropy FloatTensor[B, C] (positions with +inf entropy never accepted)."""
    sorted_e, order = torch.sort(entropy, dim=-1)
    sel = torch.cumsum(sorted_e, dim=-1) - sorted_e <= bound
    return torch.scatter(torch.zeros_like(sel), -1, order, sel)


def accept(
    entropy: torch.Tensor, confidence: torch.Tensor, locked: torch.Tensor | None, cfg: AcceptanceConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Acceptance for one step.

    Args:
        entropy: FloatTensor[B, C] (nats); confidence: FloatTensor[B, C] top-1 probabilities.
        locked: BoolTensor[B, C] positions locked in earlier steps (None without locking).
        cfg: AcceptanceConfig.
    Returns:
        (accepted BoolTensor[B, C] — positions taking this step's draft token —,
         newly_locked BoolTensor[B, C] or None without locking).
    """
    if cfg.threshold is None:
        return entropy_bound_mask(entropy, cfg.entropy_bound), None
    free = ~locked
    ent = entropy.masked_fill(locked, float("inf"))
    acc = entropy_bound_mask(ent, cfg.entropy_bound) & free
    new_lock = free & (confidence >= cfg.threshold)
    stuck = ~new_lock.any(-1) & free.any(-1)  # rows where nothing new would lock
    if bool(stuck.any()):
        best = confidence.masked_fill(~free, -1.0).argmax(-1)
        force = torch.zeros_like(new_lock).scatter_(-1, best[:, None], True) & stuck[:, None]
        new_lock |= force
    return acc | new_lock, new_lock
