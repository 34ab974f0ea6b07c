"""DiffusionGemma (google/diffusiongemma-26B-A4B-it) text backbone in plain torch.

One set of weights plays two roles (reference: transformers 5.23.0 ``modeling_diffusion_gemma.py``):

* **prefill** — the causal encoder pass over prompt / finished canvases; it appends K/V to the cache.
* **denoise** — the bidirectional decoder pass over a canvas of C tokens that attends to the cached prefix
  (read-only) and to itself, with self-conditioning on the previous step's logits; returns logits[B, C, V].
* **fused** — both in one forward: tokens to prefill, then a canvas (the loop prefills the prompt and each finished
  canvas with the next canvas's first step); attention and expert grouping per role: bit-identical to two passes.

Each layer: attention (q/k/v norms, scale 1.0, RoPE "default" on sliding layers and "proportional" with a partial
rotary factor on full-attention layers, which have their own head_dim / KV-head count and share k = v), then a
dense gated MLP and a top-k MoE in parallel (router on the residual, experts on the pre-norm-2 input), a per-layer
scalar (encoder and decoder keep separate ones), final RMSNorm, tied LM head and logit soft-capping.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from localdiff.arch.base import ROLE_DENOISE, ROLE_PREFILL
from localdiff.arch.diffusion_gemma_layers import Attention, Layer, SelfConditioning, layer_type  # noqa: F401
from localdiff.arch.diffusion_gemma_spec import (  # noqa: F401
    CHECKPOINT_RULES,
    MODEL_TYPE,
    DiffusionGemmaConfig,
    checkpoint_names,
    is_skipped_checkpoint_tensor,
    keeps_checkpoint_dtype,
)
from localdiff.arch.layers import RMSNorm, attention, embed_scale, linear, norm, rope_inv_freq, rope_tables
from localdiff.arch.masks import canvas_keys, prefill_mask
from localdiff.arch.soft_embedding import RawLogits, raw_head, soft_embedding


class DiffusionGemma(nn.Module):
    """The DiffusionGemma text backbone. See the module docstring for the two roles.

    Attributes ``embed_tokens`` (Tensor[V, H], tied LM head unless ``lm_head`` is set), ``layers``, ``norm``,
    ``self_conditioning``.
    """

    roles = frozenset({ROLE_PREFILL, ROLE_DENOISE})
    #: None = the exact self-conditioning soft embedding; k = the top-k approximation (opt-in, not reference-exact;
    #: :mod:`localdiff.arch.soft_embedding`)
    sc_topk: int | None = None
    supports_int8_head = True  # logits read ``head_int8`` when set; embed_tokens may be a quantized table then

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq = {}
        with torch.device("cpu"):  # rotary tables are computed, never loaded: keep them off the meta device
            for ty in set(cfg.layer_types):
                d = cfg.layer_heads[cfg.layer_types.index(ty)][0]
                self._inv_freq[ty] = rope_inv_freq(cfg.rope_parameters[ty], d)
        self._rope_memo: dict = {}
        self._scale_memo: dict = {}

    def fuse_projections(self) -> None:
        """After loading: run q/k/v and each gate/up pair as one matmul (weights become views of one tensor).
        Quantized (non-nn.Linear) projections are left alone."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.self_conditioning.mlp.fuse()

    # -- helpers ------------------------------------------------------------------------------------------------
    def layer_windows(self) -> list[int | None]:
        """Per-layer sliding window (for building a cache)."""
        return [self.config.window(i) for i in range(self.config.num_hidden_layers)]

    def cache_layout(self) -> dict:
        """How the engine builds this model's block KV cache (``localdiff.cache.kv.KVCache`` keyword arguments):
        per-layer windows, blocks of one canvas, sliding layers keep one canvas of slack for chat prefix reuse, and
        per-layer (head_dim, kv_heads). ``arch`` never imports a cache implementation; the engine builds it."""
        c = self.config.canvas_length
        return {
            "layer_windows": self.layer_windows(),
            "slack": c,
            "block_len": c,
            "layer_heads": list(self.config.layer_heads) or None,
        }

    def _scale(self, dtype, device) -> torch.Tensor:
        """sqrt(hidden) rounded to dtype, on device (memoised: used twice per denoising step)."""
        key = (dtype, str(device))
        t = self._scale_memo.get(key)
        if t is None:
            t = self._scale_memo[key] = embed_scale(self.config.hidden_size, dtype).to(device)
        return t

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * self._scale(x.dtype, x.device)

    def _rope(self, start: int, n: int, dtype, device) -> dict:
        """cos/sin per layer type for positions start..start+n-1, memoised (computed once per canvas)."""
        key = (start, n, dtype, str(device))
        hit = self._rope_memo.get(key)
        if hit is None:
            pos = torch.arange(start, start + n, device=device)
            hit = {ty: rope_tables(inv, pos, dtype) for ty, inv in self._inv_freq.items()}
            if len(self._rope_memo) > 8:
                self._rope_memo.clear()
            self._rope_memo[key] = hit
        return hit

    def logits(self, h: torch.Tensor, raw: bool = False):
        """Final hidden states Tensor[B, C, H] → soft-capped fp32 logits Tensor[B, C, V]; ``raw``: the head's output
        and the cap as :class:`localdiff.arch.soft_embedding.RawLogits` (the fast path's vocab pass soft-caps)."""
        cap, head = self.config.final_logit_softcapping, getattr(self, "head_int8", None)  # quantized head
        w = None if head else self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        if raw:  # into a reused buffer, valid until the next raw call
            return RawLogits(head(h), cap) if head else raw_head(h, w, cap, self.__dict__.setdefault("_hb", {}))
        y = (head(h) if head else nn.functional.linear(h, w)).float()  # fresh: soft-cap in place (same ops, no copies)
        if cap is None:
            return y
        if y.requires_grad:  # training (the recipe): autograd needs tanh's output
            return torch.tanh(y / cap) * cap
        return y.div_(cap).tanh_().mul_(cap)

    # -- the two roles ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None) -> None:
        """Causal encoder pass over new tokens; appends their K/V to ``cache`` (positions continue at cache.seq_len).

        Args:
            input_ids: LongTensor[B, T] (left-padded when rows differ in length).
            cache: a KV cache (``localdiff.cache.kv``) for this batch.
            attention_mask: Bool/LongTensor[B, T], 1 = real token, 0 = padding; None = all real.
        """
        self._forward(input_ids, attention_mask, None, None, cache)

    @torch.inference_mode()
    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache,
        self_conditioning_logits: torch.Tensor | None = None,
        prefill_ids: torch.Tensor | None = None,
        prefill_mask: torch.Tensor | None = None,
        head_rows: torch.Tensor | None = None,
        raw_logits: bool = False,
    ) -> torch.Tensor:
        """Bidirectional decoder pass over a canvas that attends to the cached prefix.

        With ``prefill_ids`` it is a *fused* pass: those tokens are prefilled (causal encoder role, K/V appended to
        the cache, as :meth:`prefill`) in the same forward, and the canvas attends to them — one forward instead of
        two for a canvas's first step. Without, the cache is only read.

        Args:
            canvas_ids: LongTensor[B, C].
            cache: the KV cache filled by :meth:`prefill`.
            self_conditioning_logits: FloatTensor[B, C, V] of the previous step (temperature-scaled), or its
                softmax as :class:`localdiff.arch.soft_embedding.Probabilities`, or None.
            prefill_ids / prefill_mask: LongTensor[B, T] and its Bool[B, T] padding mask (None = all real), or None.
            head_rows: BoolTensor[B, C] or None: the LM head runs only at these positions (opt-in approximation
                ``reuse_locked``, :mod:`localdiff.decoding.canvas_reuse`).
            raw_logits: return the LM head's output before the fp32 cast and soft-capping (``RawLogits``).
        Returns:
            FloatTensor[B, C, V] fp32 logits (soft-capped); with ``head_rows``, FloatTensor[N, V] of its N True
            positions in row-major order; with ``raw_logits``, RawLogits (a buffer the next raw call reuses).
        """
        return self._forward(
            prefill_ids, prefill_mask, canvas_ids, self_conditioning_logits, cache, head_rows, raw_logits
        )

    def _forward(self, ids, ids_mask, canvas_ids, sc_logits, cache, head_rows=None, raw_logits=False):
        """One pass: ``ids`` (n prefill rows, may be None) then ``canvas_ids`` (c canvas rows, may be None), as
        named stages: inputs (embeddings + self-conditioning) → per layer: attention over the cache (the fused
        stage when there are prefill rows, else the canvas stage), FFN and layer scalar → logits."""
        n = 0 if ids is None else ids.shape[1]
        c = 0 if canvas_ids is None else canvas_ids.shape[1]
        x = self._inputs(ids, canvas_ids, sc_logits)
        b, dev = x.shape[0], x.device
        start = cache.seq_len
        rope = self._rope(start, n + c, x.dtype, dev)
        new_mask = None if (ids_mask is None or not n) else ids_mask.to(dev).bool()
        if new_mask is not None and bool(new_mask.all()):  # as commit() does: no padding means no mask
            new_mask = None
        masks: dict = {}
        last = len(self.layers) - 1
        with cache.writing(ids, new_mask) if n else contextlib.nullcontext():
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                cos, sin = rope[layer_type(att)]
                q, k, v = att.qkv(norm(layer.input_layernorm, x), cos, sin)
                if n:
                    mask_key = (att.sliding, cache.visible_len(i))
                    if mask_key not in masks:
                        masks[mask_key] = self._masks(
                            b, n, c, start, mask_key[1], att.sliding, cache.past_mask(i), new_mask, dev
                        )
                    a = self._attend_fused(i, q, k, v, n, c, cache, masks[mask_key])
                    if a is None:  # prefill only, last layer: only its K/V were needed
                        break
                    if i == last:  # the prefill rows are done: the canvas rows go on alone
                        x, n = x[:, n:], 0
                else:
                    a = self._attend_canvas(i, q, k, v, c, cache, masks, b, dev)
                x = self._ffn_stage(layer, x, a, n, c)
        if not c:
            return None
        if head_rows is not None:
            x = x.reshape(-1, x.shape[-1])[head_rows.reshape(-1).to(x.device)]
        return self.logits(norm(self.norm, x), raw=raw_logits)

    # -- the stages of a pass -----------------------------------------------------------------------------------
    def _inputs(self, ids, canvas_ids, sc_logits) -> torch.Tensor:
        """Input stage: prefill rows' embeddings, then canvas rows' embeddings with self-conditioning on the
        previous step's logits (soft embedding ``softmax(sc) @ E``). Tensor[B, n + c, H]."""
        parts = [self._embed(ids)] if ids is not None and ids.shape[1] else []
        if canvas_ids is not None and canvas_ids.shape[1]:
            xc = self._embed(canvas_ids)
            soft = None
            if sc_logits is not None:
                e = self.embed_tokens.weight if isinstance(self.embed_tokens, nn.Embedding) else self.embed_tokens
                soft = soft_embedding(sc_logits, e, self.sc_topk) * self._scale(xc.dtype, xc.device)
            parts.append(self.self_conditioning(xc, soft))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _attend_fused(self, i, q, k, v, n, c, cache, masks):
        """Attention stage with n prefill rows (+ c canvas rows): the prefill rows' K/V are appended to the cache;
        each kind of row attends over the keys its own pass would read (bit-identical to two passes). Returns
        Tensor[B, rows, Hq·D] — prefill rows then canvas rows; only the canvas rows on the last layer — or None for
        a prefill-only pass on the last layer."""
        m_pre, lo, m_can = masks
        past_n = cache.visible_len(i)
        past = cache.past(i)
        kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
        cache.append(i, k[:, :, :n] if c else k, v[:, :, :n] if c else v)
        last = i == len(self.layers) - 1
        if last and not c:
            return None
        a = attention(q[:, :, n:], kk[:, :, lo:], vv[:, :, lo:], m_can) if c else None
        if last:
            return a
        seen = past_n + n
        a_pre = attention(q[:, :, :n], kk[:, :, :seen], vv[:, :, :seen], m_pre)
        return a_pre if a is None else torch.cat([a_pre, a], 1)

    def _attend_canvas(self, i, q, k, v, c, cache, masks, b, dev):
        """Attention stage of a canvas-only pass: the canvas reads the whole visible past and itself; the cache is
        only read. Tensor[B, c, Hq·D]."""
        pm = cache.past_mask(i)
        mask = None
        if pm is not None:  # pm covers exactly the visible past: the canvas reads all of it
            if pm.shape[1] not in masks:
                masks[pm.shape[1]] = canvas_keys(b, pm.shape[1], c, None, pm.to(dev), dev)[1]
            mask = masks[pm.shape[1]]
        kk, vv = cache.with_canvas(i, k, v)
        return attention(q, kk, vv, mask)

    def _ffn_stage(self, layer, x, a, n, c):
        """Attention output projection + residual, then the FFN (dense MLP ∥ MoE) and the layer scalar (the
        encoder's for prefill rows, the decoder's for canvas rows)."""
        att = layer.self_attn
        x = x + norm(layer.post_attention_layernorm, linear(att.o_proj, a))
        x = layer.ffn(x, n if c else 0)
        if not n:
            return x * (layer.layer_scalar if c else layer.enc_layer_scalar)
        if not c:
            return x * layer.enc_layer_scalar
        return torch.cat([x[:, :n] * layer.enc_layer_scalar, x[:, n:] * layer.layer_scalar], 1)

    def _masks(self, b, n, c, start, past_n, sliding, pm, new_mask, dev) -> tuple:
        """(prefill rows' mask, first key index and mask of the canvas rows) of a pass with n prefill rows (+ c
        canvas rows), see ``localdiff.arch.masks``."""
        pad = None
        if pm is not None or new_mask is not None:
            pm = pm.to(dev) if pm is not None else torch.ones(b, past_n, dtype=torch.bool, device=dev)
            nm = new_mask if new_mask is not None else torch.ones(b, n, dtype=torch.bool, device=dev)
            pad = torch.cat([pm, nm], 1)
        window = self.config.sliding_window if sliding else None
        lo, m_can = canvas_keys(b, past_n + n, c, window, pad, dev) if c else (0, None)
        return prefill_mask(b, n, start, past_n, window, pad, dev)[:, None], lo, m_can


MODEL_CLASS = DiffusionGemma
