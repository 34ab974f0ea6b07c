"""ReFusion's config (torch-free): a Qwen3 causal LM with a mask token (GSAI-ML/ReFusion, arXiv 2512.13586).

The Hub checkpoint is Qwen3-8B fine-tuned by ML-GSAI/ReFusion ``train.py``: its ``config.json`` is a plain Qwen3
config (``model_type: "qwen3"``, ``architectures: ["Qwen3ForCausalLM"]``) to which the training script adds
``bos_token_id = 151669`` (``<|beginoftext|>``) and ``mask_token_id = 151670`` (``<|mask|>``), the two tokens it
appends to the tokenizer (``resize_token_embeddings``). :data:`localdiff.arch.MARKERS` routes a Qwen3 config that
carries ``mask_token_id`` here; ``model_type: "refusion"`` is accepted too.

Math: Qwen3 (transformers ``models/qwen3/modeling_qwen3.py``; ReFusion's ``qwen3/modeling_qwen3_refusion.py`` is
the same forward with explicit ``position_ids``): per-head q/k RMSNorm before RoPE, no q/k/v bias by default
(``attention_bias``), SwiGLU, untied LM head unless ``tie_word_embeddings``. Tensor names are ours (as in
:mod:`localdiff.arch.llama_base_spec`); :func:`localdiff.arch.llama_base.checkpoint_names` maps them to ``model.*``.
"""

from __future__ import annotations

from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.base import parameter_counts as _counts
from localdiff.arch.llama_base_spec import LlamaConfig, config_tensor_shapes
from localdiff.arch.spec_parts import _int, _rope, check_heads, check_mask_id, full_attention_geometry, id_tuple

MODEL_TYPE = "refusion"
#: the registry key and the config.json model_types this spec parses
MODEL_TYPES = ("refusion", "qwen3")
FAMILY = "slots"
ARCHITECTURE = "Qwen3ForCausalLM"
#: ReFusion's added tokens and Qwen3's own specials (used when config.json omits them and they fit the vocabulary)
MASK_ID, BOS_ID, EOS_ID, PAD_ID = 151670, 151669, 151645, 151643


def _opt_id(raw: dict, key: str, default: int, vocab: int):
    v = raw.get(key, default if default < vocab else None)
    if isinstance(v, (list, tuple)):
        return tuple(int(e) for e in v)
    return None if v is None else int(v)


def parse_config(raw: dict) -> LlamaConfig:
    """The args of a config.json dict (Qwen3 keys) as the Llama/Qwen field set every dense model here shares
    (:class:`localdiff.arch.llama_base_spec.LlamaConfig`), with ``model_type`` "refusion" (the registry key),
    ``qk_norm`` on (Qwen3), ``embedding_rows`` = ``vocab_size``.

    Raises:
        ValueError: a missing or malformed field (named), sliding-window attention, no mask id in the vocabulary,
            mask id equal to the pad id, or head counts that do not divide.
    """
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {raw.get('model_type')!r} is not ReFusion's ({', '.join(MODEL_TYPES)})")
    if raw.get("use_sliding_window"):
        raise ValueError("field 'use_sliding_window' = true is not supported (ReFusion attends to all tokens)")
    h, heads, vocab = _int(raw, "hidden_size"), _int(raw, "num_attention_heads"), _int(raw, "vocab_size")
    kv = _int(raw, "num_key_value_heads", heads)
    head_dim = int(raw.get("head_dim") or h // max(heads, 1))
    layers = _int(raw, "num_hidden_layers")
    check_heads(h, heads, kv, head_dim, layers)
    mask = _opt_id(raw, "mask_token_id", MASK_ID, vocab)
    if mask is None:
        raise ValueError("missing field 'mask_token_id'")
    eos = id_tuple(_opt_id(raw, "eos_token_id", EOS_ID, vocab))
    pad = _opt_id(raw, "pad_token_id", PAD_ID, vocab)
    check_mask_id(mask, pad, vocab)
    return LlamaConfig(
        model_type=MODEL_TYPE,
        vocab_size=vocab,
        embedding_rows=vocab,
        qk_norm=True,
        hidden_size=h,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_parameters=_rope(raw),
        mask_token_id=mask,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=_opt_id(raw, "bos_token_id", BOS_ID, vocab),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 40960),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias")),
        raw=raw,
    )


# -- the spec contract (localdiff.arch.base.ArchSpec) -------------------------------------------------------------
def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer."""
    return full_attention_geometry(parse_config(raw))


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every weight tensor, our names. Components: ``embeddings``, ``attention``, ``attention_norms``,
    ``dense_mlp``, ``norms``, ``lm_head`` (untied only)."""
    return config_tensor_shapes(parse_config(raw), include_buffers)


def parameter_counts(raw: dict) -> dict:
    """``total`` (= ``active_per_token``: dense) and ``by_component``."""
    return _counts(tensor_shapes(raw, include_buffers=False))


def summary_fields(raw: dict) -> dict:
    """Family-specific fields of ``localdiff show``: the special ids."""
    c = parse_config(raw)
    return {
        "mask_token_id": c.mask_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_id),
        "pad_token_id": c.pad_token_id,
    }


def architecture_name(raw: dict) -> str:
    """The upstream class name (ReFusion's ``qwen3.modeling_qwen3_refusion.Qwen3ForCausalLM``)."""
    return ARCHITECTURE
