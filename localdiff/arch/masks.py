"""Attention masks of the two DiffusionGemma passes (BoolTensors, True = may attend).

* prefill rows (causal encoder role): key ``j`` ≤ query position, within the sliding window on sliding layers, not
  padding (a padded query still sees itself, so no row is empty);
* canvas rows (bidirectional decoder role): every canvas key, and the last ``window - 1`` cached keys on sliding
  layers (all of them on full-attention layers), not padding.

A *fused* pass computes prefill rows and the canvas rows that follow them in one forward (the first denoising step
of a canvas together with the prompt or the previous canvas); each kind of row attends over exactly the keys (and
mask) its separate pass would use, so the attention is bit-identical to the two separate passes.
"""

from __future__ import annotations

import torch


def prefill_mask(
    b: int, n: int, start: int, past_n: int, window: int | None, pad: torch.Tensor | None, device
) -> torch.Tensor:
    """Mask of ``n`` prefill rows at positions ``start..start+n-1`` over ``past_n`` cached keys + the n new keys.

    Args:
        window: sliding window in tokens (None = full attention).
        pad: BoolTensor[B, past_n + n] (False = padding) or None when nothing is padding.
    Returns:
        BoolTensor[B, n, past_n + n] (expanded; do not write to it).
    """
    qpos = torch.arange(start, start + n, device=device)
    kpos = torch.arange(start - past_n, start + n, device=device)
    m = kpos[None, :] <= qpos[:, None]
    if window is not None:
        m = m & (kpos[None, :] > qpos[:, None] - window)
    m = m[None].expand(b, n, past_n + n)
    if pad is not None:
        m = (m & pad[:, None, :]) | (kpos[None, :] == qpos[:, None])[None]
    return m


def canvas_keys(
    b: int, seen: int, c: int, window: int | None, pad: torch.Tensor | None, device
) -> tuple[int, torch.Tensor | None]:
    """Keys of ``c`` canvas rows after ``seen`` cached keys: the last ``window - 1`` of them on sliding layers (all on
    full-attention layers), then the whole canvas.

    Args:
        pad: BoolTensor[B, seen] (False = padding) or None when nothing is padding.
    Returns:
        (lo, mask): the canvas rows read keys ``lo:`` of [cached ; canvas]; mask BoolTensor[B, 1, 1, seen - lo + c]
        or None when nothing is padding (attend to all).
    """
    lo = seen - (seen if window is None else min(seen, window - 1))
    if pad is None:
        return lo, None
    return lo, torch.cat([pad[:, lo:], torch.ones(b, c, dtype=torch.bool, device=device)], 1)[:, None, None, :]
