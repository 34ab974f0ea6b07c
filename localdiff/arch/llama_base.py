"""The Llama / Qwen checkpoint layout (torch-free): the model contract's loader names shared by every model built on
:mod:`localdiff.arch.dense` whose checkpoint uses transformers' Llama / Qwen names — masked (LLaDA-MoE, Dream,
DiffuCoder, A2D Qwen3: :mod:`localdiff.arch.masked`), block (SDAR, Fast-dLLM v2: :mod:`localdiff.arch.block`),
slots (ReFusion) and causal (Qwen3 / Llama) models: ``checkpoint_names``, ``keeps_checkpoint_dtype`` and
``CHECKPOINT_RULES`` (docs/ARCHITECTURE.md, the model contract). The family files import these, not each other.
"""

from __future__ import annotations

from localdiff.arch.base import CheckpointRules


def checkpoint_names(local: str) -> list[str]:
    """Checkpoint tensor names for our ``local`` name: ``model.<local>``, the LM head as ``lm_head.weight``."""
    if local.startswith("lm_head."):
        return [local]
    return ["model." + local]


def keeps_checkpoint_dtype(local: str) -> bool:
    """No tensor of these models keeps the checkpoint dtype when ``dtype=`` asks for another."""
    return False


#: what a Llama / Qwen layout checkpoint may hold unread (:class:`localdiff.arch.base.CheckpointRules`): rotary
#: caches; ``lm_head.weight`` when it equals the tied embeddings; the fields that would read more tensors
CHECKPOINT_RULES = CheckpointRules(
    tied=((r"lm_head\.weight", "model.embed_tokens.weight"),),
    switches=(
        ("qk_layernorm", True),
        ("tie_word_embeddings", False),
        ("attention_bias", True),
        ("moe_router_enable_expert_bias", True),
    ),
)
