"""DiffusionGemma's layer modules: Gemma 4 attention (q/k/v norms, per-layer-type RoPE, k = v on full-attention
layers), the layer's parallel dense MLP + top-k MoE feed-forward, and the self-conditioning MLP.

Reference: transformers 5.23.0 ``modeling_diffusion_gemma.py``; the model that stacks them is
:mod:`localdiff.arch.diffusion_gemma`.
"""

from __future__ import annotations

import torch
from torch import nn

from localdiff.arch.diffusion_gemma_spec import DiffusionGemmaConfig
from localdiff.arch.layers import GatedMLP, MoEExperts, RMSNorm, Router, apply_rope, backs, norm, rms_norm


class Attention(nn.Module):
    """Gemma 4 attention; full-attention layers have no v_proj (values are the un-roped, un-normed keys)."""

    def __init__(self, cfg: DiffusionGemmaConfig, i: int):
        super().__init__()
        self.head_dim, self.kv_heads = cfg.layer_heads[i]
        self.heads = cfg.num_attention_heads
        self.sliding = cfg.layer_types[i] == "sliding_attention"
        self.eps = cfg.rms_norm_eps
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False) if self.sliding else None
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fused = None

    def fuse(self) -> None:
        """Back q/k(/v)_proj by one weight tensor (views, no extra memory) so qkv() runs one matmul."""
        mods = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
        if all(type(m) is nn.Linear for m in mods):
            w = torch.cat([m.weight.detach() for m in mods])
            o = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight = nn.Parameter(w[o : o + n], requires_grad=False)
                o += n
            self.fused = w

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: Tensor[B, L, H] → q: [B, Hq, L, D], k, v: [B, Hkv, L, D] (normed, k and q roped).

        All heads are normalised by one RMSNorm over [B, L, Hq + Hkv (+ Hkv), D] (per head, as the reference's
        q_norm / k_norm / v_norm); q and k heads are then scaled by their norm weights and roped together."""
        b, n, _ = x.shape
        d, hq, hk = self.head_dim, self.heads, self.kv_heads
        if backs(self.fused, self.q_proj.weight):  # still backing the weights (not replaced, cast or moved)
            heads = nn.functional.linear(x, self.fused).view(b, n, -1, d)
        else:
            mods = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
            heads = torch.cat([m(x) for m in mods], dim=-1).view(b, n, -1, d)
        if heads.dtype != torch.float32:  # keep the reference's per-tensor rounding outside fp32
            q = apply_rope(self.q_norm(heads[:, :, :hq]), cos, sin).transpose(1, 2)
            k_raw = heads[:, :, hq : hq + hk]
            k = apply_rope(self.k_norm(k_raw), cos, sin).transpose(1, 2)
            v = rms_norm(heads[:, :, hq + hk :] if self.v_proj is not None else k_raw, None, self.eps)
            return q, k, v.transpose(1, 2)
        normed = rms_norm(heads, None, self.eps)
        qk = apply_rope(normed[:, :, : hq + hk] * self._qk_scale(), cos, sin)
        v = normed[:, :, hq + hk :] if self.v_proj is not None else normed[:, :, hq : hq + hk]
        return qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2), v.transpose(1, 2)

    def _qk_scale(self) -> torch.Tensor:
        """Tensor[Hq + Hkv, D]: q_norm's weight for each q head, then k_norm's for each k head (made once per weight
        version when autograd is off)."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if torch.is_grad_enabled():
            return torch.cat([qw.expand(self.heads, -1), kw.expand(self.kv_heads, -1)])
        key = (qw.data_ptr(), qw._version, kw.data_ptr(), kw._version, qw.device)
        if getattr(self, "_qk_key", None) != key:
            self._qk = torch.cat([qw.detach().expand(self.heads, -1), kw.detach().expand(self.kv_heads, -1)])
            self._qk_key = key
        return self._qk


class Layer(nn.Module):
    """One transformer layer shared by the encoder (prefill) and decoder (denoise) roles."""

    def __init__(self, cfg: DiffusionGemmaConfig, i: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, i)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.router = Router(h, cfg.num_experts, cfg.top_k_experts, eps)
        self.experts = MoEExperts(cfg.num_experts, h, cfg.moe_intermediate_size)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            setattr(self, name, RMSNorm(h, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # decoder role
        self.register_buffer("enc_layer_scalar", torch.ones(1))  # encoder role (a separate buffer upstream)

    def ffn(self, x: torch.Tensor, split: int = 0) -> torch.Tensor:
        """Dense MLP and MoE in parallel on the post-attention residual x: Tensor[B, L, H]. ``split`` > 0: the experts
        run on rows ``[:split]`` and ``[split:]`` of each sequence apart (a fused pass: each part's expert groups are
        those of its own pass, so the result is bit-identical to two passes).

        The three norms of x (dense pre-norm, MoE pre-norm, the router's unscaled norm) share one normalisation in
        fp32: ``rms_norm(x, w) == rms_norm(x, None) * w`` bit for bit there."""
        flat = x.reshape(-1, x.shape[-1])
        if x.dtype == torch.float32 and self.pre_feedforward_layernorm.weight.dtype == torch.float32:
            normed = rms_norm(x, None, self.pre_feedforward_layernorm.eps)
            dense = self.mlp.forward(normed * self.pre_feedforward_layernorm.weight)
            dense = norm(self.post_feedforward_layernorm_1, dense)
            nflat = normed.reshape(flat.shape)
            w, idx = self.router.route(nflat)
            moe_in = nflat * self.pre_feedforward_layernorm_2.weight
        else:
            dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
            w, idx = self.router(flat)
            moe_in = self.pre_feedforward_layernorm_2(flat)
        if split:
            b, n, h = x.shape
            rows = [slice(0, split), slice(split, n)]
            moe = torch.cat(
                [
                    self.experts(*(t.view(b, n, -1)[:, r].reshape(-1, t.shape[-1]) for t in (moe_in, w, idx))).view(
                        b, -1, h
                    )
                    for r in rows
                ],
                1,
            )
        else:
            moe = self.experts(moe_in, w, idx).reshape(x.shape)
        return x + norm(self.post_feedforward_layernorm, dense + norm(self.post_feedforward_layernorm_2, moe))


class SelfConditioning(nn.Module):
    """Adds a gated-MLP transform of the previous step's soft embeddings to the canvas embeddings, then an
    unscaled RMSNorm. With no previous logits the MLP term is exactly zero, so only the norm runs."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps

    def forward(self, emb: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is not None:
            emb = emb + self.mlp.forward(norm(self.pre_norm, soft))
        return rms_norm(emb, None, self.eps)


def layer_type(att: Attention) -> str:
    """ "sliding_attention" or "full_attention" for an attention module."""
    return "sliding_attention" if att.sliding else "full_attention"
