"""Baby config.json dicts, one per registered model_type, for the architecture contract test (odd sizes).

A new architecture adds its entry here; ``tests/test_arch_contract.py`` then checks it like every other one.
"""
from __future__ import annotations

BABY = {
    "diffusion_gemma": {
        "model_type": "diffusion_gemma", "canvas_length": 6, "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "text_config": dict(vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                            num_attention_heads=3, num_key_value_heads=3, head_dim=12, global_head_dim=20,
                            num_global_key_value_heads=3, sliding_window=5,
                            layer_types=["full_attention", "sliding_attention", "full_attention"], num_experts=5,
                            top_k_experts=3, moe_intermediate_size=24, max_position_embeddings=1024,
                            eos_token_id=1, pad_token_id=0),
    },
}
