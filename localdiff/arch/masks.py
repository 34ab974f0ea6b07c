"""Attention masks of the two DiffusionGemma passes (BoolTensors, True = may attend).

* prefill rows (causal encoder role): key ``j`` ≤ query position, within the sliding window on sliding layers, not
  padding (a padded query still sees itself, so no row is empty);
* canvas rows (bidirectional decoder role): every canvas key, and the last ``window - 1`` cached keys on sliding
  layers (all of them on full-attention layers), not padding.

A *fused* pass computes prefill rows and the canvas rows that follow them in one forward (the first denoising step
of a canvas together with the prompt or the previous canvas); its mask stacks the two kinds of rows, and prefill rows
never see the canvas, so each row's result is the one the separate passes give.
"""
from __future__ import annotations

import torch


def prefill_mask(b: int, n: int, start: int, past_n: int, window: int | None, pad: torch.Tensor | None,
                 device) -> torch.Tensor:
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


def fused_mask(b: int, n: int, c: int, start: int, past_n: int, window: int | None, pad: torch.Tensor | None,
               device) -> torch.Tensor:
    """Mask of a fused pass: ``n`` prefill rows then ``c`` canvas rows, over ``past_n`` cached keys, the n new keys
    and the c canvas keys (after the n new tokens are cached, the canvas sees the last ``window - 1`` of
    past + new on sliding layers).

    Returns:
        BoolTensor[B, 1, n + c, past_n + n + c].
    """
    top = prefill_mask(b, n, start, past_n, window, pad, device)
    seen = past_n + n
    vis = seen if window is None else min(seen, window - 1)
    cm = (torch.arange(seen, device=device) >= seen - vis)[None, None, :].expand(b, c, seen)
    if pad is not None:
        cm = cm & pad[:, None, :]
    top = torch.cat([top, torch.zeros(b, n, c, dtype=torch.bool, device=device)], 2)
    bottom = torch.cat([cm, torch.ones(b, c, c, dtype=torch.bool, device=device)], 2)
    return torch.cat([top, bottom], 1)[:, None]
