"""Tiny ReFusion checkpoints in the upstream layout (GSAI-ML/ReFusion: a transformers Qwen3ForCausalLM
``save_pretrained`` folder whose config.json also carries ``mask_token_id`` / ``bos_token_id``), for the slots tests.

``QWEN3_TINY``: odd sizes (hidden 40, 3 heads of 14 over 1 key/value head, intermediate 56, vocab 97). Weights are
random but scaled up so the drafts are confident enough for the decoder's thresholds to bite.
"""

from __future__ import annotations

import json

import torch

QWEN3_TINY = dict(
    hidden_size=40,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=14,
    num_hidden_layers=2,
    intermediate_size=56,
    vocab_size=97,
    rope_theta=10000.0,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
)
MASK, BOS, EOS, PAD = 96, 95, 94, 93


def build_hf(seed: int = 0, scale: float = 1.0, eos_bias: float = 0.0, **over):
    """transformers' own Qwen3ForCausalLM (fp32, eval) with seeded random weights; ``scale`` multiplies the LM
    head (sharper distributions); ``eos_bias`` is added to the EOS row of the LM head's... bias-free head, so it is
    folded into the final norm direction: the EOS row is shifted towards the mean hidden state."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**QWEN3_TINY, **over}, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=BOS)
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        m.lm_head.weight.mul_(scale)
        if eos_bias:
            m.lm_head.weight[EOS] += eos_bias * m.model.norm.weight / m.model.norm.weight.norm()
    return m


def save_upstream(model, path) -> None:
    """``save_pretrained`` (safetensors) + ReFusion's config additions (mask / bos ids)."""
    model.save_pretrained(str(path), safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(mask_token_id=MASK, bos_token_id=BOS)
    (path / "config.json").write_text(json.dumps(cfg))
