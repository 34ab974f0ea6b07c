"""Block-diffusion language models (SDAR, SDAR-MoE, Fast-dLLM v2, Tiny-A2D BD3LM): a
:class:`localdiff.arch.dense.DenseStack` (Qwen3 / Qwen3-MoE / Qwen2 math) with block-causal attention — causal
across blocks of ``config.block_size`` tokens at absolute positions, bidirectional inside a block — and the roles of
the exact block KV cache, the way DiffusionGemma's canvases work (:mod:`localdiff.arch.diffusion_gemma`):

* ``prefill(input_ids, cache, attention_mask=None)`` — whole blocks (the prompt's complete blocks, a finished
  block) appended to the cache; rows attend to the cache and, inside the new tokens, block-causally.
* ``denoise(canvas_ids, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None)`` — one block
  (the canvas, C = block_size tokens starting at ``cache.seq_len + len(prefill_ids)``, a block boundary) attends
  to everything before it and to itself; the cache is only read. With ``prefill_ids`` it is the *fused* pass: those
  tokens are prefilled in the same forward (rows of both kinds run through the linear layers together; attention
  runs per kind over exactly the keys its own pass reads). No self-conditioning: the argument must be None.
* ``denoise_capture(canvas_ids, cache)`` / ``denoise_sub(sub_ids, cache, block_kv, offset)`` — Fast-dLLM v2's
  sub-block cache (``use_block_cache``): the first is ``denoise`` that also returns the block's own K/V per layer;
  the second runs only a sub-block's tokens (at block offset ``offset``), writes their K/V over the block's in
  place and attends to the cache and the whole (partly stale) block.
* ``logits_full(input_ids, attention_mask=None)`` — one uncached pass with the block-causal mask over the whole
  sequence (the reference the cached path is tested against).

All return RAW logits FloatTensor[B, rows, V] in fp32 (Fast-dLLM v2 shifts them in its decoder: ``token_shift``).
Sources: SDAR ``modeling_sdar.py`` (``store_kv``: a block's K/V are written once it is complete), Fast-dLLM v2
``modeling.py`` (``eval_block_diff_mask``: ``block_q >= block_kv``), dllm ``build_staircase_attention_mask``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from localdiff.arch.base import ROLE_DENOISE, ROLE_LOGITS, ROLE_PREFILL
from localdiff.arch.block_spec import BlockConfig
from localdiff.arch.dense import DenseStack, rope_cos_sin
from localdiff.arch.llama_base import CHECKPOINT_RULES  # noqa: F401  (contract name: the Llama / Qwen layout)
from localdiff.arch.llama_base import checkpoint_names, keeps_checkpoint_dtype  # noqa: F401  (contract names)


def block_causal_mask(positions: torch.Tensor, key_positions: torch.Tensor, block: int) -> torch.Tensor:
    """BoolTensor[Lq, Lk]: query at absolute position p sees key at q iff ``q // block <= p // block``."""
    return (key_positions[None, :] // block) <= (positions[:, None] // block)


class BlockLM(DenseStack):
    """A block-diffusion LM (see the module docstring). ``config``: :class:`localdiff.arch.block_spec.BlockConfig`
    (``block_size`` = ``canvas_length``, ``mask_token_id``, ``token_shift``, ...)."""

    roles = frozenset({ROLE_PREFILL, ROLE_DENOISE, ROLE_LOGITS})

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.config = cfg

    def cache_layout(self) -> dict:
        """``localdiff.cache.kv.KVCache`` keyword arguments: full attention on every layer, blocks of one block
        size, per-layer (head_dim, kv_heads) for a finite device budget."""
        c = self.config
        return {
            "layer_windows": [None] * c.num_hidden_layers,
            "slack": 0,
            "block_len": c.block_size,
            "layer_heads": [(c.head_dim, c.num_key_value_heads)] * c.num_hidden_layers,
        }

    supports_int8_head = True  # a recipe's head = "int8" gives it ``head_int8`` (localdiff.quantize.int8)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "head_int8", None)
        y = head(h) if head is not None else F.linear(h, self.head_weight())
        return y[..., : self.config.vocab_size].float()

    # -- roles ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uncached block-causal pass over LongTensor[B, T] (positions 0..T-1; ``attention_mask`` Bool/Long[B, T],
        0 = padding, never attended to; a padding query sees itself). Returns FloatTensor[B, T, V] raw logits."""
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device)
        mask = block_causal_mask(pos, pos, self.config.block_size)[None, None]
        if attention_mask is not None:
            pad = attention_mask.to(input_ids.device).bool()
            mask = (mask & pad[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=pos.device)[None, None]
        h, _ = self.run(input_ids, 0, mask)
        return self._logits(h)

    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None, last_logits: bool = False
    ):
        """Append whole blocks (LongTensor[B, T], padding mask Bool/Long[B, T] or None) to ``cache``. With
        ``last_logits``: returns the last row's raw logits FloatTensor[B, V] (Fast-dLLM v2 decodes a block's first
        token from them, autoregressively); else None."""
        return self._forward(input_ids, attention_mask, None, cache, last_logits)

    @torch.inference_mode()
    def denoise(
        self, canvas_ids: torch.Tensor, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None
    ) -> torch.Tensor:
        """One block's logits FloatTensor[B, C, V] over the cache (module docstring); with ``prefill_ids``
        (LongTensor[B, T], mask Bool[B, T] or None) the fused pass that also prefills them.

        Raises:
            ValueError: self-conditioning logits given (block models have none).
        """
        if self_conditioning_logits is not None:
            raise ValueError("block-diffusion models take no self-conditioning logits")
        return self._forward(prefill_ids, prefill_mask, canvas_ids, cache)

    @torch.inference_mode()
    def denoise_capture(self, canvas_ids: torch.Tensor, cache) -> tuple[torch.Tensor, list]:
        """``denoise(canvas_ids, cache)`` (logits FloatTensor[B, C, V]) and the block's K/V: a list over layers of
        [k, v] Tensors[B, kv_heads, C, head_dim] (upstream ``block_past_key_values``, Fast-dLLM v2 ``modeling.py``)."""
        block_kv: list = []
        return self._forward(None, None, canvas_ids, cache, block_kv=block_kv), block_kv

    @torch.inference_mode()
    def denoise_sub(self, sub_ids: torch.Tensor, cache, block_kv: list, offset: int) -> torch.Tensor:
        """Fast-dLLM v2's sub-block pass (``use_block_cache``, ``replace_position = offset``): LongTensor[B, n] of the
        current block's positions ``offset .. offset + n - 1``; per layer their K/V overwrite ``block_kv``'s (in
        place, as upstream's) and their queries attend to every cached key and the whole block's K/V. Returns
        FloatTensor[B, n, V] raw logits. Approximate where the rest of the block changed since ``block_kv`` was
        computed; exact when the sub-block is the whole block."""
        x = self.embed_tokens(sub_ids)
        b, n = sub_ids.shape
        cos, sin = rope_cos_sin(self._inv_freq, cache.seq_len + offset, n, x.device)
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
            bk, bv = block_kv[i]
            bk[:, :, offset : offset + n] = k
            bv[:, :, offset : offset + n] = v
            past_n = cache.visible_len(i)
            if past_n not in masks:
                masks[past_n] = self._masks(
                    b, 0, bk.shape[2], cache.seq_len, past_n, cache.past_mask(i), None, x.device
                )[1]
            kk, vv = cache.with_canvas(i, bk, bv)
            x = layer.ffn(x + att.attend(q, kk, vv, masks[past_n]))
        return self._logits(self.norm(x))

    # -- one pass -------------------------------------------------------------------------------------------------
    def _forward(self, ids, ids_mask, canvas_ids, cache, last_logits: bool = False, block_kv: list | None = None):
        n = 0 if ids is None else ids.shape[1]
        c = 0 if canvas_ids is None else canvas_ids.shape[1]
        rows = [t for t in (ids if n else None, canvas_ids if c else None) if t is not None]
        x = self.embed_tokens(rows[0] if len(rows) == 1 else torch.cat(rows, 1))
        b, dev = x.shape[0], x.device
        start = cache.seq_len
        cos, sin = rope_cos_sin(self._inv_freq, start, n + c, dev)
        new_mask = None if (ids_mask is None or not n) else ids_mask.to(dev).bool()
        if new_mask is not None and bool(new_mask.all()):
            new_mask = None
        masks: dict = {}
        last = len(self.layers) - 1
        with cache.writing(ids, new_mask) if n else contextlib.nullcontext():
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                q, k, v = att.qkv(layer.input_layernorm(x), cos, sin)
                past_n = cache.visible_len(i)
                if past_n not in masks:
                    masks[past_n] = self._masks(b, n, c, start, past_n, cache.past_mask(i), new_mask, dev)
                m_pre, m_can = masks[past_n]
                if n:
                    past = cache.past(i)
                    kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
                    cache.append(i, k[:, :, :n], v[:, :, :n])
                    if i == last and not c and not last_logits:
                        break  # prefill only: the last layer's K/V were all that was needed
                    outs = (
                        []
                        if i == last and c
                        else [att.attend(q[:, :, :n], kk[:, :, : past_n + n], vv[:, :, : past_n + n], m_pre)]
                    )
                    if c:
                        outs.append(att.attend(q[:, :, n:], kk, vv, m_can))
                    a = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
                    if i == last and c:  # only the canvas rows go on
                        x, n = x[:, n:], 0
                else:
                    if block_kv is not None:
                        block_kv.append([k.clone(), v.clone()])
                    kk, vv = cache.with_canvas(i, k, v)
                    a = att.attend(q, kk, vv, m_can)
                x = layer.ffn(x + a)
        if c:
            return self._logits(self.norm(x))
        return self._logits(self.norm(x[:, -1:]))[:, 0] if last_logits else None

    def _masks(self, b, n, c, start, past_n, pm, new_mask, dev):
        """(prefill rows' mask Bool[B, 1, n, past_n + n] or None, canvas rows' mask Bool[B, 1, 1, past_n + n + c]
        or None). Prefill rows: every cached key (whole earlier blocks), block-causal among the new keys, not
        padding (a padding query sees itself). Canvas rows (one block after everything): every non-padding key."""
        pad = None
        if pm is not None or new_mask is not None:
            pm = pm.to(dev) if pm is not None else torch.ones(b, past_n, dtype=torch.bool, device=dev)
            nm = new_mask if new_mask is not None else torch.ones(b, n, dtype=torch.bool, device=dev)
            pad = torch.cat([pm, nm], 1)
        m_pre = None
        if n:
            qpos = torch.arange(start, start + n, device=dev)
            kpos = torch.arange(start - past_n, start + n, device=dev)
            m_pre = block_causal_mask(qpos, kpos, self.config.block_size)[None, None].expand(b, 1, n, past_n + n)
            if pad is not None:
                m_pre = (m_pre & pad[:, None, None, :]) | (kpos[None, :] == qpos[:, None])[None, None]
            elif bool(m_pre.all()):
                m_pre = None
        m_can = None
        if c and pad is not None:
            m_can = torch.cat([pad, torch.ones(b, c, dtype=torch.bool, device=dev)], 1)[:, None, None, :]
        return m_pre, m_can


MODEL_CLASS = BlockLM
