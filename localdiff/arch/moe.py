"""OLMoE / Qwen3-MoE / LLaDA-MoE style sparse MoE feed-forward: a linear router, softmax in fp32 (plus an optional
per-expert bias, LLaDA-MoE's ``expert_bias`` buffer), top-k, optional renormalisation (``norm_topk_prob``), SwiGLU
experts kept as separate modules (``experts.E.{gate,up,down}_proj``) so real checkpoints load without stacking.

Math as transformers 5.23.0 ``Qwen3MoeSparseMoeBlock`` and the LLaDA-MoE Hub code (``LLaDAMoESparseMoeBlock``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free (hidden → inter → hidden): the Llama / Qwen MLP,
    LLaDA's ff_proj / up_proj / ff_out, and each routed expert (:data:`Expert`)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


Expert = SwiGLU   # one routed expert


class SparseMoE(nn.Module):
    """Routed experts. ``gate`` Linear[H → E]; ``experts`` ModuleList of :class:`Expert`; ``expert_bias``
    FloatTensor[E] buffer when ``cfg.expert_bias``.

    Routing (per token): ``p = softmax(gate(x), fp32)``; ``p += expert_bias`` (LLaDA-MoE adds the bias to the
    probabilities and keeps it in the weights, exactly as its Hub code does); ``w, idx = topk(p, k)``;
    ``w /= w.sum()`` when ``cfg.norm_topk_prob``; ``w`` cast to x's dtype; output ``Σ_k w_k · expert_idx_k(x)``.
    """

    def __init__(self, cfg):
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(Expert(h, cfg.moe_intermediate_size) for _ in range(e))
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e))
        else:
            self.expert_bias = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: Tensor[N, H] → (weights Tensor[N, k] in x's dtype, expert index LongTensor[N, k])."""
        p = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:
            p = p + self.expert_bias.float()
        w, idx = torch.topk(p, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: Tensor[B, L, H] → Tensor[B, L, H]. Each active expert runs once over the tokens routed to it."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.route(flat)
        out = torch.zeros_like(flat)
        hit = torch.bincount(idx.reshape(-1), minlength=len(self.experts)).tolist()
        for e, count in enumerate(hit):
            if not count:
                continue
            tok, slot = torch.where(idx == e)
            y = self.experts[e](flat[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(flat.dtype))
        return out.reshape(shape)
