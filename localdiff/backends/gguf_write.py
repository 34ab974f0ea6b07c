"""Checkpoint folder (safetensors, upstream layout) → GGUF file that llama.cpp computes, written with the ``gguf``
package and no llama.cpp checkout — the writing half of ``localdiff convert`` (quantized types:
:mod:`localdiff.backends.gguf_quant`).

Families and llama.cpp architectures (``general.architecture``), as llama.cpp's ``convert_hf_to_gguf.py``
(``conversion/llada.py``, ``conversion/dream.py``, ``conversion/qwen.py``) names tensors and keys:

====================  ==============  =====================================================================
checkpoint            architecture    what differs
====================  ==============  =====================================================================
LLaDA                 ``llada``       OLMo names (``model.transformer.*``); q/k rows permuted per head from the
                                      half-split RoPE layout to llama.cpp's interleaved ("NORM") RoPE
                                      (``LLaDAModel.permute``); ``diffusion.shift_logits`` = false
LLaDA-MoE             ``llada-moe``   experts stacked into ``ffn_{gate,up,down}_exps``; shift false; llama.cpp's
                                      graph: MoE in every layer, no shared expert, no router bias
Dream                 ``dream``       Qwen2 names with q/k/v biases; no shift key (llama.cpp's default: shifted)
SDAR                  ``qwen3``       Qwen3 (q/k norms, ``attention.key_length`` = head_dim)
SDAR-MoE              ``qwen3moe``    Qwen3-MoE; llama.cpp normalises the top-k weights and has MoE in every layer
Fast-dLLM v2          ``qwen2``       Qwen2 (q/k/v biases); a tied LM head is left out (llama.cpp reuses the
                                      embedding)
====================  ==============  =====================================================================

Every NeoX-RoPE architecture keeps the checkpoint's q/k rows. Masked archs are written ``causal_attention`` =
false (llama.cpp's diffusion graphs); the block family's Qwen archs stay causal by default — the GGUF engine turns
causality off per batch. localdiff's own keys (:data:`LOCALDIFF_KEYS`): ``localdiff.model_type``,
``localdiff.family`` ("masked" / "block"), ``localdiff.mask_token_id`` (uint32) and, for block models,
``localdiff.block_length`` (uint32). The mask id is also ``tokenizer.ggml.mask_token_id`` (llama.cpp's key).

Tensor types: 1-D tensors (norms, biases) and the MoE router stay F32 (as llama.cpp's converter keeps them); the
rest is written in the chosen type (F32 / F16 / BF16, round-to-nearest-even by torch). Tensors are read one at a
time (memory-mapped safetensors) and streamed into the file, so memory stays at about one tensor. Tensor names, the
RoPE permutation and the tensors each graph needs: :mod:`localdiff.backends.gguf_tensors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from localdiff.backends.gguf_tensors import (
    IGNORED,
    Tensor,
    expected_tensors,
    gguf_name,
    layer_index,
    order_key,
    shard_reader,
    tensor_loader,
    tensor_order,
)
from localdiff.backends.gguf_vocab import end_tokens, read_vocab, write_vocab
from localdiff.errors import CheckpointError, UsageError
from localdiff.paths import read_json

#: registry key (``localdiff.arch``) → (llama.cpp architecture, ``localdiff.model_type``, ``localdiff.family``)
ARCHS = {
    "llada": ("llada", "llada", "masked"),
    "lladamoe": ("llada-moe", "llada_moe", "masked"),
    "Dream": ("dream", "dream", "masked"),
    "sdar": ("qwen3", "sdar", "block"),
    "sdar_moe": ("qwen3moe", "sdar_moe", "block"),
    "Fast_dLLM_Qwen": ("qwen2", "fast_dllm_v2", "block"),
}
#: registry keys of diffusion models llama.cpp has no architecture for (their PRs are open, or none exists)
NO_LLAMA_CPP = {"diffusion_gemma": "DiffusionGemma", "llada2_moe": "LLaDA2.x", "refusion": "ReFusion"}
LOCALDIFF_KEYS = ("localdiff.model_type", "localdiff.family", "localdiff.mask_token_id", "localdiff.block_length")
#: the types written directly; llama_ftype of each (``general.file_type``)
DIRECT = {"F32": 0, "F16": 1, "BF16": 32}


@dataclass
class Plan:
    """What :func:`plan` found: ``arch`` (llama.cpp), ``model_type`` / ``family`` (localdiff keys), ``config``
    (parsed), ``tensors``, ``source_dtype`` ("F32" / "F16" / "BF16": the lossless type of the checkpoint's
    matrices), ``notes`` (one-line remarks for the user), ``vocab``
    (:func:`localdiff.backends.gguf_vocab.read_vocab`)."""

    ckpt: Path
    arch: str
    model_type: str
    family: str
    config: object
    tensors: list = field(default_factory=list)
    source_dtype: str = "F32"
    notes: list = field(default_factory=list)
    vocab: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Tensor bytes of the file (its header is a few MB at most on top)."""
        return sum(t.nbytes for t in self.tensors)


