"""The Llama-style dense / MoE stack's config and tensor layout (torch-free), shared by every family built on
:mod:`localdiff.arch.dense` — masked (LLaDA, LLaDA-MoE, Dream, A2D Qwen3: :mod:`localdiff.arch.masked_spec`), block
(SDAR, Fast-dLLM v2, LLaDA2: ``block_spec`` / ``llada2_spec``), slots (ReFusion: ``refusion_spec``), causal (Qwen3 /
Llama targets: ``causal_spec``) and DFlash drafts (``dflash_spec``): :class:`LlamaConfig` (the hyper-parameters
every layout is normalised to, Llama / Qwen names) and :func:`config_tensor_shapes` (every weight of the stack).

Tensor names are ours (the model's ``named_parameters``): ``embed_tokens.weight``,
``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``
(dense) or ``layers.N.mlp.gate`` + ``layers.N.mlp.experts.E.*`` (+ ``layers.N.mlp.expert_bias``,
``layers.N.shared_expert.*``),
``layers.N.{input,post_attention}_layernorm``, ``norm.weight``, ``lm_head.weight`` (absent when tied); the model
modules map them to each checkpoint's names (:mod:`localdiff.arch.llama_base` for the Llama / Qwen layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.arch.base import Tensorish
from localdiff.arch.spec_parts import StackShape


@dataclass(frozen=True)
class LlamaConfig(StackShape):
    """Hyper-parameters of a Llama-style dense / MoE checkpoint (every layout normalised to Llama / Qwen names).

    ``vocab_size``: logits width (token ids); ``embedding_rows``: rows of the embedding / LM head matrices (LLaDA's
    ``embedding_size`` may pad the vocabulary; logits are cut to ``vocab_size``). ``shift_logits``: True when
    ``logits[:, i]`` predicts token ``i + 1`` (Dream / DiffuCoder). ``moe_layers[i]``: layer i uses the MoE.
    """

    model_type: str
    embedding_rows: int
    mask_token_id: int
    eos_token_id: tuple
    pad_token_id: int | None
    bos_token_id: int | None
    rms_norm_eps: float = 1e-6
    rope_fp32: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    clip_qkv: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    expert_bias: bool = False
    moe_layers: tuple = ()
    shift_logits: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the sparse MoE."""
        return bool(self.moe_layers) and bool(self.moe_layers[i])


def config_tensor_shapes(c, include_buffers: bool = True, attention=None) -> list[Tensorish]:
    """Every weight tensor of a parsed config (any config with :class:`LlamaConfig`'s attributes: the block
    family's :class:`localdiff.arch.block_spec.BlockConfig`, LLaDA2's config and the dense Qwen3 / Llama ones share
    the dense / MoE layout). ``attention(c, i, prefix) -> list[Tensorish]``: layer i's attention tensors
    (default :func:`qkv_attention_shapes`; LLaDA2 fuses q/k/v)."""
    attention = attention or qkv_attention_shapes
    h = c.hidden_size
    out = [Tensorish("embeddings", None, "embed_tokens.weight", (c.embedding_rows, h))]
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out += attention(c, i, p)
        if c.is_moe_layer(i):
            out.append(Tensorish("router", i, f"{p}mlp.gate.weight", (c.num_experts, h)))
            if c.expert_bias and include_buffers:
                out.append(Tensorish("router", i, f"{p}mlp.expert_bias", (c.num_experts,), buffer=True))
            out += swiglu_shapes("experts", i, f"{p}mlp.experts.{{e}}.", h, c.moe_intermediate_size, c.num_experts)
            if c.shared_expert_intermediate_size:
                out += swiglu_shapes("shared_expert", i, f"{p}shared_expert.", h, c.shared_expert_intermediate_size, 1)
        else:
            out += swiglu_shapes("dense_mlp", i, f"{p}mlp.", h, c.intermediate_size, 1)
        out += [Tensorish("norms", i, f"{p}{n}.weight", (h,)) for n in ("input_layernorm", "post_attention_layernorm")]
    out.append(Tensorish("norms", None, "norm.weight", (h,)))
    if not c.tie_word_embeddings:
        out.append(Tensorish("lm_head", None, "lm_head.weight", (c.embedding_rows, h)))
    return out


def qkv_attention_shapes(c, i: int, p: str) -> list[Tensorish]:
    """Layer i's separate ``q_proj`` / ``k_proj`` / ``v_proj`` (+ biases when ``qkv_bias``), ``o_proj`` and the
    per-head ``q_norm`` / ``k_norm`` when ``qk_norm``; ``p`` is the layer's name prefix."""
    h, d = c.hidden_size, c.head_dim
    out = []
    for name, o in (
        ("q_proj", c.num_attention_heads * d),
        ("k_proj", c.num_key_value_heads * d),
        ("v_proj", c.num_key_value_heads * d),
    ):
        out.append(Tensorish("attention", i, f"{p}self_attn.{name}.weight", (o, h)))
        if c.qkv_bias:
            out.append(Tensorish("attention", i, f"{p}self_attn.{name}.bias", (o,)))
    out.append(Tensorish("attention", i, f"{p}self_attn.o_proj.weight", (h, c.num_attention_heads * d)))
    if c.qk_norm:
        out += [Tensorish("attention_norms", i, f"{p}self_attn.{n}.weight", (d,)) for n in ("q_norm", "k_norm")]
    return out


def swiglu_shapes(component: str, i: int, prefix: str, h: int, inter: int, copies: int) -> list[Tensorish]:
    """``copies`` gated FFNs (``gate_proj``, ``up_proj``, ``down_proj``) named from ``prefix`` (``{e}``: the copy)."""
    out = []
    for e in range(copies):
        p = prefix.format(e=e)
        out += [
            Tensorish(component, i, f"{p}gate_proj.weight", (inter, h)),
            Tensorish(component, i, f"{p}up_proj.weight", (inter, h)),
            Tensorish(component, i, f"{p}down_proj.weight", (h, inter)),
        ]
    return out
