"""LLaDA-8B (GSAI-ML/LLaDA-8B-Base / -Instruct, iLLaDA): the masked-diffusion model of :mod:`localdiff.arch.masked`
read from LLaDA's own OLMo-style checkpoint names (``modeling_llada.py``, ``LLaDALlamaBlock``), no conversion step:

====================================  ==============================================
ours                                  checkpoint
====================================  ==============================================
``embed_tokens.weight``               ``model.transformer.wte.weight``
``layers.N.self_attn.{q,k,v}_proj``   ``model.transformer.blocks.N.{q,k,v}_proj``
``layers.N.self_attn.o_proj``         ``model.transformer.blocks.N.attn_out``
``layers.N.mlp.gate_proj``            ``model.transformer.blocks.N.ff_proj``
``layers.N.mlp.up_proj``              ``model.transformer.blocks.N.up_proj``
``layers.N.mlp.down_proj``            ``model.transformer.blocks.N.ff_out``
``layers.N.input_layernorm``          ``model.transformer.blocks.N.attn_norm``
``layers.N.post_attention_layernorm`` ``model.transformer.blocks.N.ff_norm``
``norm.weight``                       ``model.transformer.ln_f.weight``
``lm_head.weight``                    ``model.transformer.ff_out.weight`` (absent when ``weight_tying``)
====================================  ==============================================

Math: Llama with bidirectional attention, no GQA in the released checkpoints (``n_kv_heads`` is honoured), RoPE
applied in fp32 (``rope_full_precision``), RMSNorm with ``rms_norm_eps``; logits not shifted.
"""

from __future__ import annotations

from localdiff.arch.base import CheckpointRules
from localdiff.arch.llama_base import keeps_checkpoint_dtype  # noqa: F401  (contract name)
from localdiff.arch.masked import MaskedLM

_T = "model.transformer."
_LAYER = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}
_TOP = {"embed_tokens.weight": "wte.weight", "norm.weight": "ln_f.weight", "lm_head.weight": "ff_out.weight"}


def checkpoint_names(local: str) -> list[str]:
    """LLaDA's checkpoint name for our ``local`` name (table in the module docstring).

    Raises:
        KeyError: a name with no LLaDA counterpart (a bug: the spec describes no such tensor for LLaDA).
    """
    if local in _TOP:
        return [_T + _TOP[local]]
    _, i, rest = local.split(".", 2)  # layers.N.<module>.<weight|bias>
    module, leaf = rest.rsplit(".", 1)
    return [f"{_T}blocks.{i}.{_LAYER[module]}.{leaf}"]


#: what a LLaDA checkpoint may hold unread (:class:`localdiff.arch.base.CheckpointRules`): rotary caches; the
#: ``ff_out`` head when it equals the tied ``wte``; ``weight_tying`` / ``include_qkv_bias`` would read more tensors
CHECKPOINT_RULES = CheckpointRules(
    tied=((r"model\.transformer\.ff_out\.weight", "model.transformer.wte.weight"),),
    switches=(("weight_tying", False), ("include_qkv_bias", True)),
)


MODEL_CLASS = MaskedLM
