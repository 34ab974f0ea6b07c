"""Test helpers for the block family: transformers' Qwen3 (SDAR, Tiny-A2D BD3LM), Qwen3-MoE (SDAR-MoE) and Qwen2
(Fast-dLLM v2) on tiny odd-sized random configs, the same weights written in each UPSTREAM checkpoint layout
(config.json keys + tensor names, written out here independently of ``localdiff.arch``), and the reference's logits
under a block-causal 4D mask (query at position p sees key q iff q // B <= p // B)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from masked_ref import _randomize, upstream_state

H, HEADS, LAYERS, VOCAB, INTER, THETA = 48, 4, 3, 131, 72, 1000000.0
MASK, EOS, PAD = 126, 125, 124
#: layout → (transformers family in masked_ref's naming of upstream_state, block size)
LAYOUTS = {
    "sdar": ("qwen3", 4),
    "sdar_moe": ("lladamoe", 4),
    "Fast_dLLM_Qwen": ("dream", 5),
    "a2d-qwen3-bd3lm": ("qwen3", 3),
}


def reference(layout: str, seed: int = 0):
    """transformers model (eval, fp32, eager attention) with the hyper-parameters of ``layout``'s config."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        rope_theta=THETA,
        max_position_embeddings=256,
        attn_implementation="eager",
        rms_norm_eps=1e-6,
    )
    if layout in ("sdar", "a2d-qwen3-bd3lm"):
        cfg = tf.Qwen3Config(
            **common,
            intermediate_size=INTER,
            num_key_value_heads=2,
            head_dim=14,
            tie_word_embeddings=True,
            attention_bias=False,
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif layout == "sdar_moe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_key_value_heads=2,
            head_dim=14,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            tie_word_embeddings=True,
            attention_bias=False,
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = tf.Qwen2Config(**common, intermediate_size=INTER, num_key_value_heads=1, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    _randomize(model, seed)
    return model.eval()


def upstream_config(layout: str) -> dict:
    """config.json of ``layout`` in the upstream keys (see localdiff.arch.block_spec's sources)."""
    ids = dict(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=EOS)
    q3 = dict(
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=14,
        rms_norm_eps=1e-6,
        rope_theta=THETA,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=False,
        vocab_size=VOCAB,
        use_sliding_window=False,
        sliding_window=None,
        **ids,
    )
    if layout == "sdar":
        return dict(q3, model_type="sdar", architectures=["SDARForCausalLM"], block_size=4)
    if layout == "a2d-qwen3-bd3lm":
        return dict(q3, model_type="a2d-qwen3", architectures=["A2DQwen3LMHeadModel"], block_size=3)
    if layout == "sdar_moe":
        return dict(
            q3,
            model_type="sdar_moe",
            architectures=["SDARMoeForCausalLM"],
            block_size=4,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
        )
    return dict(
        model_type="Fast_dLLM_Qwen",
        architectures=["Fast_dLLM_QwenForCausalLM"],
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_theta=THETA,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_sliding_window=False,
        vocab_size=VOCAB,
        bd_size=5,
        **ids,
    )


def write_upstream(layout: str, folder, seed: int = 0):
    """The reference's weights + config.json in ``layout``'s upstream layout → ``folder``; returns the reference."""
    model = reference(layout, seed)
    sd = upstream_state(LAYOUTS[layout][0], model)
    if layout == "sdar_moe":
        sd.pop("lm_head.weight", None)  # tied in this config
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(upstream_config(layout)))
    return model


def block_mask(t: int, block: int, key_mask: torch.Tensor | None = None, b: int = 1) -> torch.Tensor:
    """4D float mask [B, 1, T, T] (0 = attend, finfo.min = not): block-causal, padding keys excluded, a padding
    query sees itself."""
    pos = torch.arange(t)
    see = (pos[None, :] // block) <= (pos[:, None] // block)
    see = see[None, None].expand(b, 1, t, t)
    if key_mask is not None:
        see = (see & key_mask.bool()[:, None, None, :]) | torch.eye(t, dtype=torch.bool)[None, None]
    m = torch.zeros(b, 1, t, t)
    return m.masked_fill(~see, torch.finfo(torch.float32).min)


def ref_logits(model, ids: torch.Tensor, block: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=ids, attention_mask=block_mask(ids.shape[1], block, key_mask, ids.shape[0])
        ).logits.float()
