"""KV cache for block diffusion: the prompt and every finished canvas, per layer.

The model (``localdiff/arch``) talks to a cache only through this small interface:

* ``seq_len`` — tokens prefilled so far (absolute positions 0..seq_len-1), ``batch_size``.
* ``past(i)`` → (K, V) Tensors[B, Hkv, L, D] visible to layer i (sliding layers: the last ``window - 1`` tokens,
  as the reference's ``DynamicSlidingWindowLayer`` keeps), or None when empty.
* ``past_mask(i)`` → BoolTensor[B, L] (True = real token) for those positions, or None when nothing is padding.
* ``append(i, k, v)`` during prefill, then ``commit(n_tokens, new_mask)`` once all layers appended.
* ``with_canvas(i, k, v)`` → (K, V) of past + canvas for a denoising step, without changing the cache.
"""
from __future__ import annotations

import torch


class KVCache:
    """Contiguous per-layer KV cache (device tier only).

    Args:
        layer_windows: per layer, the sliding window in tokens, or None for full-attention layers.
    """

    def __init__(self, layer_windows: list[int | None], slack: int = 0):
        self.windows = list(layer_windows)
        self.slack = int(slack)  # extra tokens sliding layers retain so a chat can truncate a little (prefix reuse)
        self.k: list[torch.Tensor | None] = [None] * len(layer_windows)
        self.v: list[torch.Tensor | None] = [None] * len(layer_windows)
        self.mask: torch.Tensor | None = None  # BoolTensor[B, seq_len] or None when nothing is padding
        self.seq_len = 0
        self.batch_size = 0
        self.token_ids: list[list[int]] = []  # per row, the ids prefilled so far (for prefix reuse)

    # -- read ---------------------------------------------------------------------------------------------------
    def past(self, i: int):
        if self.k[i] is None:
            return None
        n = self.visible_len(i)
        return self.k[i][:, :, self.k[i].shape[2] - n:], self.v[i][:, :, self.v[i].shape[2] - n:]

    def visible_len(self, i: int) -> int:
        """Number of cached tokens layer i attends to (sliding layers: at most window - 1)."""
        if self.k[i] is None:
            return 0
        n, w = self.k[i].shape[2], self.windows[i]
        return n if w is None else min(n, w - 1)

    def past_mask(self, i: int) -> torch.Tensor | None:
        if self.mask is None:
            return None
        return self.mask[:, self.seq_len - self.visible_len(i):]

    def with_canvas(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Past K/V of layer i followed by the canvas' k, v: Tensor[B, Hkv, C, D] (cache unchanged)."""
        past = self.past(i)
        if past is None:
            return k, v
        return torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)

    # -- write --------------------------------------------------------------------------------------------------
    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append new tokens' k, v: Tensor[B, Hkv, T, D] to layer i (sliding layers keep the last window-1)."""
        if self.k[i] is not None:
            k = torch.cat([self.k[i], k], dim=2)
            v = torch.cat([self.v[i], v], dim=2)
        w = self.windows[i]
        keep = None if w is None else max(w - 1, 0) + self.slack
        if keep is not None and k.shape[2] > keep:
            k = k[:, :, k.shape[2] - keep:].contiguous()
            v = v[:, :, v.shape[2] - keep:].contiguous()
        self.k[i], self.v[i] = k, v

    def commit(self, n: int, new_mask: torch.Tensor | None, batch_size: int) -> None:
        """Advance by n tokens after every layer appended. new_mask: BoolTensor[B, n] or None (all real)."""
        if new_mask is not None and bool(new_mask.all()):
            new_mask = None
        if new_mask is not None or self.mask is not None:
            old = self.mask if self.mask is not None else torch.ones(batch_size, self.seq_len, dtype=torch.bool,
                                                                     device=new_mask.device if new_mask is not None else "cpu")
            nm = new_mask if new_mask is not None else torch.ones(batch_size, n, dtype=torch.bool, device=old.device)
            self.mask = torch.cat([old.to(nm.device), nm], dim=1)
        self.seq_len += n
        self.batch_size = batch_size

    def truncate(self, n: int) -> bool:
        """Drop every token from position n on. Returns False (cache unchanged) when a sliding layer no longer holds
        the window-1 tokens before n; the caller then starts over with a fresh cache."""
        if n >= self.seq_len:
            return True
        for i, w in enumerate(self.windows):
            if w is not None and self.k[i] is not None:
                held_from = self.seq_len - self.k[i].shape[2]
                if n - min(n, w - 1) < held_from:
                    return False
        for i in range(len(self.windows)):
            if self.k[i] is not None:
                drop = self.seq_len - n
                self.k[i] = self.k[i][:, :, :self.k[i].shape[2] - drop]
                self.v[i] = self.v[i][:, :, :self.v[i].shape[2] - drop]
        if self.mask is not None:
            self.mask = self.mask[:, :n]
        self.seq_len = n
        self.token_ids = [row[:n] for row in self.token_ids]
        return True

    # -- accounting ---------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by the cached K/V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def stats(self) -> dict:
        """Accounting for GenerationStats.cache."""
        b = self.nbytes()
        return {"device_bytes": b, "host_bytes": 0, "tokens": self.seq_len}

    def reset(self) -> None:
        """Forget everything (keep the layer layout)."""
        self.__init__(self.windows, self.slack)
