"""Tiny LLaDA / LLaDA-MoE / Dream models written twice by the tests: as a safetensors checkpoint in the UPSTREAM
layout (config.json keys + tensor names as on the Hub) for the torch path, and as a GGUF file with llama.cpp's tensor
names and metadata keys (the ``gguf`` package's writer), converted here the way llama.cpp's ``convert_hf_to_gguf.py``
(``conversion/llada.py``, ``conversion/dream.py``) does — independently of ``localdiff``:

* LLaDA: q/k rows permuted (``LLaDAModel.permute``: llama.cpp gives LLaDA the interleaved "NORM" RoPE, the checkpoint
  is in the half-split layout), ``diffusion.shift_logits`` = false, ``<arch>.rope.dimension_count``.
* LLaDA-MoE: experts stacked into ``blk.N.ffn_{gate,up,down}_exps`` (3-D), q/k norms, router ``ffn_gate_inp`` kept
  F32, ``expert_feed_forward_length``, shift false. llama.cpp's graph has MoE in every layer, no shared expert, no
  expert bias: the tiny model is built that way.
* Dream: Qwen2 names with q/k/v biases, no shift key (llama.cpp's default: shifted).

F32 files, or Q8_0 (every ≥2-D weight whose rows are a multiple of 32, router excepted; norms and biases F32, as the
converter does). The vocabulary is a GPT-2 byte-level one: printable ASCII + newline, a few merges, control tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

#: CI sets LOCALDIFF_REQUIRE_GGUF=1: a missing gguf / llama_cpp is then a failure, not a skip
REQUIRED = os.environ.get("LOCALDIFF_REQUIRE_GGUF") == "1"


def need(module: str):
    """Import ``module`` for a GGUF test, or skip it (fail under LOCALDIFF_REQUIRE_GGUF=1) naming the extra."""
    import pytest

    try:
        mod = __import__(module)
        if getattr(mod, "__file__", None) is None:  # a folder of that name on sys.path, not the package
            raise ImportError(f"{module} resolves to a namespace package at {list(mod.__path__)}")
        return mod
    except ImportError as e:
        if REQUIRED:
            pytest.fail(f"LOCALDIFF_REQUIRE_GGUF=1 but {module} is not importable ({e})")
        pytest.skip(f'{module} not installed (pip install "localdiff[gguf]")')


MASK, EOS, PAD = 126, 125, 124
SPECIALS = {
    120: "<|user|>",
    121: "<|assistant|>",
    122: "<|bos|>",
    123: "<|end|>",
    PAD: "<|pad|>",
    EOS: "<|eos|>",
    MASK: "<|mask|>",
}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }}"
    "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def dims(family: str, q8: bool = False) -> dict:
    """Sizes: odd ones for F32; rows that are multiples of 32 for Q8_0 (its blocks hold 32 values)."""
    if q8:
        d = dict(h=64, heads=4, kv=4 if family != "dream" else 2, inter=96, layers=3, vocab=131)
    else:
        d = dict(h=48, heads=3, kv=3 if family != "dream" else 1, inter=72, layers=3, vocab=131)
    if family == "lladamoe":
        d.update(experts=5, top_k=3, exp_inter=32 if q8 else 24)
    return d


def _rand(g, shape, std=0.08, one=False):
    x = torch.randn(shape, generator=g)
    return 1 + 0.1 * x if one else std * x


def upstream(family: str, d: dict, seed: int = 0) -> tuple[dict, dict]:
    """(config.json dict, state dict) in ``family``'s upstream layout with random weights."""
    g = torch.Generator().manual_seed(seed)
    h, heads, kv, inter, v, n = d["h"], d["heads"], d["kv"], d["inter"], d["vocab"], d["layers"]
    hd = h // heads
    ids = dict(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD)
    sd = {}
    if family == "llada":
        t = "model.transformer."
        sd[t + "wte.weight"] = _rand(g, (v, h), 0.5)
        for i in range(n):
            b = f"{t}blocks.{i}."
            sd[b + "q_proj.weight"] = _rand(g, (heads * hd, h))
            sd[b + "k_proj.weight"] = _rand(g, (kv * hd, h))
            sd[b + "v_proj.weight"] = _rand(g, (kv * hd, h))
            sd[b + "attn_out.weight"] = _rand(g, (h, heads * hd))
            sd[b + "ff_proj.weight"] = _rand(g, (inter, h))
            sd[b + "up_proj.weight"] = _rand(g, (inter, h))
            sd[b + "ff_out.weight"] = _rand(g, (h, inter))
            sd[b + "attn_norm.weight"] = _rand(g, (h,), one=True)
            sd[b + "ff_norm.weight"] = _rand(g, (h,), one=True)
        sd[t + "ln_f.weight"] = _rand(g, (h,), one=True)
        sd[t + "ff_out.weight"] = _rand(g, (v, h), 0.3)
        cfg = dict(
            model_type="llada",
            architectures=["LLaDAModelLM"],
            d_model=h,
            n_heads=heads,
            n_kv_heads=kv,
            n_layers=n,
            mlp_hidden_size=inter,
            mlp_ratio=4,
            vocab_size=v,
            embedding_size=v,
            weight_tying=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_sequence_length=512,
            block_type="llama",
            layer_norm_type="rms",
            activation_type="silu",
            rope=True,
            rope_full_precision=True,
            include_bias=False,
            include_qkv_bias=False,
            alibi=False,
            **ids,
        )
        return cfg, sd
    sd["model.embed_tokens.weight"] = _rand(g, (v, h), 0.5)
    for i in range(n):
        b = f"model.layers.{i}."
        sd[b + "self_attn.q_proj.weight"] = _rand(g, (heads * hd, h))
        sd[b + "self_attn.k_proj.weight"] = _rand(g, (kv * hd, h))
        sd[b + "self_attn.v_proj.weight"] = _rand(g, (kv * hd, h))
        sd[b + "self_attn.o_proj.weight"] = _rand(g, (h, heads * hd))
        sd[b + "input_layernorm.weight"] = _rand(g, (h,), one=True)
        sd[b + "post_attention_layernorm.weight"] = _rand(g, (h,), one=True)
        if family == "dream":
            for p in "qkv":
                sd[b + f"self_attn.{p}_proj.bias"] = _rand(g, (sd[b + f"self_attn.{p}_proj.weight"].shape[0],))
            sd[b + "mlp.gate_proj.weight"] = _rand(g, (inter, h))
            sd[b + "mlp.up_proj.weight"] = _rand(g, (inter, h))
            sd[b + "mlp.down_proj.weight"] = _rand(g, (h, inter))
        else:
            sd[b + "self_attn.q_norm.weight"] = _rand(g, (hd,), one=True)
            sd[b + "self_attn.k_norm.weight"] = _rand(g, (hd,), one=True)
            sd[b + "mlp.gate.weight"] = _rand(g, (d["experts"], h), 0.3)
            for e in range(d["experts"]):
                sd[b + f"mlp.experts.{e}.gate_proj.weight"] = _rand(g, (d["exp_inter"], h))
                sd[b + f"mlp.experts.{e}.up_proj.weight"] = _rand(g, (d["exp_inter"], h))
                sd[b + f"mlp.experts.{e}.down_proj.weight"] = _rand(g, (h, d["exp_inter"]))
    sd["model.norm.weight"] = _rand(g, (h,), one=True)
    sd["lm_head.weight"] = _rand(g, (v, h), 0.3)
    if family == "dream":
        cfg = dict(
            model_type="Dream",
            architectures=["DreamModel"],
            hidden_size=h,
            intermediate_size=inter,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            use_sliding_window=False,
            vocab_size=v,
            **ids,
        )
    else:
        cfg = dict(
            model_type="llada",
            architectures=["LLaDAMoEModelLM"],
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            dense_intermediate_size=inter,
            expert_intermediate_size=d["exp_inter"],
            shared_expert_intermediate_size=None,
            num_experts=d["experts"],
            num_experts_per_tok=d["top_k"],
            moe_layer_freq=[1] * n,
            qk_layernorm=True,
            norm_topk_prob=False,
            moe_router_enable_expert_bias=False,
            moe_router_score_function="softmax",
            rope_theta=50000.0,
            partial_rotary_factor=1.0,
            rope_scaling=None,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            attention_bias=False,
            clip_qkv=None,
            vocab_size=v,
            **ids,
        )
    return cfg, sd


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf ``LLaDAModel.permute``: half-split RoPE rows → interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(family: str, cfg: dict, sd: dict) -> dict:
    """The upstream state dict under llama.cpp's tensor names (numpy float32, numpy shape = torch shape)."""
    out = {}
    if family == "llada":
        t = "model.transformer."
        out["token_embd.weight"] = sd[t + "wte.weight"]
        out["output_norm.weight"] = sd[t + "ln_f.weight"]
        out["output.weight"] = sd[t + "ff_out.weight"]
        names = {
            "q_proj": "attn_q",
            "k_proj": "attn_k",
            "v_proj": "attn_v",
            "attn_out": "attn_output",
            "ff_proj": "ffn_gate",
            "up_proj": "ffn_up",
            "ff_out": "ffn_down",
            "attn_norm": "attn_norm",
            "ff_norm": "ffn_norm",
        }
        for i in range(cfg["n_layers"]):
            for up, ours in names.items():
                w = sd[f"{t}blocks.{i}.{up}.weight"]
                if up == "q_proj":
                    w = _permute(w, cfg["n_heads"])
                elif up == "k_proj":
                    w = _permute(w, cfg["n_kv_heads"])
                out[f"blk.{i}.{ours}.weight"] = w
    else:
        out["token_embd.weight"] = sd["model.embed_tokens.weight"]
        out["output_norm.weight"] = sd["model.norm.weight"]
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
            if family == "lladamoe":
                for w in ("gate", "up", "down"):
                    out[f"blk.{i}.ffn_{w}_exps.weight"] = torch.stack(
                        [sd[f"{b}mlp.experts.{e}.{w}_proj.weight"] for e in range(cfg["num_experts"])]
                    )
    return {k: v.float().numpy() for k, v in out.items()}


