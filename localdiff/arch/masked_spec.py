"""Masked-diffusion configs (torch-free): LLaDA (OLMo-style ``config.json`` keys), LLaDA-MoE, Dream / DiffuCoder
(Qwen2 keys) and dllm-hub's A2D Qwen3 (Qwen3 keys), parsed into one
:class:`localdiff.arch.llama_base_spec.LlamaConfig`.

Sources (read, not copied): LLaDA ``configuration_llada.py`` / ``modeling_llada.py`` (``LLaDALlamaBlock``;
``effective_n_kv_heads``; ``embedding_size``; ``weight_tying``), the LLaDA-MoE Hub ``configuration_lladamoe.py`` /
``modeling_lladamoe.py`` (its config.json says ``model_type: "llada"`` with ``architectures: ["LLaDAMoEModelLM"]``;
dllm renames it ``"lladamoe"``), Dream's ``configuration_dream.py`` (``model_type: "Dream"``, mask 151666, pad
151643), dllm ``a2d/models/qwen3`` (``model_type: "a2d-qwen3"``, a Qwen3Config; the tokenizer appends
``<|mask|>`` = 151669 after Qwen3's 151669 tokens).

Config and tensor names: the Llama-style stack's (:class:`localdiff.arch.llama_base_spec.LlamaConfig`,
:func:`localdiff.arch.llama_base_spec.config_tensor_shapes`); the model modules map them to each checkpoint's names.
"""

from __future__ import annotations

from localdiff.arch import canonical_type as _registry_type
from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.llama_base_spec import LlamaConfig, config_tensor_shapes
from localdiff.arch.spec_parts import (
    _int,
    _refuse,
    _rope,
    check_heads,
    check_mask_id,
    check_top_k,
    full_attention_geometry,
    id_tuple,
    moe_parameter_counts,
)

MODEL_TYPE = "llada"
#: every config.json model_type this spec parses (after alias resolution in localdiff.arch)
MODEL_TYPES = ("llada", "lladamoe", "Dream", "a2d-qwen3")
FAMILY = "masked"
ARCHITECTURE = "LLaDAModelLM"
_ARCHITECTURES = {
    "llada": "LLaDAModelLM",
    "lladamoe": "LLaDAMoEModelLM",
    "Dream": "DreamModel",
    "a2d-qwen3": "A2DQwen3LMHeadModel",
}
#: (mask, eos, pad, bos) used when config.json omits them — the values upstream code hard-codes for each model_type
DEFAULT_IDS = {
    "llada": (126336, 126081, 126081, 126080),
    "lladamoe": (156895, 156892, 156892, None),
    "Dream": (151666, 151643, 151643, 151643),
    "a2d-qwen3": (151669, 151645, 151643, 151643),
}


# -- parsing ------------------------------------------------------------------------------------------------------
def _ids(raw: dict, mt: str, vocab: int) -> tuple:
    """(mask, eos tuple, pad, bos) from the config, else the model_type's defaults (a default eos / pad / bos
    outside the vocabulary — a tiny test checkpoint — is dropped; the mask id never is)."""
    mask_d, eos_d, pad_d, bos_d = (
        d if d is None or i == 0 or d < vocab else None for i, d in enumerate(DEFAULT_IDS[mt])
    )
    mask = raw.get("mask_token_id", mask_d)
    if mask is None:
        raise ValueError("missing field 'mask_token_id'")
    eos = id_tuple(raw.get("eos_token_id", eos_d))
    pad = raw.get("pad_token_id", pad_d)
    return int(mask), eos, (None if pad is None else int(pad)), raw.get("bos_token_id", bos_d)


