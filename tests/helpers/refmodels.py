"""Builders for tiny random DiffusionGemma checkpoints with the reference (transformers, test-only dependency)."""

from __future__ import annotations

import torch

CONFIGS = {
    # sliding window (6) shorter than the prompts used in tests, top-k 2, sliding + full layers
    "small": dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        max_position_embeddings=1024,
    ),
    # odd sizes, different layer pattern (full first), top-k 3, more KV heads on global layers
    "odd": dict(
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
    ),
}


# transformers reads vision_config=None as its ~170M-parameter default tower: tests pass this minimal one instead
MINIMAL_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=16,
    global_head_dim=16,
)


def build_reference(name: str, canvas_length: int = 8, seed: int = 0, vision: bool = False):
    """A random-weight reference model (eval mode, fp32) with non-trivial norm / scalar weights."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    # transformers always builds a vision tower (vision_config=None means its ~170M-parameter default), so tests
    # give it a minimal one; `vision=True` makes it a little larger, for the "never loaded" test.
    h = 32 if vision else 16
    vcfg = dict(
        model_type="gemma4_vision",
        hidden_size=h,
        intermediate_size=h,
        num_hidden_layers=2 if vision else 1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
    )
    cfg = DiffusionGemmaConfig(text_config=dict(CONFIGS[name]), canvas_length=canvas_length, vision_config=vcfg)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("router.scale") or n.endswith("per_expert_scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand(b.shape, generator=g))
    return model


def save_reference(model, path, shard: str = "20KB"):
    model.save_pretrained(path, max_shard_size=shard)
    return path
