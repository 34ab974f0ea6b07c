"""Checkpoint tensors → the GGUF tensors of llama.cpp's graphs: the names (HF Llama-style ``model.layers.N.*`` and
LLaDA's OLMo-style ``model.transformer.blocks.N.*`` → ``blk.N.*``; experts stacked into ``ffn_*_exps``), the q/k row
permutation for LLaDA's interleaved ("NORM") RoPE, the tensors each architecture's graph needs, the order they are
written in, and lazy loads from memory-mapped safetensors shards. :mod:`localdiff.backends.gguf_write` plans and
writes the file with them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

_HF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_HF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LLADA_LAYER = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "attn_out": "attn_output",
    "ff_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "ff_out": "ffn_down",
    "attn_norm": "attn_norm",
    "ff_norm": "ffn_norm",
}
_LLADA_TOP = {
    "model.transformer.wte.weight": "token_embd.weight",
    "model.transformer.ln_f.weight": "output_norm.weight",
    "model.transformer.ff_out.weight": "output.weight",
}
#: checkpoint tensors that have no GGUF counterpart and are skipped (rotary caches, float16 copies, BN counters)
IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rope\.|_float16|num_batches_tracked)")


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Half-split RoPE rows → interleaved pairs, per head (llama.cpp ``LLaDAModel.permute``): w [n_head·D, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class Tensor:
    """One GGUF tensor to write: ``name``, torch-order ``shape``, ggml ``dtype`` name ("F32" / "F16" / "BF16"),
    and ``load()`` → torch tensor (read from the checkpoint, transformed)."""

    name: str
    shape: tuple
    dtype: str
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * (4 if self.dtype == "F32" else 2)


def gguf_name(name: str, llada: bool) -> tuple[str | None, int | None]:
    """(GGUF name, expert index) of a checkpoint tensor name; (None, None) when it has no counterpart."""
    if llada:
        if name in _LLADA_TOP:
            return _LLADA_TOP[name], None
        m = re.fullmatch(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.weight", name)
        if m and m.group(2) in _LLADA_LAYER:
            return f"blk.{m.group(1)}.{_LLADA_LAYER[m.group(2)]}.weight", None
        return None, None
    if name in _HF_TOP:
        return _HF_TOP[name], None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m:
        return None, None
    i, mod, leaf = m.groups()
    e = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", mod)
    if e and leaf == "weight":
        return f"blk.{i}.ffn_{e.group(2)}_exps.weight", int(e.group(1))
    if mod in _HF_LAYER:
        return f"blk.{i}.{_HF_LAYER[mod]}.{leaf}", None
    return None, None


def shard_reader(files: dict):
    """(get, shape, dtype) of memory-mapped safetensors shards: name → torch tensor / shape / dtype string."""
    from safetensors import safe_open

    handles = {}

    def handle(name: str):
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return handles[f]

    return (
        lambda n: handle(n).get_tensor(n),
        lambda n: tuple(handle(n).get_slice(n).get_shape()),
        lambda n: handle(n).get_slice(n).get_dtype(),
    )


def tensor_loader(get, name: str, heads: int | None = None):
    """A ``load()`` for one tensor; with ``heads`` its rows are permuted for llama.cpp's NORM RoPE."""
    if heads is None:
        return lambda: get(name)
    return lambda: permute_rope_rows(get(name), heads)


def expected_tensors(arch: str, c) -> set:
    """The tensors llama.cpp's ``arch`` graph needs (biases and tied heads aside)."""
    out = {"output_norm.weight"}
    moe = arch in ("llada-moe", "qwen3moe")
    for i in range(c.num_hidden_layers):
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
        names += (
            ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
            if moe
            else ["ffn_gate", "ffn_up", "ffn_down"]
        )
        if arch in ("qwen3", "qwen3moe") or (arch == "llada-moe" and c.qk_norm):
            names += ["attn_q_norm", "attn_k_norm"]
        out |= {f"blk.{i}.{n}.weight" for n in names}
        if arch in ("qwen2", "dream"):
            out |= {f"blk.{i}.attn_{p}.bias" for p in "qkv"}
    return out


def layer_index(name: str) -> int:
    """The layer index of a ``blk.N.*`` name; -1 for the others."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def order_key(name: str):
    """Sort key of a GGUF tensor name: ``token_embd`` first, then layer by layer, then the other top-level tensors."""
    i = layer_index(name)
    return (0, i, name) if i >= 0 else ((-1 if name == "token_embd.weight" else 1), 0, name)


def tensor_order(t: Tensor):
    """Sort key of a :class:`Tensor` (:func:`order_key` of its name): the order tensors are written in."""
    return order_key(t.name)
