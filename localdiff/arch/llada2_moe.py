"""LLaDA2.x MoE (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini, -flash): the block family's
:class:`localdiff.arch.block.BlockLM` (the shared dense blocks of :class:`localdiff.arch.dense.DenseStack`: RMSNorm,
partial RoPE, SwiGLU, :class:`localdiff.arch.moe.SparseMoE` with the ``sigmoid_group`` router + a shared expert) with
a fused-QKV attention (:class:`FusedQKVAttention`).

Attention is *block-causal* with blocks aligned to absolute positions: token at position p is in block p // L
(L = ``block_size``: the Hub generate's ``block_length``, 32) and attends to every key in blocks ≤ its own —
bidirectional inside a block, causal across blocks (the Hub ``generate`` builds ``tril(ones(nb, nb))`` repeated
L × L). The K/V of a finished block never change, so they are cached exactly; the prompt's tail (prompt length mod L
tokens) shares its block with the first masks, so it is part of the first canvas, not of the prefill.

Roles (implemented by :class:`localdiff.arch.block.BlockLM`):

* ``logits_full(input_ids, attention_mask=None)`` — uncached, block-causal over the whole sequence (what the Hub
  ``generate`` runs every step).
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

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.base import CheckpointRules
from localdiff.arch.block import BlockLM
from localdiff.arch.dense import Attention, RMSNorm, apply_rope
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
        q, k, v = (
            self.query_key_value(x)
            .view(b, n, -1, self.head_dim)
            .split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        )
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA of q [B, heads, Lq, D] over k / v [B, kv_heads, Lk, D]; mask Bool broadcastable to [B, 1, Lq, Lk]
        (True = may attend) or None → ``dense`` output Tensor[B, Lq, H]."""
        return self.project(self.core(q, k, v, mask))

    def project(self, a: torch.Tensor) -> torch.Tensor:
        """``dense`` on :meth:`core`'s heads Tensor[B, Lq, heads·D] → Tensor[B, Lq, H]."""
        return self.dense(a)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attend` before ``dense``: Tensor[B, Lq, heads·D]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        b, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)


class LLaDA2MoE(BlockLM):
    """The LLaDA2.x model (module docstring): :class:`localdiff.arch.block.BlockLM` (block-causal roles over the exact
    block KV cache) with :class:`FusedQKVAttention` in every layer. ``config``:
    :class:`localdiff.arch.llada2_spec.LLaDA2Config` (``block_size`` = the loop's ``canvas_length``)."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__(cfg)
        for layer in self.layers:
            layer.self_attn = FusedQKVAttention(cfg)


# -- checkpoint names (the Hub layout of modeling_llada2_moe.py) ---------------------------------------------------
_RENAMES = (
    ("embed_tokens.", "word_embeddings."),
    (".self_attn.", ".attention."),
    (".mlp.expert_bias", ".mlp.gate.expert_bias"),
    (".shared_expert.", ".mlp.shared_experts."),
)


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


#: what a LLaDA2.x checkpoint may hold unread (:class:`localdiff.arch.base.CheckpointRules`): rotary caches;
#: ``lm_head.weight`` when it equals the tied embeddings; the fields that would read more tensors
CHECKPOINT_RULES = CheckpointRules(
    tied=((r"lm_head\.weight", "model.word_embeddings.weight"),),
    switches=(("use_qk_norm", True), ("use_bias", True), ("use_qkv_bias", True), ("tie_word_embeddings", False)),
)


MODEL_CLASS = LLaDA2MoE