def _vocab(v: int):
    """GPT-2 byte-level tokens: 0..94 = bytes 0x20..0x7e, 95 = newline, 96.. merges, then SPECIALS, the rest unused."""

    def b2u(b):  # GPT-2 bytes_to_unicode for the bytes used here
        return chr(b + 256) if b in (0x20, 0x0A) else chr(b)

    toks = [b2u(b) for b in range(0x20, 0x7F)] + [b2u(0x0A)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
    for a, b in merges:
        toks.append(a + b)
    types = [1] * len(toks)
    while len(toks) < v:
        i = len(toks)
        toks.append(SPECIALS.get(i, f"[PAD{i}]"))
        types.append(3 if i in SPECIALS else 5)  # CONTROL / UNUSED
    return toks, types, [f"{a} {b}" for a, b in merges]


def write_gguf(
    family: str,
    cfg: dict,
    sd: dict,
    path,
    q8: bool = False,
    arch: str | None = None,
    chat_template: str | None = TEMPLATE,
) -> None:
    """Write the GGUF file of an upstream checkpoint (see the module docstring). ``arch`` overrides
    ``general.architecture`` (a "llama" file for the bad-input test)."""
    import gguf

    a = arch or {"llada": "llada", "lladamoe": "llada-moe", "dream": "dream"}[family]
    w = gguf.GGUFWriter(str(path), a)
    llada = family == "llada"
    h = cfg["d_model"] if llada else cfg["hidden_size"]
    heads = cfg["n_heads"] if llada else cfg["num_attention_heads"]
    kv = cfg["n_kv_heads"] if llada else cfg["num_key_value_heads"]
    n = cfg["n_layers"] if llada else cfg["num_hidden_layers"]
    w.add_context_length(cfg.get("max_sequence_length", cfg.get("max_position_embeddings")))
    w.add_embedding_length(h)
    w.add_block_count(n)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    if family == "lladamoe":
        w.add_feed_forward_length(cfg["dense_intermediate_size"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["expert_intermediate_size"])
    else:
        w.add_feed_forward_length(cfg["mlp_hidden_size"] if llada else cfg["intermediate_size"])
    if llada:
        w.add_rope_dimension_count(h // heads)
    if family != "dream":
        w.add_diffusion_shift_logits(False)
    w.add_causal_attention(False)
    toks, types, merges = _vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(122)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(PAD)
    w.add_mask_token_id(MASK)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for name, t in gguf_tensors(family, cfg, sd).items():
        if q8 and t.ndim >= 2 and t.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:
            w.add_tensor(
                name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_rounded(sd: dict) -> dict:
    """The state dict with every tensor the Q8_0 file quantizes replaced by its Q8_0 values (quantize → dequantize
    with the ``gguf`` package; blocks run along rows, so this commutes with LLaDA's row permutation)."""
    import gguf

    q = gguf.GGMLQuantizationType.Q8_0
    out = {}
    for k, v in sd.items():
        if v.dim() >= 2 and v.shape[-1] % 32 == 0 and not k.endswith("mlp.gate.weight"):
            v = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.float().numpy(), q), q).copy())
        out[k] = v
    return out


def write_both(family: str, folder, q8: bool = False, seed: int = 0):
    """The safetensors checkpoint folder ``folder/hf`` (the original weights; with ``q8`` also ``folder/hf_q8``:
    the same weights rounded to Q8_0 values) and ``folder/model-{F32,Q8_0}.gguf`` of one random model; returns
    (checkpoint folder, gguf path)."""
    d = dims(family, q8)
    cfg, sd = upstream(family, d, seed)
    folders = {"hf": sd, **({"hf_q8": q8_rounded(sd)} if q8 else {})}
    for name, state in folders.items():
        hf = folder / name
        hf.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(hf / "model.safetensors"))
        (hf / "config.json").write_text(json.dumps(cfg))
    path = folder / ("model-Q8_0.gguf" if q8 else "model-F32.gguf")
    write_gguf(family, cfg, sd, path, q8)
    return folder / "hf", path


__all__ = ["write_both", "write_gguf", "upstream", "dims", "np"]
