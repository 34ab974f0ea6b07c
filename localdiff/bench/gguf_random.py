"""A random LLaDA-shaped checkpoint for the ``gguf`` bench section's realistic-size check: the per-forward
comparison with llama.cpp's program on the tiny trained model is dominated by fixed per-step costs (a ~1.3M-parameter
forward takes ~4.5 ms); at ~100M parameters the forward dominates, as it does for real models.

The checkpoint is written in the LLaDA layout the bench's converter reads (:func:`localdiff.bench.gguf_convert.
convert_llada`: ``config.json`` + ``model.safetensors`` with LLaDA's ``model.transformer.*`` names), with the shipped
``tiny-mdm``'s tokenizer, chat template and special ids (so the same prompts run), weights N(0, 0.02²) and RMS-norm
weights 1. Random weights: the tokens are meaningless; only the time per forward is compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

#: the realistic-size shape: hidden 768, 14 layers, FFN 2304, 12 heads → 107.9M parameters with tiny-mdm's vocab (365)
SHAPE = {"d_model": 768, "n_layers": 14, "mlp_hidden_size": 2304, "n_heads": 12}
_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def random_llada(src: Path, out: Path, shape: dict | None = None, seed: int = 0) -> tuple[Path, int]:
    """Write a random LLaDA checkpoint into the folder ``out`` with the tokenizer files and config of ``src``
    (tiny-mdm), its shape replaced by ``shape`` (default :data:`SHAPE`; n_kv_heads = n_heads).

    Returns:
        (``out``, the parameter count).
    Raises:
        OSError: ``src`` lacks config.json / tokenizer.json.
    """
    from safetensors.numpy import save_file

    shape = dict(SHAPE if shape is None else shape)
    out.mkdir(parents=True, exist_ok=True)
    for f in _FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(shape, n_kv_heads=shape["n_heads"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    h, f, v = cfg["d_model"], cfg["mlp_hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)

    def w(*s):
        return rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)

    t = "model.transformer."
    sd = {t + "wte.weight": w(v, h), t + "ff_out.weight": w(v, h), t + "ln_f.weight": np.ones(h, np.float32)}
    for i in range(cfg["n_layers"]):
        b = f"{t}blocks.{i}."
        for k in ("q_proj", "k_proj", "v_proj", "attn_out"):
            sd[b + k + ".weight"] = w(h, h)
        sd[b + "ff_proj.weight"], sd[b + "up_proj.weight"], sd[b + "ff_out.weight"] = w(f, h), w(f, h), w(h, f)
        sd[b + "attn_norm.weight"], sd[b + "ff_norm.weight"] = np.ones(h, np.float32), np.ones(h, np.float32)
    save_file(sd, str(out / "model.safetensors"))
    return out, sum(x.size for x in sd.values())