def _llada(raw: dict) -> dict:
    """LLaDA / OLMo keys (``LLaDALlamaBlock``). Only the combination LLaDA checkpoints use is accepted."""
    _refuse(raw, "block_type", ("llama",))
    _refuse(raw, "layer_norm_type", ("rms",))
    _refuse(raw, "activation_type", ("silu",))
    for key, ok in (
        ("rope", (True,)),
        ("alibi", (False,)),
        ("include_bias", (False,)),
        ("scale_logits", (False,)),
        ("input_emb_norm", (False,)),
        ("attention_layer_norm", (False,)),
        ("bias_for_layer_norm", (False, None)),
        ("layer_norm_with_affine", (True,)),
    ):
        _refuse(raw, key, ok)
    if "layer_norm_type" not in raw:
        raise ValueError("missing field 'layer_norm_type' (LLaDA checkpoints use \"rms\")")
    d, heads = _int(raw, "d_model"), _int(raw, "n_heads")
    kv = raw.get("n_kv_heads")
    kv = int(kv) if kv is not None else (1 if raw.get("multi_query_attention") else heads)
    inter = raw.get("mlp_hidden_size") or _int(raw, "mlp_ratio", 4) * d
    vocab = _int(raw, "vocab_size")
    rows = _int(raw, "embedding_size", vocab)
    if rows < vocab:
        raise ValueError(f"field 'embedding_size' ({rows}) is smaller than 'vocab_size' ({vocab})")
    return dict(
        vocab_size=vocab,
        embedding_rows=rows,
        hidden_size=d,
        intermediate_size=int(inter),
        num_hidden_layers=_int(raw, "n_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d // max(heads, 1),
        rope_parameters=_rope(raw, 10000.0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_fp32=bool(raw.get("rope_full_precision", True)),
        max_position_embeddings=_int(raw, "max_sequence_length", 1024),
        tie_word_embeddings=bool(raw.get("weight_tying", True)),
        qkv_bias=bool(raw.get("include_qkv_bias")),
    )


def _hf(raw: dict, mt: str) -> dict:
    """Llama / Qwen2 / Qwen3 / LLaDA-MoE keys."""
    if raw.get("use_sliding_window"):
        raise ValueError("field 'use_sliding_window' = true is not supported (masked models attend to all tokens)")
    h, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") if mt == "a2d-qwen3" else None
    vocab = _int(raw, "vocab_size")
    out = dict(
        vocab_size=vocab,
        embedding_rows=vocab,
        hidden_size=h,
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=int(head_dim or h // max(heads, 1)),
        rope_parameters=_rope(raw, 10000.0 if mt == "Dream" else None),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5 if mt == "lladamoe" else 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 4096 if mt == "lladamoe" else 32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    if mt == "Dream":
        out.update(intermediate_size=_int(raw, "intermediate_size"), qkv_bias=True, shift_logits=True)
    elif mt == "a2d-qwen3":
        out.update(
            intermediate_size=_int(raw, "intermediate_size"), qkv_bias=bool(raw.get("attention_bias")), qk_norm=True
        )
    else:  # lladamoe
        _refuse(raw, "moe_router_score_function", ("softmax", None))
        n, e = out["num_hidden_layers"], _int(raw, "num_experts")
        freq = list(raw.get("moe_layer_freq") or [1] * n)
        if len(freq) != n:
            raise ValueError(f"field 'moe_layer_freq' has {len(freq)} entries, num_hidden_layers is {n}")
        shared = raw.get("shared_expert_intermediate_size")
        k = _int(raw, "num_experts_per_tok")
        check_top_k(k, e)
        out.update(
            intermediate_size=max(0, int(raw.get("dense_intermediate_size") or 0)),
            qkv_bias=bool(raw.get("attention_bias")),
            qk_norm=bool(raw.get("qk_layernorm")),
            clip_qkv=raw.get("clip_qkv"),
            num_experts=e,
            num_experts_per_tok=k,
            moe_intermediate_size=_int(raw, "expert_intermediate_size"),
            shared_expert_intermediate_size=max(0, int(shared or 0)),
            norm_topk_prob=False,  # the Hub code hard-codes False whatever the config says
            expert_bias=bool(raw.get("moe_router_enable_expert_bias")),
            moe_layers=tuple(bool(f) for f in freq),
        )
        if not all(freq) and out["intermediate_size"] <= 0:
            raise ValueError("missing field 'dense_intermediate_size' (moe_layer_freq has dense layers)")
        if out["head_dim"] * heads != h:
            raise ValueError(f"hidden_size ({h}) must be num_attention_heads × head dim")
    return out


def parse_config(raw: dict) -> LlamaConfig:
    """The :class:`LlamaConfig` of a masked-diffusion config.json dict (its model_type: the registry's
    :func:`localdiff.arch.canonical_type`, e.g. LLaDA-MoE's "llada" with ``LLaDAMoEModelLM`` is "lladamoe").

    Raises:
        ValueError: a missing field the family needs, an unsupported option (both named), mask id missing with no
            known default, mask id equal to the pad id, or ids outside the vocabulary.
    """
    mt = _registry_type(raw)
    if mt not in DEFAULT_IDS:
        raise ValueError(
            f"model_type {raw.get('model_type')!r} is not a masked-diffusion type ({', '.join(MODEL_TYPES)})"
        )
    fields = _llada(raw) if mt == "llada" else _hf(raw, mt)
    mask, eos, pad, bos = _ids(raw, mt, fields["vocab_size"])
    check_mask_id(mask, pad, fields["vocab_size"])
    check_heads(
        fields["hidden_size"],
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
        fields["head_dim"],
        fields["num_hidden_layers"],
    )
    return LlamaConfig(
        model_type=mt,
        mask_token_id=mask,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None if bos is None else int(bos),
        raw=raw,
        **fields,
    )


# -- the spec contract (localdiff.arch.base.ArchSpec) -------------------------------------------------------------
def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer (no sliding windows, keys and values separate)."""
    return full_attention_geometry(parse_config(raw))


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every weight tensor the config implies, with our names (see the module docstring). Components:
    ``embeddings``, ``lm_head`` (untied only), ``attention``, ``attention_norms``, ``dense_mlp``, ``router``
    (gate + the ``expert_bias`` buffer), ``experts``, ``shared_expert``, ``norms``."""
    return config_tensor_shapes(parse_config(raw), include_buffers)


def parameter_counts(raw: dict) -> dict:
    """``total``, ``active_per_token`` (total minus the routed experts a token does not use) and ``by_component``."""
    return moe_parameter_counts(parse_config(raw), tensor_shapes(raw, include_buffers=False))


def text_fields(raw: dict) -> dict:
    """The summary's common fields under their Llama names (LLaDA's config says d_model, n_heads, ...)."""
    c = parse_config(raw)
    return {
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
    }


def summary_fields(raw: dict) -> dict:
    """Family-specific fields of ``localdiff show``: the special ids, logit shift, and experts when MoE."""
    c = parse_config(raw)
    out = {
        "mask_token_id": c.mask_token_id,
        "eos_token_id": list(c.eos_token_id),
        "pad_token_id": c.pad_token_id,
        "shift_logits": c.shift_logits,
    }
    if c.num_experts:
        out["experts"] = {
            "total": c.num_experts,
            "top_k": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "shared_intermediate_size": c.shared_expert_intermediate_size,
            "moe_layers": sum(c.moe_layers),
        }
    return out


def architecture_name(raw: dict) -> str:
    """The upstream class name of a config (for ``show`` when config.json lacks ``architectures``)."""
    return _ARCHITECTURES.get(_registry_type(raw), ARCHITECTURE)
