"""LLaDA2.x MoE configs (torch-free): ``model_type: "llada2_moe"`` (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini and the
-flash sizes; ``architectures: ["LLaDA2MoeModelLM"]``), parsed into :class:`LLaDA2Config`.

Sources (read, not copied): the Hub repos' ``configuration_llada2_moe.py`` (defaults: ``use_qk_norm`` True,
``use_bias`` True, ``num_key_value_heads`` 0 = all heads, ``head_dim`` None = hidden / heads, ``n_group`` 8,
``topk_group`` 4, ``routed_scaling_factor`` 2.5, ``first_k_dense_replace`` 0, ``partial_rotary_factor`` 0.5,
``rms_norm_eps`` 1e-5) and ``modeling_llada2_moe.py`` (``LLaDA2MoeGate``: sigmoid scores, ``expert_bias`` buffer
added for the choice only, group-limited top-k; ``LLaDA2MoeSparseMoeBlock``: ``shared_experts`` of
``moe_intermediate_size · num_shared_experts``; ``LLaDA2MoeAttention``: fused ``query_key_value``, per-head
``query_layernorm`` / ``key_layernorm`` before RoPE, ``dense`` output with a bias when ``use_bias``; the first
``first_k_dense_replace`` layers use a dense MLP of ``intermediate_size``). Mask 156895 and EOS 156892 are the
defaults of the Hub ``generate``; blocks of 32 tokens aligned to absolute positions (``block_length``).

Tensor names are ours (the model's ``named_parameters``): ``embed_tokens.weight``,
``layers.N.self_attn.{query_key_value,dense}.{weight,bias}``, ``layers.N.self_attn.{query,key}_layernorm.weight``,
``layers.N.mlp.{gate,up,down}_proj.weight`` (dense layers) or ``layers.N.mlp.gate.weight`` + the
``layers.N.mlp.expert_bias`` buffer + ``layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` +
``layers.N.shared_expert.*`` (MoE layers), ``layers.N.{input,post_attention}_layernorm.weight``, ``norm.weight``,
``lm_head.weight``; :func:`localdiff.arch.llada2_moe.checkpoint_names` maps them to the Hub names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.llama_base_spec import config_tensor_shapes
from localdiff.arch.spec_parts import (
    StackShape,
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

MODEL_TYPE = "llada2_moe"
FAMILY = "block"
ARCHITECTURE = "LLaDA2MoeModelLM"
MASK_ID, EOS_ID = 156895, 156892


@dataclass(frozen=True)
class LLaDA2Config(StackShape):
    """Hyper-parameters of a LLaDA2.x checkpoint, in the attribute names :mod:`localdiff.arch.dense` reads.

    Router (``moe_router``): ``"sigmoid_group"`` — see :class:`localdiff.arch.moe.SparseMoE`; ``n_group`` /
    ``topk_group`` (group-limited routing), ``routed_scaling_factor``. ``block_size``: tokens per block (blocks
    start at absolute positions 0, L, 2L, …; the prompt's tail shares its block with the first masks).
    ``o_bias``: the attention output projection has a bias (``use_bias``).
    """

    mask_token_id: int
    eos_token_id: tuple
    pad_token_id: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    moe_layers: tuple
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = True
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 16384
    block_size: int = 32
    model_type: str = MODEL_TYPE
    moe_router: str = "sigmoid_group"
    expert_bias: bool = True  # the Hub gate always registers the buffer
    norm_topk_prob: bool = True  # sigmoid weights are renormalised over the top-k (when top_k > 1)
    rope_fp32: bool = False
    clip_qkv: float | None = None
    bos_token_id: int | None = None
    shift_logits: bool = False
    token_shift: bool = False  # logits[:, i] predicts token i (not i + 1)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def embedding_rows(self) -> int:
        return self.vocab_size

    @property
    def canvas_length(self) -> int:
        """Tokens denoised per forward: one block."""
        return self.block_size

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the sparse MoE (layers ≥ ``first_k_dense_replace``)."""
        return bool(self.moe_layers[i])


def parse_config(raw: dict) -> LLaDA2Config:
    """The :class:`LLaDA2Config` of a config.json dict.

    Raises:
        ValueError: a missing field, an unsupported option (``score_function`` other than sigmoid, ``norm_head``,
            sliding windows, an activation other than silu), inconsistent MoE sizes, or special ids outside the
            vocabulary (all named).
    """
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
    _refuse(raw, "score_function", ("sigmoid", None))
    _refuse(raw, "norm_head", (False, None))
    _refuse(raw, "hidden_act", ("silu",))
    _refuse(raw, "use_sliding_window", (False, None))
    _refuse(raw, "use_linear_attention", (False, None))
    h, heads, n = _int(raw, "hidden_size"), _int(raw, "num_attention_heads"), _int(raw, "num_hidden_layers")
    kv = int(raw.get("num_key_value_heads") or 0) or heads
    head_dim = int(raw.get("head_dim") or 0) or h // max(heads, 1)
    vocab = _int(raw, "vocab_size")
    e, k = _int(raw, "num_experts"), _int(raw, "num_experts_per_tok")
    groups, topk_groups = _int(raw, "n_group", 8), _int(raw, "topk_group", 4)
    check_top_k(k, e)
    if groups <= 0 or e % groups or not 0 < topk_groups <= groups:
        raise ValueError(
            f"fields 'n_group' ({groups}) / 'topk_group' ({topk_groups}) must divide the {e} experts "
            "into groups and pick 1..n_group of them"
        )
    if e // groups < 2:
        raise ValueError(
            f"field 'n_group' ({groups}) leaves fewer than 2 experts per group (the group score sums "
            "each group's top 2)"
        )
    if k > topk_groups * (e // groups):
        raise ValueError(f"num_experts_per_tok ({k}) exceeds the experts of the chosen groups")
    first_dense = _int(raw, "first_k_dense_replace", 0)
    moe_inter = _int(raw, "moe_intermediate_size")
    shared = int(raw.get("num_shared_experts") or 0)
    inter = int(raw.get("intermediate_size") or 0)
    if first_dense > 0 and inter <= 0:
        raise ValueError("missing field 'intermediate_size' (first_k_dense_replace > 0 needs the dense MLP size)")
    check_heads(h, heads, kv, head_dim, n)
    mask = int(raw.get("mask_token_id", MASK_ID))
    eos = id_tuple(raw.get("eos_token_id", EOS_ID if EOS_ID < vocab else None))
    pad = raw.get("pad_token_id")
    check_mask_id(mask, pad, vocab)
    rope = _rope(raw, 10000.0)
    rope.setdefault("partial_rotary_factor", 0.5)
    return LLaDA2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_parameters=rope,
        mask_token_id=mask,
        eos_token_id=eos,
        pad_token_id=None if pad is None else int(pad),
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter * shared,
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        moe_layers=tuple(i >= first_dense for i in range(n)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        qkv_bias=bool(raw.get("use_qkv_bias", False)),
        o_bias=bool(raw.get("use_bias", True)),
        qk_norm=bool(raw.get("use_qk_norm", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 16384),
        block_size=_int(raw, "block_size", 32),
        bos_token_id=raw.get("bos_token_id"),
        raw=raw,
    )


# -- the spec contract (localdiff.arch.base.ArchSpec) -------------------------------------------------------------
def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer."""
    return full_attention_geometry(parse_config(raw))


def _fused_attention(c: LLaDA2Config, i: int, p: str) -> list[Tensorish]:
    """Layer i's fused ``query_key_value`` and ``dense`` (+ biases when ``qkv_bias`` / ``o_bias``) and the per-head
    ``query_layernorm`` / ``key_layernorm`` when ``qk_norm``."""
    h, d = c.hidden_size, c.head_dim
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    out = [Tensorish("attention", i, f"{p}self_attn.query_key_value.weight", (qkv, h))]
    if c.qkv_bias:
        out.append(Tensorish("attention", i, f"{p}self_attn.query_key_value.bias", (qkv,)))
    out.append(Tensorish("attention", i, f"{p}self_attn.dense.weight", (h, c.num_attention_heads * d)))
    if c.o_bias:
        out.append(Tensorish("attention", i, f"{p}self_attn.dense.bias", (h,)))
    if c.qk_norm:
        out += [
            Tensorish("attention_norms", i, f"{p}self_attn.{n}.weight", (d,))
            for n in ("query_layernorm", "key_layernorm")
        ]
    return out


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every weight tensor the config implies, with our names (module docstring). Components: ``embeddings``,
    ``lm_head``, ``attention``, ``attention_norms``, ``dense_mlp``, ``router`` (gate + ``expert_bias`` buffer),
    ``experts``, ``shared_expert``, ``norms``."""
    return config_tensor_shapes(parse_config(raw), include_buffers, attention=_fused_attention)


def parameter_counts(raw: dict) -> dict:
    """``total``, ``active_per_token`` (total minus the routed experts a token does not use) and ``by_component``."""
    return moe_parameter_counts(parse_config(raw), tensor_shapes(raw, include_buffers=False))


def summary_fields(raw: dict) -> dict:
    """Family-specific fields of ``localdiff show``: special ids, block length, the router and experts."""
    c = parse_config(raw)
    return {
        "mask_token_id": c.mask_token_id,
        "eos_token_id": list(c.eos_token_id),
        "pad_token_id": c.pad_token_id,
        "block_size": c.block_size,
        "partial_rotary_factor": c.rope_parameters.get("partial_rotary_factor"),
        "experts": {
            "total": c.num_experts,
            "top_k": c.num_experts_per_tok,
            "shared": c.shared_expert_intermediate_size // max(c.moe_intermediate_size, 1),
            "moe_intermediate_size": c.moe_intermediate_size,
            "router": f"sigmoid + expert bias, {c.topk_group} of {c.n_group} groups, scale {c.routed_scaling_factor}",
            "moe_layers": sum(c.moe_layers),
        },
    }
