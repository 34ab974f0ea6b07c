"""Parsing and checking parts the torch-free specs share (``*_spec.py``): config.json field readers, the checks
every Llama-shaped config gets (head counts, special ids, top-k), the full-attention layer geometry and the
parameter count of a dense / MoE stack.

Errors are ``ValueError`` with the config.json field named, one line (the loader turns them into
:class:`localdiff.errors.CheckpointError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.base import parameter_counts as _counts


# -- field readers ------------------------------------------------------------------------------------------------
def _req(raw: dict, key: str):
    v = raw.get(key)
    if v is None:
        raise ValueError(f"missing field '{key}'")
    return v


def _int(raw: dict, key: str, default=None) -> int:
    """``raw[key]`` as an int (``default`` when absent or null; required when ``default`` is None).

    Raises:
        ValueError: the field is missing (no default) or not an integer.
    """
    v = raw.get(key, default) if default is not None else _req(raw, key)
    if v is None:
        v = default
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"field '{key}' must be an integer (got {v!r})") from None


def _refuse(raw: dict, key: str, ok) -> None:
    """ValueError naming ``key`` when its value is not one of ``ok`` (a tuple; absent keys pass)."""
    if key in raw and raw[key] not in ok:
        raise ValueError(f"field '{key}' = {raw[key]!r} is not supported (supported: {', '.join(map(repr, ok))})")


def _rope(raw: dict, theta_default: float | None = None) -> dict:
    """Our rope dict from transformers 5 ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    rp = dict(raw.get("rope_parameters") or {})
    if not rp:
        theta = raw.get("rope_theta", theta_default)
        if theta is None:
            raise ValueError("missing field 'rope_theta'")
        rp = {"rope_type": "default", "rope_theta": float(theta)}
        scaling = raw.get("rope_scaling") or {}
        rp.update({k: v for k, v in scaling.items() if k != "type"})
        if "type" in scaling and "rope_type" not in scaling:
            rp["rope_type"] = scaling["type"]
    prf = raw.get("partial_rotary_factor")
    if prf is not None and float(prf) > 0 and "partial_rotary_factor" not in rp:
        rp["partial_rotary_factor"] = float(prf)
    if rp.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise ValueError(f"field 'rope_scaling' type {rp['rope_type']!r} is not supported (default, linear, llama3)")
    return rp


def id_tuple(v) -> tuple:
    """A config's token id or list of ids (``eos_token_id``: Llama 3 lists several) as a tuple of ints; () for None."""
    if v is None:
        return ()
    return tuple(int(e) for e in v) if isinstance(v, (list, tuple)) else (int(v),)


# -- checks -------------------------------------------------------------------------------------------------------
def check_heads(hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int) -> None:
    """ValueError unless the query heads are a positive multiple of the key/value heads (GQA) and the hidden size,
    head dim and layer count are positive."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a positive multiple of the key/value heads ({kv_heads})"
        )
    if hidden <= 0 or head_dim <= 0 or layers <= 0:
        raise ValueError("hidden size, head dim and layer count must be positive")


def check_mask_id(mask: int, pad, vocab: int) -> None:
    """ValueError when the mask id equals the pad id (padding would read as masks) or lies outside the vocabulary."""
    if pad is not None and int(pad) == mask:
        raise ValueError(f"field 'mask_token_id' ({mask}) equals 'pad_token_id': padding would read as masks")
    if not 0 <= mask < vocab:
        raise ValueError(f"field 'mask_token_id' ({mask}) is outside the vocabulary (vocab_size {vocab})")


def check_top_k(k: int, experts: int) -> None:
    """ValueError unless 1 ≤ ``num_experts_per_tok`` ≤ ``num_experts``."""
    if not 0 < k <= experts:
        raise ValueError(f"field 'num_experts_per_tok' ({k}) must be in 1..num_experts ({experts})")


# -- the spec contract's shared answers ---------------------------------------------------------------------------
def full_attention_geometry(c) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer (keys and values separate, no windows) of a parsed config
    with ``head_dim``, ``num_key_value_heads`` and ``num_hidden_layers``."""
    return [LayerGeom("full_attention", c.head_dim, c.num_key_value_heads, True, None)] * c.num_hidden_layers


def moe_parameter_counts(c, tensors: list[Tensorish]) -> dict:
    """:func:`localdiff.arch.base.parameter_counts` of ``tensors`` with ``active_per_token`` less the routed experts
    a token does not use: per MoE layer (``c.is_moe_layer``), ``num_experts − num_experts_per_tok`` SwiGLU experts
    of 3 · hidden · ``moe_intermediate_size`` weights (0 for a dense config)."""
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    inactive = moe_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
    return _counts(tensors, inactive)


@dataclass(frozen=True)
class StackShape:
    """The shape of a Llama-shaped decoder stack, the leading fields of every such config here (what
    :class:`localdiff.arch.dense.DenseStack` sizes its layers by): ``vocab_size`` (logits width),
    ``hidden_size``, ``intermediate_size`` (dense MLP; 0 when every layer is MoE), ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads`` (GQA), ``head_dim``, ``rope_parameters`` (:func:`_rope`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: dict


class DenseOnly:
    """Mixin of a dense config dataclass with ``vocab_size``: ``embedding_rows`` = ``vocab_size`` and no MoE layer
    (the two attributes :class:`localdiff.arch.dense.DenseStack` asks of every config)."""

    vocab_size: int

    @property
    def embedding_rows(self) -> int:
        return self.vocab_size

    def is_moe_layer(self, i: int) -> bool:
        """Never: the stack is dense."""
        return False
