"""Block-diffusion configs (torch-free): SDAR (dense and MoE), Fast-dLLM v2 and dllm's Tiny-A2D BD3LM Qwen3, parsed
into one :class:`BlockConfig` on the dense / MoE layout of :mod:`localdiff.arch.llama_base_spec` (same tensor names,
same shared blocks in :mod:`localdiff.arch.dense` / :mod:`localdiff.arch.moe`).

Block diffusion (BD3-LM, arXiv 2503.09573; SDAR, arXiv 2510.06303; Fast-dLLM v2, arXiv 2509.26328): the sequence
is cut into blocks of ``block_size`` tokens at ABSOLUTE positions (block k = positions k·B .. k·B + B − 1);
attention is causal across blocks and bidirectional inside a block, so the K/V of a finished block never change.

Sources (read, not copied):

* SDAR (JetAstra/SDAR ``training/model/SDAR-*-Chat/config.json`` + ``modeling_sdar.py``): model_type ``sdar``,
  ``SDARForCausalLM``, Qwen3 math (q/k RMSNorm per head, no qkv bias, ``head_dim`` from the config — it may differ
  from hidden / heads), ``block_size`` 4, ``mask_token_id`` 151669 (``<MASK>``), eos 151643 in config.json and
  [151645, 151643] in generation_config.json, pad 151643.
* SDAR-30B-A3B (``SDARMoeForCausalLM``, model_type ``sdar_moe`` — the name lmdeploy's SDAR builder and the JetEngine
  loader test): Qwen3-MoE keys (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``decoder_sparse_step``, ``mlp_only_layers``, ``norm_topk_prob``), softmax router, no shared expert.
* Fast-dLLM v2 (``Efficient-Large-Model/Fast_dLLM_v2_*`` ``modeling.py`` / ``configuration.py``): model_type
  ``Fast_dLLM_Qwen``, ``Fast_dLLM_QwenForCausalLM``, Qwen2 math (q/k/v bias, no q/k norm), block ``bd_size`` 32,
  mask 151665, stop token 151645. Its logits are shifted (the "token shift": ``logits[:, i]`` predicts token
  ``i + 1``): ``token_shift``.
* Tiny-A2D BD3LM (dllm ``a2d/models/qwen3`` + ``core/samplers/bd3lm.py``): model_type ``a2d-qwen3`` (the masked
  A2D model's type) — a config with a ``block_size`` field is the BD3LM one (registry key ``a2d-qwen3-bd3lm``; the
  real checkpoint's config.json could not be read from here, so that field is an assumption to check on a pull).
  One known difference: dllm's sampler prefills the prompt's tail with the prefix (the tail does not see the first
  block's masks); we denoise the tail together with the first block, as SDAR and Fast-dLLM v2 do — the first
  block's logits differ from dllm's, later blocks do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from localdiff.arch import canonical_type as _registry_type
from localdiff.arch.base import LayerGeom, Tensorish
from localdiff.arch.llama_base_spec import LlamaConfig, config_tensor_shapes
from localdiff.arch.spec_parts import (
    _int,
    _rope,
    check_heads,
    check_mask_id,
    check_top_k,
    full_attention_geometry,
    id_tuple,
    moe_parameter_counts,
)

MODEL_TYPE = "sdar"
#: every config.json model_type (registry key) this spec parses
MODEL_TYPES = ("sdar", "sdar_moe", "Fast_dLLM_Qwen", "a2d-qwen3-bd3lm")
FAMILY = "block"
ARCHITECTURE = "SDARForCausalLM"
_ARCHITECTURES = {
    "sdar": "SDARForCausalLM",
    "sdar_moe": "SDARMoeForCausalLM",
    "Fast_dLLM_Qwen": "Fast_dLLM_QwenForCausalLM",
    "a2d-qwen3-bd3lm": "A2DQwen3LMHeadModel",
}
#: (mask, eos, pad, bos, block size) when config.json omits them — the values upstream code hard-codes
DEFAULT_IDS = {
    "sdar": (151669, 151643, 151643, 151643, 4),
    "sdar_moe": (151669, 151643, 151643, 151643, 4),
    "Fast_dLLM_Qwen": (151665, 151645, 151643, 151643, 32),
    "a2d-qwen3-bd3lm": (151669, 151645, 151643, 151643, 32),
}
_BLOCK_KEY = {"Fast_dLLM_Qwen": "bd_size"}


@dataclass(frozen=True)
class BlockConfig(LlamaConfig):
    """A block-diffusion checkpoint's hyper-parameters: the dense / MoE fields of
    :class:`localdiff.arch.llama_base_spec.LlamaConfig` plus ``block_size`` (tokens per block, B) and ``token_shift``
    (``logits[:, i]`` predicts token ``i + 1``, Fast-dLLM v2)."""

    block_size: int = 4
    token_shift: bool = False

    @property
    def canvas_length(self) -> int:
        """The generic loop's canvas length C: one block (``localdiff.decoding.loop``)."""
        return self.block_size


