"""ReFusion (arXiv 2512.13586; GSAI-ML/ReFusion): a Qwen3 causal LM whose K/V cache holds tokens in GENERATION order
while RoPE keeps each token's TRUE position — the slots family's model.

Built on :class:`localdiff.arch.dense.DenseStack` (Qwen3 blocks). Causality follows the order tokens are fed /
cached, not their positions, exactly as ML-GSAI/ReFusion ``qwen3/modeling_qwen3_refusion.py`` (transformers' causal
mask over ``cache_position`` with explicit ``position_ids``). Two passes:

* ``logits_full(input_ids, attention_mask=None)`` — one uncached causal pass at positions 0..T−1 (the contract's
  ``logits`` role; also the model's plain autoregressive use).
* :meth:`RefusionLM.slot_pass` — the decoder's pass over a :class:`SlotKV` buffer: queries at arbitrary true
  positions, their fresh K/V written into the buffer at given rows, attention over the buffer's first ``width``
  rows under an explicit boolean visibility matrix. The ReFusion decoder (``localdiff.decoding.refusion``) expresses
  plan, global verify and the parallel infill of several slots through it: the committed prefix is ONE shared
  tensor (rows 0..L−1), each infill slot writes its own row range after it, so nothing is copied per slot.

:meth:`RefusionLM.forward_train` is the same math with autograd for the training recipe (any position ids,
causal in sequence order, key padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localdiff.arch.base import ROLE_LOGITS
from localdiff.arch.dense import DenseStack
from localdiff.arch.llama_base import CHECKPOINT_RULES  # noqa: F401  (contract name: the Llama / Qwen layout)
from localdiff.arch.llama_base import checkpoint_names, keeps_checkpoint_dtype  # noqa: F401  (the same layout)
from localdiff.arch.llama_base_spec import LlamaConfig


class SlotKV:
    """The ReFusion K/V buffer: per layer K and V Tensor[1, kv_heads, capacity, head_dim] (after RoPE at each
    token's true position), rows 0..``length``−1 committed in generation order; rows after them are scratch that a
    pass may write (plan / verify drafts, infill slots) and the decoder either commits (advancing ``length``) or
    overwrites. ``token_ids`` / ``positions``: the committed tokens and their true positions, in cache order."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, device, dtype) -> None:
        shape = (1, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.capacity, self.length = capacity, 0
        self.token_ids: list[int] = []
        self.positions: list[int] = []

    def commit(self, ids: list[int], positions: list[int]) -> None:
        """Rows ``length .. length+len(ids)−1`` (already written by a pass) become committed."""
        if self.length + len(ids) > self.capacity:
            raise ValueError(f"SlotKV: {self.length + len(ids)} rows exceed the capacity {self.capacity}")
        self.length += len(ids)
        self.token_ids += [int(t) for t in ids]
        self.positions += [int(p) for p in positions]

    def committed(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's committed (K, V) views Tensor[1, kv_heads, length, head_dim]."""
        return self.k[i][:, :, : self.length], self.v[i][:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes of the committed K/V (all layers)."""
        if not self.k:
            return 0
        per_row = self.k[0][:, :, :1].numel() * self.k[0].element_size() * 2 * len(self.k)
        return per_row * self.length

    @property
    def buffer_bytes(self) -> int:
        """Bytes allocated for the whole buffer (all layers, K and V)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def rope_at(inv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) Tensor[..., n, rot] for the integer ``positions`` LongTensor[..., n] (any order)."""
    freqs = positions.to(torch.float32)[..., None] * inv.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class RefusionLM(DenseStack):
    """ReFusion's Qwen3 causal LM (module docstring).

    ``config``: :class:`localdiff.arch.llama_base_spec.LlamaConfig`."""

    roles = frozenset({ROLE_LOGITS})

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self.config = cfg

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight())[..., : self.config.vocab_size].float()

    def _layers(self, x, cos, sin, mask, cache: SlotKV | None = None, rows=None, width: int = 0):
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
            if cache is not None:
                cache.k[i][:, :, rows] = k.to(cache.k[i].dtype)
                cache.v[i][:, :, rows] = v.to(cache.v[i].dtype)
                k, v = cache.k[i][:, :, :width].to(q.dtype), cache.v[i][:, :, :width].to(q.dtype)
            x = x + att.attend(q, k, v, mask)
            x = layer.ffn(x)
        return self.norm(x)

    @torch.inference_mode()
    def logits_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One causal pass at positions 0..T−1.

        Args:
            input_ids: LongTensor[B, T].
            attention_mask: Bool/LongTensor[B, T] key-padding mask (1 = real) or None.
        Returns:
            FloatTensor[B, T, V] fp32 logits; row t predicts token t + 1.
        """
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        keys = None if attention_mask is None else attention_mask.to(input_ids.device).bool()
        return self.forward_train(input_ids, pos, keys)

    def forward_train(
        self, input_ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal pass in sequence order with explicit true positions (autograd on; the training recipe's forward).

        Args:
            input_ids: LongTensor[B, T]; positions: LongTensor[B, T] (RoPE positions, any order).
            key_mask: BoolTensor[B, T] (True = real token) or None.
        Returns:
            FloatTensor[B, T, V] fp32 logits.
        """
        b, t = input_ids.shape
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        if key_mask is not None:
            keys = key_mask.bool()
            keys = keys | ~keys.any(1, keepdim=True)
            mask = mask & keys[:, None, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # rows seeing nothing (left padding) stay finite
        cos, sin = rope_at(self._inv_freq, positions)
        h = self._layers(self.embed_tokens(input_ids), cos[:, None], sin[:, None], mask)
        return self._logits(h)

    def new_slot_cache(self, capacity: int, device=None, dtype=None) -> SlotKV:
        """An empty :class:`SlotKV` of ``capacity`` rows, on the model's device and dtype unless given."""
        w = self.embed_tokens.weight
        a = self.config
        return SlotKV(
            a.num_hidden_layers, a.num_key_value_heads, a.head_dim, capacity, device or w.device, dtype or w.dtype
        )

    @torch.inference_mode()
    def slot_pass(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SlotKV, rows: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """One pass of the ReFusion decoder over ``cache``.

        Args:
            input_ids: LongTensor[1, n] the tokens (masks or drafts) fed, in feeding order.
            positions: LongTensor[n] their true positions (RoPE).
            cache: the :class:`SlotKV`; each token's K/V (every layer) is written at buffer row ``rows[j]``.
            rows: LongTensor[n] distinct buffer rows (< ``cache.capacity``).
            visible: BoolTensor[n, S]: query j attends to buffer rows s with ``visible[j, s]``; S = the pass's key
                width (≤ capacity, ≥ max(rows) + 1). Rows written by this pass are read back after the write.
        Returns:
            FloatTensor[1, n, V] fp32 logits (row j: the model's prediction at token j, unshifted).
        Raises:
            ValueError: shapes that do not match, or rows beyond the key width.
        """
        n = input_ids.shape[1]
        width = visible.shape[1]
        if positions.shape != (n,) or rows.shape != (n,) or visible.shape[0] != n:
            raise ValueError(f"slot_pass: ids [1, {n}] need positions [{n}], rows [{n}], visible [{n}, S]")
        if width > cache.capacity or int(rows.max()) >= width:
            raise ValueError(f"slot_pass: rows up to {int(rows.max())} / width {width} exceed the buffer")
        cos, sin = rope_at(self._inv_freq, positions.to(input_ids.device))
        h = self._layers(
            self.embed_tokens(input_ids),
            cos,
            sin,
            visible[None, None].to(input_ids.device),
            cache,
            rows.to(input_ids.device),
            width,
        )
        return self._logits(h)


# -- checkpoint names: the Qwen3 layout of GSAI-ML/ReFusion (``model.*``, ``lm_head.weight``), as the masked Qwen family
MODEL_CLASS = RefusionLM
