"""Baby config.json dicts, one per registered model_type, for the architecture contract test (odd sizes).

A new architecture adds its entry here; ``tests/arch/test_arch_contract.py`` then checks it like every other one.
"""

from __future__ import annotations

import torch

from localdiff.arch import get_arch, get_spec
from localdiff.arch.base import ROLE_DENOISE, ROLE_DRAFT, ROLE_LOGITS, ROLE_PREFILL, ROLE_WINDOW
from localdiff.cache.kv import KVCache

BABY = {
    "diffusion_gemma": {
        "model_type": "diffusion_gemma",
        "canvas_length": 6,
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "text_config": dict(
            vocab_size=131,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=12,
            global_head_dim=20,
            num_global_key_value_heads=3,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            num_experts=5,
            top_k_experts=3,
            moe_intermediate_size=24,
            max_position_embeddings=1024,
            eos_token_id=1,
            pad_token_id=0,
        ),
    },
    # masked family (localdiff.arch.masked_spec): each in its upstream config.json keys
    "llada": dict(
        model_type="llada",
        architectures=["LLaDAModelLM"],
        d_model=48,
        n_heads=3,
        n_kv_heads=3,
        n_layers=3,
        mlp_hidden_size=72,
        mlp_ratio=4,
        vocab_size=131,
        embedding_size=131,
        weight_tying=False,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_sequence_length=256,
        block_type="llama",
        layer_norm_type="rms",
        activation_type="silu",
        rope=True,
        include_bias=False,
        include_qkv_bias=False,
        mask_token_id=126,
        eos_token_id=125,
        pad_token_id=125,
    ),
    "lladamoe": dict(
        model_type="lladamoe",
        architectures=["LLaDAMoEModelLM"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=3,
        num_hidden_layers=3,
        dense_intermediate_size=40,
        expert_intermediate_size=24,
        shared_expert_intermediate_size=20,
        num_experts=5,
        num_experts_per_tok=3,
        moe_layer_freq=[0, 1, 1],
        qk_layernorm=True,
        moe_router_enable_expert_bias=True,
        rope_theta=50000.0,
        vocab_size=131,
        max_position_embeddings=256,
        mask_token_id=126,
        eos_token_id=125,
        pad_token_id=125,
    ),
    "Dream": dict(
        model_type="Dream",
        architectures=["DreamModel"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        num_hidden_layers=3,
        intermediate_size=72,
        vocab_size=131,
        rope_theta=10000.0,
        max_position_embeddings=256,
        mask_token_id=126,
        eos_token_id=125,
        pad_token_id=125,
    ),
    "a2d-qwen3": dict(
        model_type="a2d-qwen3",
        architectures=["A2DQwen3LMHeadModel"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        num_hidden_layers=3,
        intermediate_size=72,
        vocab_size=131,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        mask_token_id=126,
        eos_token_id=125,
        pad_token_id=124,
    ),
    # block family (localdiff.arch.block_spec): the layouts of tests/helpers/block_models.py
    **{k: v for k, v in __import__("block_models").CONFIGS.items()},
    # block family: LLaDA2.x MoE in its Hub config.json keys (1 dense layer, then MoE; 2 of 3 groups)
    "llada2_moe": dict(
        model_type="llada2_moe",
        architectures=["LLaDA2MoeModelLM"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        num_hidden_layers=3,
        intermediate_size=72,
        moe_intermediate_size=24,
        num_experts=9,
        num_experts_per_tok=3,
        num_shared_experts=1,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        rope_theta=600000,
        use_qk_norm=True,
        use_bias=False,
        use_qkv_bias=False,
        vocab_size=131,
        max_position_embeddings=256,
        block_size=4,
        mask_token_id=126,
        eos_token_id=125,
        pad_token_id=124,
    ),
    # slots family (localdiff.arch.refusion_spec): ReFusion's config.json is Qwen3's plus mask_token_id
    "refusion": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        num_hidden_layers=3,
        intermediate_size=72,
        vocab_size=131,
        rope_theta=1000000.0,
        max_position_embeddings=256,
        mask_token_id=130,
        bos_token_id=129,
        eos_token_id=125,
        pad_token_id=124,
    ),
    # causal family (localdiff.arch.causal_spec) and DFlash drafts (localdiff.arch.dflash_spec)
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        num_hidden_layers=3,
        intermediate_size=72,
        vocab_size=131,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        eos_token_id=125,
    ),
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=3,
        num_hidden_layers=3,
        intermediate_size=72,
        vocab_size=131,
        rope_theta=5e5,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        eos_token_id=[125, 124],
    ),
    "dflash": dict(
        model_type="qwen3",
        architectures=["DFlashDraftModel"],
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=20,
        num_hidden_layers=2,
        intermediate_size=40,
        vocab_size=131,
        rope_theta=1000000.0,
        block_size=6,
        num_target_layers=5,
        dflash_config={"mask_token_id": 126, "target_layer_ids": [1, 3]},
    ),
}


def build_baby(raw, seed=0):
    """A module of `raw`'s architecture with every tensor random (seeded; norms / scalars near 1)."""
    mod, spec = get_arch(raw), get_spec(raw)
    torch.manual_seed(seed)
    net = mod.MODEL_CLASS(spec.parse_config(raw)).eval()
    with torch.no_grad():  # every tensor set here (modules may leave some uninitialised); norms / scalars ≠ 1
        for name, p in list(net.named_parameters()) + list(net.named_buffers()):
            if p.is_floating_point():
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() <= 1 else 0.08 * torch.randn_like(p))
    return net


def forward_roles(net, ids):
    """Logits of every role the model declares, on the same ids (one canvas / window after a 5-token prompt)."""
    out = {}
    prompt, tail = ids[:, :5], ids[:, 5:]
    if ROLE_PREFILL in net.roles and ROLE_DENOISE in net.roles:
        cache = KVCache(**net.cache_layout())
        net.prefill(prompt, cache)
        out["denoise"] = net.denoise(tail, cache)
    if ROLE_LOGITS in net.roles:
        out["logits"] = net.logits_full(ids)
    if ROLE_WINDOW in net.roles:
        out["window"] = net.forward_window(ids, 0)
    if ROLE_PREFILL in net.roles and ROLE_DENOISE not in net.roles:  # causal: cached pass = uncached pass
        cache = KVCache(**net.cache_layout())
        a, _ = net.prefill(prompt, cache)
        b, _ = net.prefill(tail, cache)
        out["prefill"] = torch.cat([a, b], 1)
    if ROLE_DRAFT in net.roles:  # a DFlash draft: the target's embeddings / LM head and features are inputs
        g = torch.Generator().manual_seed(2)
        emb = torch.randn(net.config.vocab_size, net.config.hidden_size, generator=g)
        feats = torch.randn(ids.shape[0], 5, net.fc.in_features, generator=g)
        out["draft"] = net.draft(net.embed(tail, emb), feats, KVCache(**net.cache_layout()), emb)
    return out
