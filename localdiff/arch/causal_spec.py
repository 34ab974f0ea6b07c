"""Autoregressive causal LMs (torch-free spec): Qwen3 (``model_type: "qwen3"``, ``Qwen3ForCausalLM``) and Llama
(``"llama"``, ``LlamaForCausalLM``: Llama 2 / 3 / 3.1 / 3.2, SmolLM2), parsed into one :class:`CausalConfig`.

They are the targets of DFlash speculative decoding (arXiv 2602.06036) and plain AR models in their own right. Keys
as transformers 5.23.0 ``models/{qwen3,llama}/configuration_*.py``; tensor names as
:mod:`localdiff.arch.llama_base_spec` (one dense stack, :func:`localdiff.arch.llama_base_spec.config_tensor_shapes`),
the checkpoint's ``model.`` prefix added by :mod:`localdiff.arch.llama_base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.base import parameter_counts as _counts
from localdiff.arch.llama_base_spec import config_tensor_shapes as stack_shapes
from localdiff.arch.spec_parts import DenseOnly, StackShape, _int, _rope, check_heads, full_attention_geometry, id_tuple

MODEL_TYPE = "qwen3"
MODEL_TYPES = ("qwen3", "llama")
FAMILY = "causal"
ARCHITECTURE = "Qwen3ForCausalLM"
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True)
class CausalConfig(StackShape, DenseOnly):
    """Hyper-parameters of a Qwen3 / Llama checkpoint (the attributes :class:`localdiff.arch.dense.DenseStack`
    reads, plus the special ids). ``eos_token_id`` is a tuple (Llama 3 lists several)."""

    model_type: str
    eos_token_id: tuple
    pad_token_id: int | None
    bos_token_id: int | None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    rope_fp32: bool = False
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0
    mask_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def parse_config(raw: dict) -> CausalConfig:
    """The :class:`CausalConfig` of a Qwen3 / Llama config.json dict.

    Raises:
        ValueError: a missing field, an unsupported option (sliding windows, attention / MLP biases, an unsupported
            rope type: each named), or inconsistent head counts.
    """
    mt = raw.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not a causal type ({', '.join(MODEL_TYPES)})")
    if raw.get("use_sliding_window"):
        raise ValueError("field 'use_sliding_window' = true is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"field '{key}' = true is not supported (Qwen3 / Llama checkpoints have none)")
    h, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    kv = _int(raw, "num_key_value_heads", heads)
    head_dim = int(raw.get("head_dim") or h // max(heads, 1))
    vocab = _int(raw, "vocab_size")
    check_heads(h, heads, kv, head_dim, _int(raw, "num_hidden_layers"))
    pad = raw.get("pad_token_id")
    bos = raw.get("bos_token_id")
    return CausalConfig(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_parameters=_rope(raw, 10000.0 if mt == "llama" else None),
        eos_token_id=id_tuple(raw.get("eos_token_id")),
        pad_token_id=None if pad is None else int(pad),
        bos_token_id=None if bos is None else int(bos),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 32768 if mt == "qwen3" else 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=mt == "qwen3",
        raw=raw,
    )


def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer."""
    return full_attention_geometry(parse_config(raw))


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every weight tensor (our names, :func:`localdiff.arch.llama_base_spec.config_tensor_shapes`)."""
    return stack_shapes(parse_config(raw), include_buffers)


def parameter_counts(raw: dict) -> dict:
    """``total``, ``active_per_token`` (= total: dense) and ``by_component``."""
    return _counts(tensor_shapes(raw, include_buffers=False))


def summary_fields(raw: dict) -> dict:
    """``show``'s family fields: the special ids and whether the LM head is tied."""
    c = parse_config(raw)
    return {
        "eos_token_id": list(c.eos_token_id),
        "pad_token_id": c.pad_token_id,
        "tie_word_embeddings": c.tie_word_embeddings,
    }


def architecture_name(raw: dict) -> str:
    """The upstream class name of a config."""
    return _ARCHITECTURES.get(raw.get("model_type"), ARCHITECTURE)
