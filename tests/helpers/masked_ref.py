"""Test helpers for the masked family: transformers reference models (Llama for LLaDA, Qwen2 for Dream, Qwen3 for
A2D-Qwen3, Qwen3-MoE for LLaDA-MoE) on tiny odd-sized random configs, and the same weights written as a checkpoint
in each UPSTREAM layout (tensor names + config.json keys), with the name maps written out here independently of
``localdiff.arch``."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

H, HEADS, LAYERS, VOCAB, INTER = 48, 3, 5, 131, 72
MASK, EOS = 126, 125
THETA = 10000.0


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 and p.shape[0] != VOCAB else 0.08 * noise)


def reference(family: str, seed: int = 0):
    """(transformers model in eval mode, fp32, eager attention) of ``family`` in llada / lladamoe / dream / qwen3."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        rope_theta=THETA,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    if family == "llada":
        cfg = tf.LlamaConfig(
            **common,
            intermediate_size=INTER,
            num_key_value_heads=HEADS,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
        model = tf.LlamaForCausalLM(cfg)
    elif family == "dream":
        cfg = tf.Qwen2Config(
            **common, intermediate_size=INTER, num_key_value_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=False
        )
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(
            **common,
            intermediate_size=INTER,
            num_key_value_heads=1,
            head_dim=20,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "lladamoe":
        cfg = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_key_value_heads=HEADS,
            head_dim=H // HEADS,
            num_experts=5,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[0, 3],
            decoder_sparse_step=1,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    _randomize(model, seed)
    return model.eval()


def ref_logits(model, ids: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's logits under a BIDIRECTIONAL 4D float mask (0 = attend, finfo.min = padding key)."""
    b, t = ids.shape
    keep = torch.ones(b, t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    m = torch.zeros(b, 1, t, t)
    m.masked_fill_(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=m).logits.float()


# -- upstream checkpoint layouts -----------------------------------------------------------------------------------
_LLADA = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def upstream_state(family: str, model) -> dict:
    """The reference's weights under the upstream checkpoint names of ``family``."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if family == "llada":
        out = {
            "model.transformer.wte.weight": sd.pop("model.embed_tokens.weight"),
            "model.transformer.ln_f.weight": sd.pop("model.norm.weight"),
            "model.transformer.ff_out.weight": sd.pop("lm_head.weight"),
        }
        for k, v in sd.items():
            _, _, i, rest = k.split(".", 3)
            mod, leaf = rest.rsplit(".", 1)
            out[f"model.transformer.blocks.{i}.{_LLADA[mod]}.{leaf}"] = v
        return out
    if family == "qwen3":
        sd.pop("lm_head.weight", None)  # tied: not in the real checkpoint
    if family == "lladamoe":  # fused experts → one module per expert (LLaDA-MoE Hub layout)
        for k in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            p = k[: -len("gate_up_proj")]
            gu, down = sd.pop(k), sd.pop(p + "down_proj")
            inter = down.shape[-1]
            for e in range(gu.shape[0]):
                sd[f"{p}{e}.gate_proj.weight"] = gu[e, :inter].clone()
                sd[f"{p}{e}.up_proj.weight"] = gu[e, inter:].clone()
                sd[f"{p}{e}.down_proj.weight"] = down[e].clone()
    return sd


def upstream_config(family: str) -> dict:
    """config.json of ``family`` in the upstream keys, matching :func:`reference`'s hyper-parameters."""
    ids = dict(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS)
    if family == "llada":
        return dict(
            model_type="llada",
            architectures=["LLaDAModelLM"],
            d_model=H,
            n_heads=HEADS,
            n_kv_heads=HEADS,
            n_layers=LAYERS,
            mlp_hidden_size=INTER,
            mlp_ratio=4,
            vocab_size=VOCAB,
            embedding_size=VOCAB,
            weight_tying=False,
            rope_theta=THETA,
            rms_norm_eps=1e-5,
            max_sequence_length=256,
            block_type="llama",
            layer_norm_type="rms",
            activation_type="silu",
            rope=True,
            rope_full_precision=True,
            include_bias=False,
            include_qkv_bias=False,
            alibi=False,
            attention_layer_norm=False,
            scale_logits=False,
            input_emb_norm=False,
            bias_for_layer_norm=False,
            layer_norm_with_affine=True,
            multi_query_attention=None,
            **ids,
        )
    if family == "dream":
        return dict(
            model_type="Dream",
            architectures=["DreamModel"],
            hidden_size=H,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            rope_theta=THETA,
            rope_scaling=None,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            use_sliding_window=False,
            vocab_size=VOCAB,
            **ids,
        )
    if family == "qwen3":
        return dict(
            model_type="a2d-qwen3",
            architectures=["A2DQwen3LMHeadModel"],
            hidden_size=H,
            intermediate_size=INTER,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            head_dim=20,
            rms_norm_eps=1e-6,
            rope_theta=THETA,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attention_bias=False,
            vocab_size=VOCAB,
            bos_token_id=EOS,
            eos_token_id=EOS,
            pad_token_id=EOS - 1,
            mask_token_id=MASK,
        )
    if family == "lladamoe":  # the Hub config says model_type "llada"; the architecture names the MoE
        return dict(
            model_type="llada",
            architectures=["LLaDAMoEModelLM"],
            hidden_size=H,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            dense_intermediate_size=40,
            expert_intermediate_size=24,
            shared_expert_intermediate_size=None,
            num_experts=5,
            num_experts_per_tok=3,
            moe_layer_freq=[0, 1, 1, 0, 1],
            qk_layernorm=True,
            norm_topk_prob=False,
            moe_router_enable_expert_bias=False,
            moe_router_score_function="softmax",
            rope_theta=THETA,
            partial_rotary_factor=1.0,
            rope_scaling=None,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            attention_bias=False,
            clip_qkv=None,
            vocab_size=VOCAB,
            **ids,
        )
    raise ValueError(family)


def write_upstream(family: str, folder, seed: int = 0):
    """Write the reference's weights + config.json in ``family``'s upstream layout to ``folder``; returns the
    reference model."""
    model = reference(family, seed)
    save_file(upstream_state(family, model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(upstream_config(family)))
    return model
