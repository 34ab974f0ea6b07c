"""OLMoE / Qwen3-MoE / LLaDA-MoE style sparse MoE feed-forward: a linear router, softmax in fp32 (plus an optional
per-expert bias, LLaDA-MoE's ``expert_bias`` buffer), top-k, optional renormalisation (``norm_topk_prob``), SwiGLU
experts kept as separate modules (``experts.E.{gate,up,down}_proj``) so real checkpoints load without stacking.
A second router variant, ``cfg.moe_router == "sigmoid_group"`` (LLaDA2.x; DeepSeek-V3's group-limited routing), is
:func:`sigmoid_group_route`.

Math as transformers 5.23.0 ``Qwen3MoeSparseMoeBlock``, the LLaDA-MoE Hub code (``LLaDAMoESparseMoeBlock``) and the
LLaDA2 Hub code (``LLaDA2MoeGate.group_limited_topk``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free (hidden → inter → hidden): the Llama / Qwen MLP,
    LLaDA's ff_proj / up_proj / ff_out, and each routed expert (:data:`Expert`). ``gate_up_fused``: None, or a
    callable x → (gate, up) projections in one matmul, or None when it no longer applies (set by
    ``localdiff.quantize.fuse.fuse_model`` on int8 models)."""

    gate_up_fused = None

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up_fused(x) if self.gate_up_fused is not None else None
        gate, up = fused if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


Expert = SwiGLU  # one routed expert


def sigmoid_group_route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2's router (Hub ``LLaDA2MoeGate``; the group-limited routing of DeepSeek-V3, arXiv 2412.19437).

    ``s = sigmoid(logits)``; the choice uses ``s + bias`` (the bias steers which experts are picked, never the
    weights): experts split into ``n_group`` equal groups, a group's score is the sum of its two best choice scores,
    the ``topk_group`` best groups stay and the other experts drop out; then the ``top_k`` best choice scores. The
    weights are the picked experts' ``s``, renormalised to sum 1 (``+ 1e-20``, only when top_k > 1) and multiplied by
    ``scale`` (``routed_scaling_factor``).

    Args:
        logits: FloatTensor[N, E] router logits (fp32). bias: FloatTensor[E] or None.
    Returns:
        (weights FloatTensor[N, k] fp32, expert index LongTensor[N, k]).
    """
    s = torch.sigmoid(logits.float())
    choice = s if bias is None else s + bias.float()
    n, e = choice.shape
    group_score = choice.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    keep = torch.topk(group_score, topk_group, dim=-1, sorted=False).indices
    groups = torch.zeros(n, n_group, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
    choice = choice.masked_fill(~groups.repeat_interleave(e // n_group, dim=1), float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1).indices
    w = s.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, idx


class SparseMoE(nn.Module):
    """Routed experts. ``gate`` Linear[H → E]; ``experts`` ModuleList of :class:`Expert`; ``expert_bias``
    FloatTensor[E] buffer when ``cfg.expert_bias``.

    Routing (per token): ``p = softmax(gate(x), fp32)``; ``p += expert_bias`` (LLaDA-MoE adds the bias to the
    probabilities and keeps it in the weights, exactly as its Hub code does); ``w, idx = topk(p, k)``;
    ``w /= w.sum()`` when ``cfg.norm_topk_prob``; ``w`` cast to x's dtype; output ``Σ_k w_k · expert_idx_k(x)``.
    With ``cfg.moe_router == "sigmoid_group"``: :func:`sigmoid_group_route` on fp32 logits (``cfg.n_group``,
    ``cfg.topk_group``, ``cfg.routed_scaling_factor``); the weighted sum is then taken in fp32, as the LLaDA2 Hub
    code does, and cast back to x's dtype.
    """

    def __init__(self, cfg):
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = getattr(cfg, "moe_router", "softmax")
        if self.router == "sigmoid_group":
            self.groups = (cfg.n_group, cfg.topk_group, float(cfg.routed_scaling_factor))
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(Expert(h, cfg.moe_intermediate_size) for _ in range(e))
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e))
        else:
            self.expert_bias = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: Tensor[N, H] → (weights Tensor[N, k] in x's dtype — fp32 for the sigmoid router —, expert index
        LongTensor[N, k])."""
        if self.router == "sigmoid_group":
            logits = F.linear(x.float(), self.gate.weight.float())
            return sigmoid_group_route(logits, self.expert_bias, self.top_k, *self.groups)
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
        out = torch.zeros_like(flat, dtype=w.dtype)
        hit = torch.bincount(idx.reshape(-1), minlength=len(self.experts)).tolist()
        for e, count in enumerate(hit):
            if not count:
                continue
            tok, slot = torch.where(idx == e)
            y = self.experts[e](flat[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out.to(x.dtype).reshape(shape)
