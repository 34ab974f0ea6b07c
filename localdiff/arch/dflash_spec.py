"""DFlash draft models (torch-free spec): the block-diffusion drafter of DFlash speculative decoding (arXiv 2602.06036;
z-lab/dflash ``dflash/model.py``, ``DFlashDraftModel``). Hub layout (e.g. ``z-lab/Qwen3-8B-DFlash-b16``): a Qwen3
config.json (``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``: :mod:`localdiff.arch` aliases it to
``"dflash"``) with ``block_size``, ``num_target_layers`` and ``dflash_config`` {``target_layer_ids``,
``mask_token_id``}; tensors ``layers.N.*`` (Qwen3 decoder layers), ``fc.weight`` [H, k·H_target], ``hidden_norm``,
``norm`` — no embeddings and no LM head: the target's are reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.base import parameter_counts as _counts
from localdiff.arch.llama_base_spec import config_tensor_shapes as stack_shapes
from localdiff.arch.spec_parts import DenseOnly, StackShape, _int, _rope, check_heads, full_attention_geometry

MODEL_TYPE = "dflash"
MODEL_TYPES = ("dflash",)
FAMILY = "drafts"
ARCHITECTURE = "DFlashDraftModel"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers whose outputs a draft reads when its config does not list them (z-lab/dflash
    ``build_target_layer_ids``): the middle layer for a one-layer draft, else ``num_draft_layers`` ids spread evenly
    (rounded) from layer 1 to layer ``num_target_layers − 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig(StackShape, DenseOnly):
    """A draft's hyper-parameters: the Qwen3 layer shape (attributes of :class:`localdiff.arch.dense.DecoderLayer`),
    ``block_size`` (tokens per drafted block, the last accepted token included), ``target_layer_ids``,
    ``mask_token_id``, ``target_hidden_size`` (= hidden_size, as upstream: the fc input is k·hidden_size), and the optional scalars
    ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping`` (None = off)."""

    block_size: int
    target_layer_ids: tuple
    mask_token_id: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    model_type: str = "dflash"
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_fp32: bool = False
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = True  # no LM head of its own
    eos_token_id: tuple = ()
    pad_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def _value(raw: dict, name: str, default=None):
    """``dflash_config[name]``, else the top-level key, else ``default`` (z-lab/dflash ``_draft_value``)."""
    dc = raw.get("dflash_config") or {}
    return dc.get(name, raw.get(name, default))


def parse_config(raw: dict) -> DFlashConfig:
    """The :class:`DFlashConfig` of a draft's config.json.

    Raises:
        ValueError: a missing field (``mask_token_id`` included), sliding-window or causal draft layers, the
            DFlash2 variant (convolutions + candidate selector), inconsistent head counts, or target layer ids out
            of range.
    """
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise ValueError("DFlash2 drafts (DFlash2DraftModel) are not supported; DFlashDraftModel is")
    if any(t != "full_attention" for t in raw.get("layer_types") or ()) or raw.get("is_causal"):
        raise ValueError("field 'layer_types' / 'is_causal': only non-causal full-attention draft layers are supported")
    if raw.get("attention_bias"):
        raise ValueError("field 'attention_bias' = true is not supported")
    h, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    n, kv = _int(raw, "num_hidden_layers"), _int(raw, "num_key_value_heads", heads)
    head_dim = int(raw.get("head_dim") or h // max(heads, 1))
    check_heads(h, heads, kv, head_dim, n)
    n_target = _int(raw, "num_target_layers", 0)
    ids = _value(raw, "target_layer_ids")
    if ids is None:
        if n_target <= 0:
            raise ValueError("missing field 'dflash_config.target_layer_ids' (or 'num_target_layers')")
        ids = build_target_layer_ids(n_target, n)
    ids = tuple(int(i) for i in ids)
    if not ids or min(ids) < 0 or (n_target and max(ids) >= n_target):
        raise ValueError(f"field 'target_layer_ids' {list(ids)} is out of range for {n_target} target layers")
    mask = _value(raw, "mask_token_id")
    if mask is None:
        raise ValueError("missing field 'dflash_config.mask_token_id'")
    vocab = _int(raw, "vocab_size")
    if not 0 <= int(mask) < vocab:
        raise ValueError(f"field 'mask_token_id' ({mask}) is outside the vocabulary (vocab_size {vocab})")
    cap = _value(raw, "final_logit_softcapping")
    block = int(_value(raw, "block_size", 16))
    if block < 1:
        raise ValueError(f"field 'block_size' must be ≥ 1 (got {block})")
    return DFlashConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_parameters=_rope(raw),
        block_size=block,
        target_layer_ids=ids,
        mask_token_id=int(mask),
        target_hidden_size=h,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 40960),
        input_embedding_scale=float(_value(raw, "input_embedding_scale", 1.0)),
        output_multiplier=float(_value(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=float(cap) if cap is not None and float(cap) > 0 else None,
        raw=raw,
    )


def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention layer geometry per draft layer (its cache holds the context's K/V)."""
    return full_attention_geometry(parse_config(raw))


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """The draft's tensors: the Qwen3 layers and final norm (no embeddings, no LM head), ``fc`` and
    ``hidden_norm`` (component ``context``)."""
    c = parse_config(raw)
    out = [t for t in stack_shapes(c, include_buffers) if t.component != "embeddings"]
    k = len(c.target_layer_ids) * c.target_hidden_size
    return out + [
        Tensorish("context", None, "fc.weight", (c.hidden_size, k)),
        Tensorish("context", None, "hidden_norm.weight", (c.hidden_size,)),
    ]


def parameter_counts(raw: dict) -> dict:
    """``total`` (= active) and ``by_component``."""
    return _counts(tensor_shapes(raw, include_buffers=False))


def summary_fields(raw: dict) -> dict:
    """``show``'s fields for a draft."""
    c = parse_config(raw)
    return {"block_size": c.block_size, "target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id}


def architecture_name(raw: dict) -> str:
    return ARCHITECTURE