def _registry_key(raw: dict, path: Path) -> str:
    from localdiff.arch import REGISTRY, entry_for

    try:
        entry = entry_for(raw)
    except KeyError as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    return next(k for k, v in REGISTRY.items() if v is entry)


def _check_supported(key: str, cfg, path: Path) -> None:
    """Refuse (one line) what llama.cpp's graph for the target architecture cannot compute."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{path}: RoPE scaling {rope.get('rope_type')!r} is not written by convert yet")
    if key == "lladamoe" and (cfg.shared_expert_intermediate_size or cfg.expert_bias or not all(cfg.moe_layers)):
        raise CheckpointError(
            f"{path}: llama.cpp's llada-moe graph has MoE in every layer, no shared expert and no "
            "router bias; this checkpoint has one of them"
        )
    if key == "sdar_moe" and (not all(cfg.moe_layers) or not cfg.norm_topk_prob):
        raise CheckpointError(
            f"{path}: llama.cpp's qwen3moe graph has MoE in every layer and normalised top-k "
            "weights (mlp_only_layers / decoder_sparse_step / norm_topk_prob differ here)"
        )
    if key in ("sdar", "sdar_moe") and cfg.qkv_bias:
        raise CheckpointError(f"{path}: q/k/v biases: llama.cpp's qwen3 graph has none")
    if getattr(cfg, "clip_qkv", None):
        raise CheckpointError(f"{path}: clip_qkv is not computed by llama.cpp")


def plan(ckpt: Path, dtype: str = "F32") -> Plan:
    """Inspect checkpoint folder ``ckpt`` and list the GGUF tensors to write in ``dtype`` (F32 / F16 / BF16).

    Raises:
        CheckpointError: an unknown / unsupported model type — DiffusionGemma, LLaDA2.x and ReFusion with "llama.cpp
            has no such architecture" —, options llama.cpp cannot compute, a tensor with no llama.cpp counterpart,
            missing tensors or tokenizer (one line each).
        UsageError: ``dtype`` not F32 / F16 / BF16.
    """
    from localdiff.arch import get_spec
    from localdiff.loader import weight_map

    if dtype not in DIRECT:
        raise UsageError(f"type {dtype!r}: written directly are {', '.join(DIRECT)}")
    ckpt = Path(ckpt)
    raw = read_json(ckpt / "config.json")
    key = _registry_key(raw, ckpt / "config.json")
    if key in NO_LLAMA_CPP:
        raise CheckpointError(f"{ckpt}: {NO_LLAMA_CPP[key]} cannot be converted: llama.cpp has no such architecture")
    if key not in ARCHS:
        raise CheckpointError(
            f"{ckpt}: model_type {raw.get('model_type')!r} is not a family convert writes "
            "(LLaDA, LLaDA-MoE, Dream, SDAR, SDAR-MoE, Fast-dLLM v2)"
        )
    try:
        cfg = get_spec(raw).parse_config(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'config.json'}: invalid config ({e})") from None
    _check_supported(key, cfg, ckpt)
    arch, mt, family = ARCHS[key]
    p = Plan(ckpt, arch, mt, family, cfg)
    files = weight_map(ckpt)
    get, shape, sdtype = shard_reader(files)
    llada = key == "llada"
    single, experts = {}, {}
    for name in files:
        if IGNORED.search(name):
            continue
        out, e = gguf_name(name, llada)
        if out is None:
            raise CheckpointError(f"{ckpt}: tensor {name!r} has no counterpart in llama.cpp's {arch} graph")
        if e is None:
            single[out] = name
        else:
            experts.setdefault(out, {})[e] = name
    if "output.weight" not in single and arch in ("llada", "llada-moe", "dream"):
        single["output.weight"] = single.get("token_embd.weight")  # a tied head: these graphs need the tensor
    names = set(single) | set(experts)
    missing = sorted(expected_tensors(arch, cfg) - names, key=order_key)
    if missing or single.get("token_embd.weight") is None:
        raise CheckpointError(
            f"{ckpt}: no tensor for llama.cpp's {(missing or ['token_embd.weight'])[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = sorted(n for n in names if layer_index(n) >= cfg.num_hidden_layers)
    if extra:
        raise CheckpointError(f"{ckpt}: tensor {extra[0]} is beyond num_hidden_layers ({cfg.num_hidden_layers})")
    seen = set()
    for out, name in single.items():
        x_shape = shape(name)
        if len(x_shape) > 1:
            seen.add(sdtype(name))
        heads = None
        if llada and re.search(r"\.attn_[qk]\.weight$", out):
            heads = cfg.num_attention_heads if ".attn_q." in out else cfg.num_key_value_heads
        kind = "F32" if len(x_shape) <= 1 or out.endswith("ffn_gate_inp.weight") else dtype
        p.tensors.append(Tensor(out, x_shape, kind, tensor_loader(get, name, heads)))
    for out, members in sorted(experts.items()):
        if sorted(members) != list(range(cfg.num_experts)):
            raise CheckpointError(f"{ckpt}: {out}: experts {sorted(members)[:4]}... of {cfg.num_experts}")
        names = [members[e] for e in range(cfg.num_experts)]
        seen.add(sdtype(names[0]))
        p.tensors.append(
            Tensor(
                out,
                (len(names), *shape(names[0])),
                dtype,
                (lambda ns: lambda: torch.stack([get(n) for n in ns]))(names),
            )
        )
    seen.discard("")
    p.source_dtype = "BF16" if seen == {"BF16"} else ("F16" if seen == {"F16"} else "F32")
    p.tensors.sort(key=tensor_order)
    p.vocab = read_vocab(ckpt, int(p.tensors[[t.name for t in p.tensors].index("token_embd.weight")].shape[0]))
    p.notes += p.vocab["notes"]
    return p


def write_metadata(w, p: Plan, ftype: int) -> None:
    """Hyper-parameters, localdiff keys and tokenizer of plan ``p`` into ``gguf.GGUFWriter`` ``w``."""
    c = p.config
    w.add_name(p.ckpt.name)
    w.add_context_length(int(c.max_position_embeddings))
    w.add_embedding_length(int(c.hidden_size))
    w.add_block_count(int(c.num_hidden_layers))
    w.add_head_count(int(c.num_attention_heads))
    w.add_head_count_kv(int(c.num_key_value_heads))
    w.add_key_length(int(c.head_dim))
    w.add_value_length(int(c.head_dim))
    w.add_rope_dimension_count(int(c.head_dim))
    w.add_rope_freq_base(float(c.rope_parameters.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_file_type(int(ftype))
    if c.intermediate_size:
        w.add_feed_forward_length(int(c.intermediate_size))
    if c.num_experts:
        w.add_expert_count(int(c.num_experts))
        w.add_expert_used_count(int(c.num_experts_per_tok))
        w.add_expert_feed_forward_length(int(c.moe_intermediate_size))
    if p.family == "masked":
        w.add_causal_attention(False)
        if p.arch != "dream":
            w.add_diffusion_shift_logits(False)
    w.add_string("localdiff.model_type", p.model_type)
    w.add_string("localdiff.family", p.family)
    w.add_uint32("localdiff.mask_token_id", int(c.mask_token_id))
    if p.family == "block":
        w.add_uint32("localdiff.block_length", int(c.block_size))
    eos = list(c.eos_token_id) + end_tokens(p.ckpt, tuple(c.eos_token_id))
    write_vocab(
        w,
        p.vocab,
        dict(
            bos=c.bos_token_id,
            eos=eos[0] if eos else None,
            pad=c.pad_token_id,
            mask=c.mask_token_id,
            eot=eos[1] if len(eos) > 1 else None,
        ),
    )


def _as_stored(x: torch.Tensor, dtype: str):
    """A torch tensor → the numpy array of its bytes in ggml ``dtype`` (BF16 as its int16 bit pattern)."""
    x = x.contiguous()
    if dtype == "F32":
        return x.to(torch.float32).numpy()
    if dtype == "F16":
        return x.to(torch.float16).numpy()
    return x.to(torch.bfloat16).view(torch.int16).numpy()


def write(p: Plan, out: Path, ftype: int, advance: Callable[[int], None] = lambda n: None) -> None:
    """Stream plan ``p`` into the GGUF file ``out`` (created / truncated), calling ``advance(bytes)`` per tensor.

    Raises:
        OSError: the file cannot be written (disk full: ENOSPC). ImportError: the ``gguf`` package is missing.
    """
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(out), p.arch)
    try:
        write_metadata(w, p, ftype)
        for t in p.tensors:
            w.add_tensor_info(
                t.name, t.shape, np.float32, t.nbytes, raw_dtype=getattr(gguf.GGMLQuantizationType, t.dtype)
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in p.tensors:
            x = t.load()
            if tuple(x.shape) != tuple(t.shape):
                raise CheckpointError(f"{p.ckpt}: {t.name}: shape {tuple(x.shape)}, expected {t.shape}")
            w.write_tensor_data(_as_stored(x, t.dtype))
            advance(t.nbytes)
        w.flush()
    finally:
        w.close()
