"""The DFlash draft model (arXiv 2602.06036; z-lab/dflash ``dflash/model.py``: ``DFlashDraftModel``,
``Qwen3DFlashAttention``, ``Qwen3DFlashDecoderLayer``): a few Qwen3 decoder layers that draft a whole block in one
non-causal pass, conditioned on the target's hidden states.

One pass (:meth:`DFlashDraft.draft`), as upstream:

* context ``c = hidden_norm(fc(features))``: ``features`` Tensor[B, m, k·H] are the target's outputs of the layers
  ``target_layer_ids`` at the m positions not yet in the draft's cache (``extract_context_feature``);
* the block's hidden states start as the target's embeddings of the block ``[last token, mask × (n − 1)]``
  (× ``input_embedding_scale``);
* per layer: Q from the block (input_layernorm → q_proj → q_norm → RoPE at the block's positions); K/V from the
  concatenation [context ; block] projected by the same k_proj / v_proj (k_norm, RoPE at the context's then the
  block's positions; the context is *not* input-normed), after the cached K/V of earlier contexts; attention without
  a mask (non-causal); o_proj, residual, post_attention_layernorm → SwiGLU → residual;
* final norm, then the TARGET's LM head (× ``output_multiplier``, optional soft-capping).

The cache keeps the context K/V only: upstream appends context and block K/V and crops back to the context
(``_crop_to(past_key_values_draft, start)``); we append the context's and attend to the block's without storing
them — the same keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.base import ROLE_DRAFT, CheckpointRules
from localdiff.arch.dense import DecoderLayer, RMSNorm, apply_rope, inv_freq, rope_cos_sin
from localdiff.arch.dflash_spec import DFlashConfig


class DFlashDraft(nn.Module):
    """``layers`` (Qwen3 :class:`localdiff.arch.dense.DecoderLayer`), ``fc`` Linear[k·H → H], ``hidden_norm``,
    ``norm``; ``config``: :class:`localdiff.arch.dflash_spec.DFlashConfig`."""

    roles = frozenset({ROLE_DRAFT})

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.device("cpu"):
            self._inv_freq = inv_freq(cfg.rope_parameters, cfg.head_dim)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def cache_layout(self, block_len: int = 64) -> dict:
        """``localdiff.cache.kv.KVCache`` keyword arguments for the context K/V (full-attention layers)."""
        n, c = self.config.num_hidden_layers, self.config
        return {
            "layer_windows": [None] * n,
            "block_len": max(block_len, c.block_size),
            "layer_heads": [(c.head_dim, c.num_key_value_heads)] * n,
        }

    def embed(self, ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """The block's input: the target's embeddings of ``ids`` LongTensor[B, n] × ``input_embedding_scale``."""
        e = F.embedding(ids, embed_weight)
        s = self.config.input_embedding_scale
        return e if s == 1.0 else e * s

    def head(self, h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Draft hidden Tensor[B, n, H] → fp32 logits through the target's LM head (``compute_logits``)."""
        logits = F.linear(h, head_weight)
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits.float()

    @torch.inference_mode()
    def draft(
        self,
        block_embeds: torch.Tensor,
        features: torch.Tensor,
        cache,
        head_weight: torch.Tensor | None,
        feature_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft pass (module docstring).

        Args:
            block_embeds: Tensor[B, n, H], the block's input (:meth:`embed`).
            features: Tensor[B, m, k·H] target features of the m positions after what ``cache`` holds (m ≥ 0).
            cache: the draft's :class:`localdiff.arch.base.BlockCache`; the context's K/V are appended and
                committed (positions ``cache.seq_len .. + m − 1``); the block sits at the m + n positions after.
            head_weight: the target's LM head matrix Tensor[V, H]; None returns the final-normed hidden states.
            feature_ids: LongTensor[B, m], the tokens of those positions (recorded by the cache) or None.
        Returns:
            FloatTensor[B, n, V] fp32 logits of every block position (position 0 is the known token; the loop
            uses 1..n−1), or the hidden states Tensor[B, n, H] when ``head_weight`` is None.
        """
        b, n, _ = block_embeds.shape
        m = features.shape[1]
        cos, sin = rope_cos_sin(self._inv_freq, cache.seq_len, m + n, block_embeds.device)
        ids = (
            feature_ids if feature_ids is not None else torch.zeros(b, m, dtype=torch.long, device=block_embeds.device)
        )
        with cache.writing(ids):
            h = self._stack(block_embeds, features, (cos[m:], sin[m:]), (cos, sin), None, cache)
        return h if head_weight is None else self.head(h, head_weight)

    def hidden_masked(
        self, block_embeds: torch.Tensor, features: torch.Tensor, block_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Uncached pass over several blocks at once (training; autograd allowed): ``block_embeds`` Tensor[B, N, H]
        at positions ``block_pos`` LongTensor[B, N], ``features`` Tensor[B, T, k·H] at positions 0..T−1, ``mask``
        Bool[B, 1, N, T + N] (True = may attend: a block reads the context before its first position and itself,
        as the cached :meth:`draft` does). Returns final-normed hidden Tensor[B, N, H]."""
        t = features.shape[1]
        ctx_pos = torch.arange(t, device=block_pos.device).expand(block_pos.shape[0], t)
        q = self._tables(block_pos)
        k = self._tables(torch.cat([ctx_pos, block_pos], 1))
        return self._stack(block_embeds, features, q, k, mask, None)

    def _tables(self, pos: torch.Tensor):
        """RoPE (cos, sin) Tensor[B, 1, L, D] for positions LongTensor[B, L]."""
        f = pos.float()[..., None] * self._inv_freq.to(pos.device)
        emb = torch.cat([f, f], -1)[:, None]
        return emb.cos(), emb.sin()

    def _stack(self, x, features, rq, rk, mask, cache):
        """The draft layers (module docstring): queries from x, keys/values from [context ; x] after the cached
        ones (``cache``: context K/V appended), then the final norm."""
        b, n, _ = x.shape
        m = features.shape[1]
        ctx = self.hidden_norm(self.fc(features)) if m else None
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_norm(att.q_proj(h).view(b, n, att.heads, att.head_dim)).transpose(1, 2)
            q = apply_rope(q, *rq)
            src = h if ctx is None else torch.cat([ctx, h], 1)
            k = att.k_norm(att.k_proj(src).view(b, m + n, att.kv_heads, att.head_dim)).transpose(1, 2)
            k = apply_rope(k, *rk)
            v = att.v_proj(src).view(b, m + n, att.kv_heads, att.head_dim).transpose(1, 2)
            kk, vv = (k, v)
            if cache is not None:
                if cache.visible_len(i):
                    kk, vv = cache.with_canvas(i, k, v)
                if m:
                    cache.append(i, k[:, :, :m], v[:, :, :m])
            x = layer.ffn(x + att.attend(q, kk, vv, mask))
        return self.norm(x)


def checkpoint_names(local: str) -> list[str]:
    """The draft checkpoints name tensors as our module does (``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``);
    ``model.``-prefixed names are accepted too."""
    return [local, "model." + local]


def keeps_checkpoint_dtype(local: str) -> bool:
    """No tensor keeps the checkpoint dtype when ``dtype=`` asks for another."""
    return False


#: what a DFlash draft checkpoint may hold unread (:class:`localdiff.arch.base.CheckpointRules`): rotary caches
#: only (the draft reads the target's embeddings and LM head, so a draft checkpoint holding its own is refused)
CHECKPOINT_RULES = CheckpointRules()


MODEL_CLASS = DFlashDraft
