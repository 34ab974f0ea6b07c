"""Helpers of the ``localdiff convert`` tests: tiny checkpoints in each upstream layout with the shipped tiny
tokenizer, the CLI call, and llama.cpp's raw logits of a GGUF file (non-causal, optionally block by block)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from localdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]
MASKED = ["llada", "lladamoe", "dream"]
BLOCK = {"sdar": {}, "sdar_moe": {"mlp_only_layers": []}, "Fast_dLLM_Qwen": {}}
#: sizes whose rows are multiples of 32 (Q8_0 / Q5_0 blocks) for the quantized checks
Q_BLOCK = dict(hidden_size=64, head_dim=16, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def masked_checkpoint(family: str, folder, q8: bool = False, seed: int = 3):
    """A LLaDA / LLaDA-MoE / Dream checkpoint in its upstream layout with the tiny tokenizer (365 tokens)."""
    import gguf_models as gm
    from safetensors.torch import save_file

    cfg, sd = gm.upstream(family, dict(gm.dims(family, q8), vocab=365), seed)
    cfg.update(mask_token_id=6, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        shutil.copy(ROOT / "models/tiny" / f, folder / f)
    return folder


def block_checkpoint(kind: str, folder, seed: int = 3, **over):
    from block_models import write_checkpoint

    return write_checkpoint(folder, kind, seed=seed, tokenizer=True, **dict(BLOCK[kind], **over))


def convert(src, out, qtype="F32", *extra) -> int:
    return main(["convert", str(src), "-o", str(out), "--type", qtype, "-q", *extra])


def llama_logits(path, ids: list[int], block: int | None = None) -> torch.Tensor:
    """llama.cpp's raw logits [T, V] for ``ids``: one non-causal batch (``block`` None), or block by block into the
    K/V memory with causal attention off. CPU, one thread, flash attention off, F32 K/V."""
    from localdiff.backends.gguf import llama_cpp

    lib = llama_cpp()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp refused {path}"
    n, step = len(ids), block or len(ids)
    cp = lib.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (n + 63) // 64 * 64
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 1, 1, 1
    cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    ctx = lib.llama_init_from_model(model, cp)
    lib.llama_set_causal_attn(ctx, False)
    nv = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(step, 0, 1)
    out = []
    try:
        for s in range(0, n, step):
            chunk = ids[s : s + step]
            batch.n_tokens = len(chunk)
            for j, t in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, s + j, 1, 1
                batch.seq_id[j][0] = 0
            assert lib.llama_decode(ctx, batch) == 0
            arr = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(chunk) * nv,))
            out.append(torch.from_numpy(arr.copy()).view(len(chunk), nv))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return torch.cat(out)


def random_ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 365, (n,), generator=g)
    ids[n // 2 :] = 6  # a canvas of masks after a "prompt"
    return ids.tolist()
