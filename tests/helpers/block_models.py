"""Tiny block-diffusion checkpoints in each upstream layout (config.json keys + safetensors names as on the Hub), for
the block-family tests. Weights are random (seeded); tensor names are the upstream ones (``model.layers.N...``,
``lm_head.weight``; SDAR-MoE experts as ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_QWEN3 = dict(
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=14,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
)
#: one config per upstream layout (odd sizes; head_dim ≠ hidden / heads for the Qwen3 ones)
CONFIGS = {
    "sdar": dict(
        _QWEN3,
        model_type="sdar",
        architectures=["SDARForCausalLM"],
        block_size=4,
        vocab_size=131,
        mask_token_id=130,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    ),
    "sdar_moe": dict(
        _QWEN3,
        model_type="sdar_moe",
        architectures=["SDARMoeForCausalLM"],
        block_size=4,
        vocab_size=131,
        mask_token_id=130,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "Fast_dLLM_Qwen": dict(
        model_type="Fast_dLLM_Qwen",
        architectures=["Fast_dLLM_QwenForCausalLM"],
        hidden_size=36,
        intermediate_size=52,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        bd_size=8,
        tie_word_embeddings=True,
        vocab_size=131,
        mask_token_id=130,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
        use_sliding_window=False,
    ),
    "a2d-qwen3-bd3lm": dict(
        _QWEN3,
        model_type="a2d-qwen3",
        architectures=["A2DQwen3LMHeadModel"],
        block_size=8,
        vocab_size=131,
        mask_token_id=130,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
        tie_word_embeddings=True,
    ),
}


def build_net(kind: str, seed: int = 0, **over):
    """(config dict, our BlockLM with random weights, fp32, eval mode)."""
    import torch

    from localdiff.arch import get_arch, get_spec

    cfg = dict(CONFIGS[kind], **over)
    mod, spec = get_arch(cfg), get_spec(cfg)
    torch.manual_seed(seed)
    net = mod.MODEL_CLASS(spec.parse_config(cfg)).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(
                torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 and "norm" in name else 0.0)
            )
    return cfg, net


def write_checkpoint(
    path: Path, kind: str, seed: int = 0, tokenizer: bool = False, gen: dict | None = None, **over
) -> Path:
    """Write a tiny checkpoint of layout ``kind`` into ``path``; with ``tokenizer`` the embedded model's tokenizer
    (vocab_size then follows it, mask = the tokenizer's ``<mask>``, id 6)."""
    from safetensors.torch import save_file

    from localdiff.arch import get_arch

    if tokenizer:
        from tokenizers import Tokenizer

        over = dict(
            dict(
                vocab_size=Tokenizer.from_file(str(ROOT / "models/tiny/tokenizer.json")).get_vocab_size(),
                mask_token_id=6,
            ),
            **over,
        )
    cfg, net = build_net(kind, seed, **over)
    mod = get_arch(cfg)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in net.state_dict().items():
        if k == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        state[mod.checkpoint_names(k)[0]] = v.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer:
        for f in TOKENIZER_FILES:
            shutil.copy(ROOT / "models/tiny" / f, path / f)
    (path / "generation_config.json").write_text(json.dumps(gen or {"max_new_tokens": 16, "temperature": 0.0}))
    return path
