"""Tiny SDAR / SDAR-MoE / Fast-dLLM v2 models written twice by the tests: the upstream safetensors checkpoint
(``block_models.write_checkpoint``) for the torch path, and a GGUF file the way llama.cpp's converter writes their
backbones (``convert_hf_to_gguf.py`` ``Qwen3Model`` / ``Qwen3MoeModel`` / ``Qwen2Model``: Qwen's half-split RoPE needs
no row permutation, experts stacked into ``blk.N.ffn_{gate,up,down}_exps``, router ``ffn_gate_inp``) plus localdiff's
diffusion keys — independently of ``localdiff``:

* ``general.architecture`` ``qwen3`` / ``qwen3moe`` / ``qwen2``; ``<arch>.attention.key_length`` / ``value_length``
  when head_dim ≠ hidden / heads;
* ``localdiff.model_type`` ("sdar", "sdar_moe", "fast_dllm_v2"), ``localdiff.family`` = "block",
  ``localdiff.mask_token_id`` and ``localdiff.block_length`` (uint32).

llama.cpp's ``qwen3moe`` graph has experts in every layer and normalises the top-k weights: the MoE model is built
with ``mlp_only_layers = []`` and ``norm_topk_prob = True``. F32 files.
"""

from __future__ import annotations

import json
from pathlib import Path

from block_models import write_checkpoint

KINDS = {"sdar": ("qwen3", "sdar"), "sdar_moe": ("qwen3moe", "sdar_moe"), "Fast_dLLM_Qwen": ("qwen2", "fast_dllm_v2")}
#: per kind, config overrides that make the torch model what llama.cpp's graph computes
OVERRIDES = {"sdar_moe": dict(mlp_only_layers=[], norm_topk_prob=True)}


def _vocab(v: int, mask: int):
    """0 pad, 1 eos, 2 bos (CONTROL), 3..97 the bytes 0x20..0x7e, 98 newline (GPT-2 byte-level), a few merges, the
    mask (CONTROL), the rest unused."""

    def b2u(b):
        return chr(b + 256) if b in (0x20, 0x0A) else chr(b)

    toks = ["<|pad|>", "<|eos|>", "<|bos|>"] + [b2u(b) for b in range(0x20, 0x7F)] + [b2u(0x0A)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    toks += [a + b for a, b in merges]
    types = [3, 3, 3] + [1] * (len(toks) - 3)
    while len(toks) < v:
        i = len(toks)
        toks.append("<|mask|>" if i == mask else f"[PAD{i}]")
        types.append(3 if i == mask else 5)
    return toks, types, [f"{a} {b}" for a, b in merges]


def gguf_tensors(cfg: dict, sd: dict) -> dict:
    """Upstream (HF Qwen) names → llama.cpp names; numpy float32."""
    import torch

    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp",
    }
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        for up, ours in names.items():
            for leaf in ("weight", "bias"):
                if b + up + "." + leaf in sd:
                    out[f"blk.{i}.{ours}.{leaf}"] = sd[b + up + "." + leaf]
        if cfg.get("num_experts"):
            for w in ("gate", "up", "down"):
                out[f"blk.{i}.ffn_{w}_exps.weight"] = torch.stack(
                    [sd[f"{b}mlp.experts.{e}.{w}_proj.weight"] for e in range(cfg["num_experts"])]
                )
    return {k: v.float().numpy() for k, v in out.items()}


def write_gguf(kind: str, folder, path, model_type: str | None = None, tokenizer: bool = False) -> None:
    """The F32 GGUF of the checkpoint ``folder`` (module docstring); ``model_type`` overrides
    ``localdiff.model_type`` (a bad-input test); ``tokenizer``: the folder's own tokenizer.json and chat template
    (an embedded model's Metaspace BPE, written by the bench's converter, ``localdiff.bench.gguf_convert``)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    arch, lt = KINDS[kind]
    w = gguf.GGUFWriter(str(path), arch)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if hd != h // heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_string("localdiff.model_type", model_type or lt)
    w.add_string("localdiff.family", "block")
    w.add_uint32("localdiff.mask_token_id", cfg["mask_token_id"])
    w.add_uint32("localdiff.block_length", cfg.get("block_size") or cfg.get("bd_size"))
    if tokenizer:
        _tokenizer(w, folder, cfg)
    else:
        toks, types, merges = _vocab(cfg["vocab_size"], cfg["mask_token_id"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(toks)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_pad_token_id(cfg["pad_token_id"])
        w.add_add_bos_token(False)
    for name, t in gguf_tensors(cfg, sd).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_both(kind: str, folder, seed: int = 0, **over):
    """(checkpoint folder ``folder/hf``, ``folder/model-F32.gguf``) of one random block model."""
    hf = write_checkpoint(folder / "hf", kind, seed, **{**OVERRIDES.get(kind, {}), **over})
    path = folder / "model-F32.gguf"
    write_gguf(kind, hf, path)
    return hf, path


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
    for key, fn in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("pad_token_id", w.add_pad_token_id),
        ("mask_token_id", w.add_mask_token_id),
    ):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    gen = ckpt / "generation_config.json"
    ends = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ends = [e for e in (ends if isinstance(ends, list) else [ends]) if e is not None and e != cfg.get("eos_token_id")]
    if ends:
        w.add_eot_token_id(int(ends[0]))  # e.g. <end_of_turn>: generation ends there too
    tpl = ckpt / "chat_template.jinja"
    if tpl.is_file():
        w.add_chat_template(tpl.read_text(encoding="utf-8"))
