"""Token editing (LLaDA2.1's T2T — token-to-token — editing, arXiv 2602.08676; Hub ``modeling_llada2_moe.py``
``generate`` of LLaDA2.1, diffusers ``BlockRefinementScheduler.step``): already committed tokens of the block being
denoised are re-decided when the model's top token at that position differs from it and is confident enough.

The counterpart of :mod:`localdiff.decoding.correction` (Re-Noising correction reopens locked tokens that lost
confidence; editing replaces them outright with a confident other token), with the same kind of bound: edits happen
only inside the current block (its prompt positions never), and once the block has no masks left at most
``max_post_steps`` extra steps run, each of which must edit something, so every block ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EditingConfig:
    """threshold: edit when the top token's probability exceeds it (None = editing off); max_post_steps: extra
    steps per block once it has no masks left."""

    threshold: float | None = None
    max_post_steps: int = 16

    @property
    def enabled(self) -> bool:
        return self.threshold is not None and self.threshold > 0


def edit_positions(
    tokens: torch.Tensor, editable: torch.Tensor, top: torch.Tensor, top_prob: torch.Tensor, cfg: EditingConfig
) -> torch.Tensor:
    """Positions whose committed token is replaced by this step's top token.

    Args:
        tokens: LongTensor[B, C] the block as it stands; editable: BoolTensor[B, C] committed, non-prompt positions.
        top / top_prob: LongTensor[B, C] this step's token per position and FloatTensor[B, C] its probability (the
            sampled token and its probability when temperature > 0).
        cfg: EditingConfig.
    Returns:
        BoolTensor[B, C] ⊆ editable: ``top_prob > threshold`` and ``top != tokens`` (all False when editing is off).
    """
    if not cfg.enabled:
        return torch.zeros_like(editable)
    return editable & (top_prob > cfg.threshold) & (top != tokens)


def block_finished(
    had_masks: torch.Tensor,
    masks_left: torch.Tensor,
    edited: torch.Tensor,
    post_steps: torch.Tensor,
    cfg: EditingConfig,
) -> torch.Tensor:
    """Rows whose block is final after this step (the Hub 2.1 loop's two exits, per row).

    Args:
        had_masks: BoolTensor[B] the block had masks before this step; masks_left: BoolTensor[B] it has after;
        edited: BoolTensor[B] this step edited something; post_steps: LongTensor[B] post-mask steps run so far
        (this one included).
    Returns:
        BoolTensor[B]: no masks left and either editing off, a post-mask step that edited nothing, or the
        ``max_post_steps`` budget spent.
    """
    if not cfg.enabled:
        return ~masks_left
    return ~masks_left & ((~had_masks & ~edited) | (post_steps >= cfg.max_post_steps))
