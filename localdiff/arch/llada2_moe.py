"""LLaDA2.x MoE (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini, -flash): a block-diffusion LM built from the shared dense
blocks (:class:`localdiff.arch.dense.DenseStack`: RMSNorm, partial RoPE, SwiGLU, :class:`localdiff.arch.moe.SparseMoE`
with the ``sigmoid_group`` router + a shared expert) and a fused-QKV attention (:class:`FusedQKVAttention`).

Attention is *block-causal* with blocks aligned to absolute positions: token at position p is in block p // L
(L = ``block_length``, 32 on the Hub) and attends to every key in blocks ≤ its own — bidirectional inside a block,
causal across blocks (the Hub ``generate`` builds ``tril(ones(nb, nb))`` repeated L × L). The K/V of a finished block
never change, so they are cached exactly; the prompt's tail (prompt length mod L tokens) shares its block with the
first masks, so it is part of the first canvas, not of the prefill.

Roles:

* ``logits_full(input_ids, attention_mask=None, block_length=None)`` — uncached, block-causal over the whole
  sequence (what the Hub ``generate`` runs every step).
* ``prefill(input_ids, cache, attention_mask=None)`` — appends whole blocks (positions from ``cache.seq_len``; the
  caller keeps prefills block-aligned): each new token attends to the cache and to the new tokens of blocks ≤ its
  own.
* ``denoise(canvas_ids, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None)`` — the canvas
  (one block) attends to the whole cache, the prefill rows and itself; with ``prefill_ids`` those rows are prefilled
  in the same forward (the fused stage). No self-conditioning (the argument must be None).

Hub checkpoint names (``modeling_llada2_moe.py``): ``model.word_embeddings``, ``model.layers.N.attention.
{query_key_value,dense,query_layernorm,key_layernorm}``, ``model.layers.N.mlp.{gate,up,down}_proj`` (dense),
``model.layers.N.mlp.gate.{weight,expert_bias}``, ``model.layers.N.mlp.experts.E.*``, ``model.layers.N.mlp.
shared_experts.*``, ``model.layers.N.{input,post_attention}_layernorm``, ``model.norm``, ``lm_head``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.base import ROLE_DENOISE, ROLE_LOGITS, ROLE_PREFILL
from localdiff.arch.dense import Attention, DenseStack, RMSNorm, apply_rope, rope_cos_sin
from localdiff.arch.llada2_spec import LLaDA2Config


class FusedQKVAttention(Attention):
    """LLaDA2 attention: ``query_key_value`` Linear[H → (heads + 2·kv_heads)·D] (bias when ``cfg.qkv_bias``), split
    into q / k / v heads; per-head ``query_layernorm`` / ``key_layernorm`` (RMSNorm over D, before RoPE) when
    ``cfg.qk_norm``; partial RoPE; GQA SDPA (scale 1/sqrt(D)); ``dense`` Linear[heads·D → H] (bias when
    ``cfg.o_bias``). Same interface as :class:`localdiff.arch.dense.Attention` (``qkv`` / ``attend``)."""

    def __init__(self, cfg):
        nn.Module.__init__(self)
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.query_key_value = nn.Linear(h, (self.heads + 2 * self.kv_heads) * d, bias=cfg.qkv_bias)
        self.dense = nn.Linear(self.heads * d, h, bias=cfg.o_bias)
        self.query_layernorm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.key_layernorm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope_fp32 = False

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: Tensor[B, L, H] (normed) → q Tensor[B, heads, L, D], k / v Tensor[B, kv_heads, L, D], RoPE applied."""
        b, n, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, n, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA of q [B, heads, Lq, D] over k / v [B, kv_heads, Lk, D]; mask Bool broadcastable to [B, 1, Lq, Lk]
        (True = may attend) or None → ``dense`` output Tensor[B, Lq, H]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        b, _, n, _ = out.shape
        return self.dense(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


def block_causal_mask(q_start: int, n_q: int, k_start: int, n_k: int, block_length: int, device,
                      see_all_from: int | None = None) -> torch.Tensor:
    """BoolTensor[n_q, n_k] (True = may attend): query at absolute position ``q_start + i`` sees key at
    ``k_start + j`` when ``key // block_length <= query // block_length``; query rows from index ``see_all_from``
    on (the canvas of a fused pass) see every key."""
    qb = torch.arange(q_start, q_start + n_q, device=device) // block_length
    kb = torch.arange(k_start, k_start + n_k, device=device) // block_length
    m = kb[None, :] <= qb[:, None]
    if see_all_from is not None:
        m[see_all_from:] = True
    return m


class LLaDA2MoE(DenseStack):
    """The LLaDA2.x model (module docstring). ``config``: :class:`localdiff.arch.llada2_spec.LLaDA2Config`;
    ``config.canvas_length`` is the block length (what the block loop denoises per step)."""

    roles = frozenset({ROLE_LOGITS, ROLE_PREFILL, ROLE_DENOISE})

    def __init__(self, cfg: LLaDA2Config):
        super().__init__(cfg)
        for layer in self.layers:
            layer.self_attn = FusedQKVAttention(cfg)
        self.config = cfg

    @property
    def block_length(self) -> int:
        return self.config.block_length

    def cache_layout(self) -> dict:
        """KVCache keyword arguments: full attention on every layer, blocks of one block length, (D, kv_heads)."""
        c = self.config
        return {"layer_windows": [None] * c.num_hidden_layers, "slack": 0, "block_len": c.block_length,
                "layer_heads": [(c.head_dim, c.num_key_value_heads)] * c.num_hidden_layers}

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight()).float()

    @torch.inference_mode()
    def logits_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    block_length: int | None = None) -> torch.Tensor:
        """One uncached block-causal pass over positions 0..T-1.

        Args:
            input_ids: LongTensor[B, T]. attention_mask: Bool/LongTensor[B, T] key padding (1 = real) or None.
            block_length: block size L (default ``config.block_length``).
        Returns:
            FloatTensor[B, T, V] fp32 logits.
        """
        b, t = input_ids.shape
        m = block_causal_mask(0, t, 0, t, block_length or self.block_length, input_ids.device)[None, None]
        if attention_mask is not None:
            pad = attention_mask.to(input_ids.device).bool()
            m = (m & pad[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
        h, _ = self.run(input_ids, 0, m)
        return self._logits(h)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None) -> None:
        """Append whole blocks to ``cache`` (see the module docstring). input_ids: LongTensor[B, n];
        attention_mask: Bool/LongTensor[B, n] (1 = real) or None."""
        self._forward(input_ids, attention_mask, None, cache)

    @torch.inference_mode()
    def denoise(self, canvas_ids: torch.Tensor, cache, self_conditioning_logits=None,
                prefill_ids: torch.Tensor | None = None, prefill_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The canvas pass over the cache (fused with a prefill of ``prefill_ids`` when given).

        Args:
            canvas_ids: LongTensor[B, C] (one block: the prompt's tail and masks, or masks and committed tokens).
            cache: the block KV cache. prefill_ids / prefill_mask: LongTensor[B, n] + Bool[B, n] or None.
        Returns:
            FloatTensor[B, C, V] fp32 logits.
        Raises:
            ValueError: self-conditioning logits were given (LLaDA2 has none).
        """
        if self_conditioning_logits is not None:
            raise ValueError("LLaDA2 takes no self-conditioning logits")
        return self._forward(prefill_ids, prefill_mask, canvas_ids, cache)

    def _forward(self, ids, ids_mask, canvas, cache):
        n = 0 if ids is None else ids.shape[1]
        c = 0 if canvas is None else canvas.shape[1]
        x = self.embed_tokens(torch.cat([t for t in (ids, canvas) if t is not None and t.shape[1]], 1))
        b, dev = x.shape[0], x.device
        start = cache.seq_len
        cos, sin = rope_cos_sin(self._inv_freq, start, n + c, dev)
        new_mask = None if (ids_mask is None or not n) else ids_mask.to(dev).bool()
        if new_mask is not None and bool(new_mask.all()):
            new_mask = None
        masks: dict = {}
        with cache.writing(ids, new_mask) if n else contextlib.nullcontext():
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
                past_n = cache.visible_len(i)
                if n:
                    past = cache.past(i)
                    kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
                    cache.append(i, k[:, :, :n], v[:, :, :n])
                else:
                    kk, vv = cache.with_canvas(i, k, v)
                key = (past_n, cache.past_mask(i) is None)
                if key not in masks:
                    masks[key] = self._mask(b, n, c, start, past_n, cache.past_mask(i), new_mask, dev)
                x = x + att.attend(q, kk, vv, masks[key])
                x = layer.ffn(x)
        return self._logits(self.norm(x[:, n:])) if c else None

    def _mask(self, b, n, c, start, past_n, pm, new_mask, dev):
        """Bool[B or 1, 1, n + c, past_n + n + c] or None (nothing to hide): the past is visible to every row
        (except padding); prefill rows see new keys block-causally; canvas rows see everything."""
        m = None
        if n:
            m = torch.ones(n + c, past_n + n + c, dtype=torch.bool, device=dev)
            m[:, past_n:] = block_causal_mask(start, n + c, start, n + c, self.block_length, dev, see_all_from=n)
            m[:n, past_n + n:] = False
            m = m[None, None]
        if pm is None and new_mask is None:
            return m
        pad = torch.cat([pm.to(dev) if pm is not None else torch.ones(b, past_n, dtype=torch.bool, device=dev),
                         new_mask if new_mask is not None else torch.ones(b, n, dtype=torch.bool, device=dev),
                         torch.ones(b, c, dtype=torch.bool, device=dev)], 1)[:, None, None, :]
        m = pad if m is None else m & pad
        rows = torch.arange(n + c, device=dev)
        diag = torch.zeros(n + c, past_n + n + c, dtype=torch.bool, device=dev)
        diag[rows, past_n + rows] = True
        return m | diag[None, None]


# -- checkpoint names (the Hub layout of modeling_llada2_moe.py) ---------------------------------------------------
_RENAMES = (("embed_tokens.", "word_embeddings."), (".self_attn.", ".attention."),
            (".mlp.expert_bias", ".mlp.gate.expert_bias"), (".shared_expert.", ".mlp.shared_experts."))


def checkpoint_names(local: str) -> list[str]:
    """Hub tensor name for our ``local`` name (``lm_head.weight`` as is, the rest under ``model.``)."""
    if local.startswith("lm_head."):
        return [local]
    name = local
    for ours, theirs in _RENAMES:
        name = name.replace(ours, theirs)
    return ["model." + name]


def keeps_checkpoint_dtype(local: str) -> bool:
    """No tensor keeps the checkpoint dtype when ``dtype=`` asks for another."""
    return False


MODEL_CLASS = LLaDA2MoE