def _moe(raw: dict, n: int) -> dict:
    """Qwen3-MoE keys: layer i is sparse unless in ``mlp_only_layers`` or not a multiple of ``decoder_sparse_step``."""
    e, k = _int(raw, "num_experts"), _int(raw, "num_experts_per_tok")
    check_top_k(k, e)
    step = _int(raw, "decoder_sparse_step", 1)
    only = set(raw.get("mlp_only_layers") or [])
    layers = tuple(i not in only and step > 0 and (i + 1) % step == 0 for i in range(n))
    return dict(
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=layers,
    )


def parse_config(raw: dict) -> BlockConfig:
    """The :class:`BlockConfig` of a config.json dict.

    Raises:
        ValueError: a missing field the family needs or an unsupported option (both named in one line), the mask
            id missing (no default inside the vocabulary) or equal to the pad id, a block size < 1.
    """
    mt = _registry_type(raw)
    if mt not in DEFAULT_IDS:
        raise ValueError(
            f"model_type {raw.get('model_type')!r} is not a block-diffusion type ({', '.join(MODEL_TYPES)})"
        )
    if raw.get("use_sliding_window"):
        raise ValueError("field 'use_sliding_window' = true is not supported (block models attend to all blocks)")
    h, heads, n = _int(raw, "hidden_size"), _int(raw, "num_attention_heads"), _int(raw, "num_hidden_layers")
    vocab = _int(raw, "vocab_size")
    qwen2 = mt == "Fast_dLLM_Qwen"
    fields = dict(
        vocab_size=vocab,
        embedding_rows=vocab,
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=_int(raw, "head_dim") if raw.get("head_dim") else h // max(heads, 1),
        rope_parameters=_rope(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen2 else bool(raw.get("attention_bias")),
        qk_norm=not qwen2,
        intermediate_size=_int(raw, "intermediate_size"),
    )
    if mt == "sdar_moe":
        fields.update(_moe(raw, n))
    mask_d, eos_d, pad_d, bos_d, block_d = DEFAULT_IDS[mt]
    mask = raw.get("mask_token_id", mask_d if mask_d < vocab else None)
    if mask is None:
        raise ValueError("missing field 'mask_token_id'")
    mask = int(mask)
    eos = id_tuple(raw.get("eos_token_id", eos_d if eos_d < vocab else None))
    pad = raw.get("pad_token_id", pad_d if pad_d < vocab else None)
    bos = raw.get("bos_token_id", bos_d if bos_d < vocab else None)
    block = _int(raw, _BLOCK_KEY.get(mt, "block_size"), block_d)
    if block < 1:
        raise ValueError(f"field '{_BLOCK_KEY.get(mt, 'block_size')}' must be ≥ 1 (got {block})")
    check_mask_id(mask, pad, vocab)
    check_heads(h, heads, fields["num_key_value_heads"], fields["head_dim"], n)
    return BlockConfig(
        model_type=mt,
        mask_token_id=mask,
        eos_token_id=eos,
        pad_token_id=None if pad is None else int(pad),
        bos_token_id=None if bos is None else int(bos),
        raw=raw,
        block_size=block,
        token_shift=qwen2,
        **fields,
    )


# -- the spec contract (localdiff.arch.base.ArchSpec) -------------------------------------------------------------
def layer_geometry(raw: dict) -> list[LayerGeom]:
    """One full-attention :class:`LayerGeom` per layer (keys and values separate, no windows)."""
    return full_attention_geometry(parse_config(raw))


def tensor_shapes(raw: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every weight tensor, our names (the dense / MoE layout of ``llama_base_spec.config_tensor_shapes``)."""
    return config_tensor_shapes(parse_config(raw), include_buffers)


def parameter_counts(raw: dict) -> dict:
    """``total``, ``active_per_token`` (minus the routed experts a token does not use) and ``by_component``."""
    return moe_parameter_counts(parse_config(raw), tensor_shapes(raw, include_buffers=False))


def summary_fields(raw: dict) -> dict:
    """Family-specific fields of ``localdiff show``: block size, special ids, token shift, experts when MoE."""
    c = parse_config(raw)
    out = {
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": list(c.eos_token_id),
        "pad_token_id": c.pad_token_id,
        "token_shift": c.token_shift,
    }
    if c.num_experts:
        out["experts"] = {
            "total": c.num_experts,
            "top_k": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "moe_layers": sum(c.moe_layers),
        }
    return out


def architecture_name(raw: dict) -> str:
    """The upstream class name of a config (for ``show`` when config.json lacks ``architectures``)."""
    return _ARCHITECTURES.get(_registry_type(raw), ARCHITECTURE)
