"""Autoregressive causal LMs (Qwen3, Llama): a causal :class:`localdiff.arch.dense.DenseStack` with an exact KV
cache — the targets of DFlash speculative decoding (arXiv 2602.06036) and plain AR models.

Roles: ``prefill`` (cached causal pass over new tokens at positions ``cache.seq_len ..``: K/V appended and
committed, logits returned) and ``logits`` (``logits_full``: one uncached causal pass with an optional left-padding
mask). Both can also return the *context features* DFlash drafts read: the hidden states after the chosen layers,
concatenated on the last axis (z-lab/dflash ``extract_context_feature``: ``output.hidden_states[layer_id + 1]`` —
transformers' ``hidden_states`` tuple holds the embeddings, then each layer's output, the last one after the final
norm; we return the same tensors). Math as transformers 5.23.0 ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``; tests
compare logits to 1e-4 and greedy tokens to ``generate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localdiff.arch.base import ROLE_LOGITS, ROLE_PREFILL
from localdiff.arch.causal_spec import CausalConfig
from localdiff.arch.dense import DenseStack, rope_cos_sin
from localdiff.arch.llama_base import CHECKPOINT_RULES  # noqa: F401  (contract name: the Llama / Qwen layout)
from localdiff.arch.llama_base import checkpoint_names, keeps_checkpoint_dtype  # noqa: F401  (the same layout)


class CausalLM(DenseStack):
    """A Qwen3 / Llama causal LM (``config``: :class:`localdiff.arch.causal_spec.CausalConfig`)."""

    roles = frozenset({ROLE_PREFILL, ROLE_LOGITS})

    def __init__(self, cfg: CausalConfig):
        super().__init__(cfg)
        self.config = cfg

    def cache_layout(self, block_len: int = 64) -> dict:
        """``localdiff.cache.kv.KVCache`` keyword arguments: full-attention layers, blocks of ``block_len`` tokens
        (also the room kept after the cached run: at least the longest block a pass appends), per-layer heads."""
        n = self.config.num_hidden_layers
        return {
            "layer_windows": [None] * n,
            "block_len": block_len,
            "layer_heads": [(self.config.head_dim, self.config.num_key_value_heads)] * n,
        }

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states Tensor[B, n, H] → fp32 logits Tensor[B, n, V]."""
        return F.linear(h, self.head_weight()).float()

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        cache,
        attention_mask: torch.Tensor | None = None,
        layers: list[int] | None = None,
        last_only: bool = False,
    ):
        """Cached causal pass over new tokens (positions continue at ``cache.seq_len``); their K/V are appended and
        committed (``cache.writing``: reset on any exception).

        Args:
            input_ids: LongTensor[B, n], n ≥ 1.
            cache: a :class:`localdiff.arch.base.BlockCache` with full-attention layers (``KVCache``).
            attention_mask: must be None or all ones (left padding is not supported by the cached pass).
            layers: target layer ids whose outputs to return as context features (None = none).
            last_only: compute logits for the last position only (a prompt's prefill).
        Returns:
            (logits FloatTensor[B, n or 1, V] fp32, features Tensor[B, n, len(layers)·H] or None).
        Raises:
            ValueError: a padding mask.
        """
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("the cached causal pass does not take left padding")
        start, n = cache.seq_len, input_ids.shape[1]
        mask = None
        if n > 1:
            q = torch.arange(n, device=input_ids.device)[:, None] + start
            mask = torch.arange(start + n, device=input_ids.device)[None, :] <= q
        with cache.writing(input_ids):
            h, feats = self._run(input_ids, start, mask, cache, layers)
        return self.logits(h[:, -1:] if last_only else h), feats

    @torch.inference_mode()
    def logits_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One uncached causal pass: LongTensor[B, T] (+ Bool/LongTensor[B, T] mask, 0 = left padding) →
        FloatTensor[B, T, V] fp32. With padding, positions count real tokens only (transformers' ``generate``)."""
        return self.logits(self.hidden(input_ids, attention_mask)[0])

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, layers: list[int] | None = None
    ):
        """Uncached causal pass (autograd allowed: the training recipes use it).

        Returns (final-normed hidden Tensor[B, T, H], features Tensor[B, T, len(layers)·H] or None)."""
        b, t = input_ids.shape
        dev = input_ids.device
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        if attention_mask is None:
            return self._run(input_ids, 0, causal, None, layers)
        m = attention_mask.to(dev).bool()
        pos = (m.long().cumsum(-1) - 1).clamp_min(0)
        mask = (causal[None] & m[:, None, :]) | torch.eye(t, dtype=torch.bool, device=dev)[None]
        return self._run(input_ids, pos, mask[:, None], None, layers)

    def _run(self, ids, start, mask, cache, layers):
        """Per layer: q/k/v (RoPE at ``start`` — an int, or LongTensor[B, T] positions), attention over the cache's
        past + the new keys (appended to the cache), FFN. Returns (normed hidden, features or None)."""
        x = self.embed_tokens(ids)
        n = ids.shape[1]
        if isinstance(start, int):
            cos, sin = rope_cos_sin(self._inv_freq, start, n, x.device)
        else:  # per-row positions (left padding): tables [B, 1, T, rot]
            freqs = start.float()[..., None] * self._inv_freq.to(x.device)
            emb = torch.cat([freqs, freqs], -1)[:, None]
            cos, sin = emb.cos(), emb.sin()
        want = set(layers or ())
        outs = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
            kk, vv = (k, v) if cache is None or not cache.visible_len(i) else cache.with_canvas(i, k, v)
            a = att.attend(q, kk, vv, mask)
            if cache is not None:
                cache.append(i, k, v)
            x = layer.ffn(x + a)
            if i in want and i != last:
                outs[i] = x
        h = self.norm(x)
        if last in want:
            outs[last] = h
        feats = torch.cat([outs[i] for i in layers], -1) if layers else None
        return h, feats


MODEL_CLASS = CausalLM
