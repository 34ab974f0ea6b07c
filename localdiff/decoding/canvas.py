"""Canvas initialisation and renoising with uniform noise over the vocabulary (DiffusionGemma's corruption).

Random draws happen in the reference's order and shapes (transformers ``EntropyBoundSampler``): one
``randint(0, V, (B, C))`` per canvas init and per renoise, from the given generator.
"""

from __future__ import annotations

import torch


def init_canvas(
    batch: int, length: int, vocab_size: int, device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A canvas of uniform random tokens: LongTensor[batch, length] with values in [0, vocab_size)."""
    return torch.randint(0, vocab_size, (batch, length), device=device, generator=generator)


def renoise(
    canvas: torch.Tensor, keep: torch.Tensor, vocab_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh uniform noise at every position not in ``keep``.

    Args:
        canvas: LongTensor[B, C]; keep: BoolTensor[B, C] (accepted or locked positions).
    Returns:
        (new canvas LongTensor[B, C], renoised mask BoolTensor[B, C] = ~keep).
    """
    noise = torch.randint(0, vocab_size, canvas.shape, device=canvas.device, generator=generator)
    return torch.where(keep, canvas, noise), ~keep
