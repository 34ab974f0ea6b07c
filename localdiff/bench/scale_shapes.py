"""The scale section's models: random DiffusionGemma checkpoints with the flagship's proportions
(google/diffusiongemma-26B-A4B: 128 experts top-8, expert width hidden/4, dense MLP 0.75·hidden, five sliding layers
then one global, tied embeddings) at the sizes :data:`SHAPES` names, and the arithmetic of one canvas step from the
shapes (:func:`flops_per_step`, :func:`expert_padding`). :mod:`localdiff.bench.scale` measures them."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

CANVAS = 256
PROMPT = 64
VOCAB = 32768
REAL_VOCAB = 262144
#: name → (hidden, layers, heads, head_dim, global head_dim)
SHAPES = {"150M": (448, 6, 4, 128, 256), "1B": (1024, 9, 8, 128, 256), "smoke": (64, 2, 2, 32, 64)}  # smoke: tests


def text_config(hidden: int, layers: int, heads: int, head_dim: int, global_head_dim: int, vocab: int = VOCAB) -> dict:
    """A DiffusionGemma text_config with the flagship's proportions at ``hidden`` (see the module docstring)."""
    types = [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_global_key_value_heads=1,
        sliding_window=1024,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=hidden // 4,
        max_position_embeddings=8192,
        layer_types=types,
    )


def build(folder: Path, text: dict, seed: int = 0) -> Path:
    """Save a random DiffusionGemma with ``text`` (canvas 256) in bf16 with transformers; returns ``folder``."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from localdiff.bench.ref import WIDE_VISION

    cfg = DiffusionGemmaConfig(text_config=dict(text), vision_config=dict(WIDE_VISION), canvas_length=CANVAS)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no fp32 copy (1B: 8.1 → ~2.5 GiB peak)
    try:
        net = DiffusionGemmaForBlockDiffusion(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    net.save_pretrained(folder)
    del net
    gc.collect()
    return folder


def flops_per_step(text: dict, canvas: int = CANVAS, history: int = PROMPT, vocab: int | None = None) -> dict:
    """FLOPs (2 per multiply-add) of one canvas denoising step, by component, from the shapes: every canvas row runs
    q/k/v/o, attention over ``history`` + canvas keys (the window on sliding layers), the dense MLP, the router,
    its top-k experts, the self-conditioning MLP and soft-embedding product (vocab × hidden) and the LM head."""
    h, v = text["hidden_size"], vocab or text["vocab_size"]
    heads, kv, d, gd = (
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["head_dim"],
        text["global_head_dim"],
    )
    out = {"attention projections": 0, "attention scores": 0, "dense MLP": 0, "router": 0, "experts": 0}
    for ty in text["layer_types"]:
        sliding = ty == "sliding_attention"
        dd, kk = (d, kv) if sliding else (gd, text["num_global_key_value_heads"])
        keys = canvas + (min(history, text["sliding_window"]) if sliding else history)
        out["attention projections"] += h * heads * dd * 2 + h * kk * dd * (2 if sliding else 1)
        out["attention scores"] += 2 * heads * dd * keys
        out["dense MLP"] += 3 * h * text["intermediate_size"]
        out["router"] += h * text["num_experts"]
        out["experts"] += text["top_k_experts"] * 3 * h * text["moe_intermediate_size"]
    out["self-conditioning MLP"] = 3 * h * text["intermediate_size"]
    out["self-conditioning product"] = v * h
    out["LM head"] = v * h
    return {k: 2 * n * canvas for k, n in out.items()}


def expert_padding(text: dict, canvas: int = CANVAS, samples: int = 16) -> float:
    """How many expert rows localdiff's bf16 experts compute per row routed, the mean over ``samples`` uniform random
    routings (what a random model's router gives): with the native kernel (:mod:`localdiff.kernels.experts`)
    each expert's rows padded to its 16-row tile, else the stream kernel's
    (:func:`localdiff.arch.layers.stream_experts`) experts × the largest group, ÷ (canvas × top-k). The reference's
    grouped_mm computes the routed rows only (factor 1)."""
    from localdiff.kernels import experts as native_experts

    g = torch.Generator().manual_seed(0)
    e, k = text["num_experts"], text["top_k_experts"]
    f = []
    for _ in range(samples):
        flat = torch.rand(canvas, e, generator=g).topk(k, -1).indices.reshape(-1)
        rows = (
            native_experts.computed_rows(flat, e)
            if native_experts.library() is not None
            else e * int(torch.bincount(flat, minlength=e).max())
        )
        f.append(rows / (canvas * k))
    return sum(f) / len(f)
