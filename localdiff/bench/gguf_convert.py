"""Convert a LLaDA-layout checkpoint (config.json + safetensors + tokenizer.json; e.g. the shipped ``tiny-mdm``) to
a GGUF file for the ``gguf`` bench section, as llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/llada.py``)
does: llama.cpp tensor names, q/k rows permuted for its interleaved ("NORM") RoPE, ``llada.*`` hyper-parameters,
``diffusion.shift_logits`` = false, non-causal attention; F32 or Q8_0 (rows that are a multiple of 32; the rest
F32, as the converter falls back).

Tokenizer: the checkpoint's Metaspace BPE (``▁`` for spaces, merges) is written as llama.cpp's SentencePiece-style
vocabulary (``tokenizer.ggml.model = "llama"``): a merged token's score is minus its merge rank, so llama.cpp's
highest-score-first bigram merging applies the merges in BPE order; no space prefix: llama.cpp would add it after
every special token, the Metaspace pre-tokenizer (``prepend_scheme: first``) only at offset 0 — so chat-templated
text (it starts with ``<bos>``) tokenizes identically, raw text without a leading special token loses the leading
"▁" of its first word. Added tokens are CONTROL. :func:`tokenizer_agreement` measures how often llama.cpp's encoding of
a text equals the HF tokenizer's (the bench reports it: a mismatch would cost both GGUF runs accuracy alike).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Half-split RoPE rows → interleaved pairs, per head (``LLaDAModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "attn_out": "attn_output",
          "ff_proj": "ffn_gate", "up_proj": "ffn_up", "ff_out": "ffn_down", "attn_norm": "attn_norm",
          "ff_norm": "ffn_norm"}


def convert_llada(ckpt: Path, out: Path, q8: bool = False) -> Path:
    """Write ``out`` (GGUF) from the LLaDA checkpoint folder ``ckpt``. Returns ``out``.

    Raises:
        ImportError: the ``gguf`` package is missing (the gguf extra). KeyError / ValueError: not a LLaDA layout.
    """
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("model_type") != "llada":
        raise ValueError(f"{ckpt}: model_type {cfg.get('model_type')!r} is not llada")
    sd = load_file(str(ckpt / "model.safetensors"))
    h, heads = cfg["d_model"], cfg["n_heads"]
    kv = cfg.get("n_kv_heads") or heads
    n = cfg["n_layers"]
    w = gguf.GGUFWriter(str(out), "llada")
    w.add_context_length(int(cfg.get("max_sequence_length", 4096)))
    w.add_embedding_length(h)
    w.add_block_count(n)
    w.add_feed_forward_length(int(cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * h))
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_rope_dimension_count(h // heads)
    w.add_causal_attention(False)
    w.add_diffusion_shift_logits(False)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, ckpt, cfg)
    t = "model.transformer."
    tensors = {"token_embd.weight": sd[t + "wte.weight"], "output_norm.weight": sd[t + "ln_f.weight"],
               "output.weight": sd.get(t + "ff_out.weight", sd[t + "wte.weight"])}
    for i in range(n):
        for up, ours in _LAYER.items():
            x = sd[f"{t}blocks.{i}.{up}.weight"]
            if up in ("q_proj", "k_proj"):
                x = _permute(x, heads if up == "q_proj" else kv)
            tensors[f"blk.{i}.{ours}.weight"] = x
    for name, x in tensors.items():
        x = np.ascontiguousarray(x.astype(np.float32))
        if q8 and x.ndim >= 2 and x.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w, ckpt: Path, cfg: dict) -> None:
    """The SentencePiece-style vocabulary of a Metaspace BPE ``tokenizer.json`` (module docstring)."""
    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    n = max(int(cfg["vocab_size"]), max(vocab.values()) + 1)
    toks = [f"[PAD{i}]" for i in range(n)]
    for s, i in vocab.items():
        toks[i] = s
    scores = [0.0] * n
    for rank, m in enumerate(tj["model"].get("merges", [])):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a + b in vocab:
            scores[vocab[a + b]] = -float(rank + 1)
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    types = [3 if i in special else (5 if toks[i].startswith("[PAD") else 1) for i in range(n)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(False)
    for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                    ("pad_token_id", w.add_pad_token_id), ("mask_token_id", w.add_mask_token_id)):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    gen = ckpt / "generation_config.json"
    ends = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ends = [e for e in (ends if isinstance(ends, list) else [ends]) if e is not None and e != cfg.get("eos_token_id")]
    if ends:
        w.add_eot_token_id(int(ends[0]))            # e.g. <end_of_turn>: generation ends there too
    tpl = ckpt / "chat_template.jinja"
    if tpl.is_file():
        w.add_chat_template(tpl.read_text(encoding="utf-8"))


def tokenizer_agreement(hf_tokenizer, gguf_tokenizer, texts: list[str]) -> float:
    """Fraction of ``texts`` whose token ids are identical under both tokenizers (``encode``)."""
    same = sum(hf_tokenizer.encode(t) == gguf_tokenizer.encode(t) for t in texts)
    return same / max(len(texts), 1)
