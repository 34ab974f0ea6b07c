"""Compact test-side transcription of upstream Fast-dLLM v2 ``generate`` (``Efficient-Large-Model/Fast_dLLM_v2_*``
``modeling.py``; temperature 0, batch 1), with and without its sub-block cache (``use_block_cache``).

Without it (``v2_generate(logits_fn, ...)``) upstream's KV cache of whole blocks is replaced by the same math without
a cache: every forward runs ``logits_fn`` (block-causal, uncached) over the whole sequence so far and keeps the
current block's rows. With it (``v2_generate(Cached(model), ..., use_block_cache=True)``) the cache cannot be
replaced by a full pass (the kept block K/V are stale on purpose), so :class:`Cached` transcribes upstream's
inference forward (``Fast_dLLM_QwenAttention.forward``: ``past_key_values`` of finished blocks, updated only with
``update_past_key_values``; ``block_past_key_values`` filled by a whole-block pass and overwritten in place at
``replace_position`` by a sub-block pass; SDPA without a mask inside the block) over transformers' Qwen2 weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv


def _stop_break(x_t, pl, stop, mask_id) -> bool:
    gen = x_t[0, pl:]
    if stop not in gen:
        return False
    k = int((gen == stop).nonzero()[0])
    return int((gen[:k] == mask_id).sum()) == 0


class Uncached:
    """Every pass recomputed over the whole sequence (``logits_fn(ids [1, T]) -> [1, T, V]``, block-causal)."""

    def __init__(self, logits_fn):
        self.fn = logits_fn

    def prefill(self, ids, block_size):  # whole blocks → the last row's logits
        return self.fn(ids)[:, -1]

    def block(self, x_t, block_size, keep=False):  # the current block's rows (no block cache)
        return self.fn(x_t)[:, -block_size:], None

    def commit(self, x_t, block_size):  # a finished block → its last row's logits
        return self.fn(x_t)[:, -1]


class Cached:
    """Upstream's cached forward over a transformers ``Qwen2ForCausalLM`` (module docstring)."""

    def __init__(self, model):
        self.m, self.head = model.model, model.lm_head
        self.past = [None] * len(self.m.layers)

    def _run(self, ids, start, update=False, block_kv=None, replace=None, new_block=None, block_size=None):
        n = ids.shape[1]
        x = self.m.embed_tokens(ids)
        cos, sin = self.m.rotary_emb(x, torch.arange(start, start + n)[None])
        mask = None
        if update and block_size and n > block_size:  # several blocks at once: block-causal among them
            pos = torch.arange(n)
            past_n = 0 if self.past[0] is None else self.past[0][0].shape[2]
            mask = torch.cat(
                [torch.ones(n, past_n, dtype=torch.bool), (pos[None, :] // block_size) <= (pos[:, None] // block_size)],
                1,
            )
        for i, layer in enumerate(self.m.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (1, n, -1, att.head_dim)
            q = att.q_proj(h).view(shape).transpose(1, 2)
            k = att.k_proj(h).view(shape).transpose(1, 2)
            v = att.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if new_block is not None:  # block_past_key_values.update (a fresh block cache)
                new_block.append([k.clone(), v.clone()])
            elif block_kv is not None:  # in place at replace_position, then the whole block
                block_kv[i][0][:, :, replace : replace + n] = k
                block_kv[i][1][:, :, replace : replace + n] = v
                k, v = block_kv[i]
            if self.past[i] is not None:
                k, v = torch.cat([self.past[i][0], k], 2), torch.cat([self.past[i][1], v], 2)
            if update:
                self.past[i] = (k, v)
            g = att.num_key_value_groups
            o = F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), attn_mask=mask)
            x = x + att.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.head(self.m.norm(x)).float()
        out[..., self.mask_id] = -torch.inf  # a model that never predicts the mask token (ours never does)
        return out

    def prefill(self, ids, block_size):
        return self._run(ids, 0, update=True, block_size=block_size)[:, -1]

    def block(self, x_t, block_size, keep=False):
        new = [] if keep else None
        return self._run(x_t[:, -block_size:], x_t.shape[1] - block_size, new_block=new), new

    def sub(self, x_t, block_size, s0, sbs, block_kv):
        start = x_t.shape[1] - block_size + s0
        return self._run(x_t[:, start : start + sbs], start, block_kv=block_kv, replace=s0)

    def commit(self, x_t, block_size):
        return self._run(x_t[:, -block_size:], x_t.shape[1] - block_size, update=True)[:, -1]


def v2_generate(
    fwd, input_ids, max_new_tokens, mask_id, threshold, small_block_size, block_size, stop, use_block_cache=False
):
    """``fwd``: a logits_fn (uncached) or a :class:`Cached`; returns LongTensor[1, T] as upstream ``generate``."""
    fwd = fwd if isinstance(fwd, (Uncached, Cached)) else Uncached(fwd)
    if isinstance(fwd, Cached):
        fwd.mask_id = mask_id
    original = input_ids.shape[1]
    if input_ids.shape[1] > block_size:
        last = fwd.prefill(input_ids[:, : input_ids.shape[1] // block_size * block_size], block_size)
        if input_ids.shape[1] % block_size == 0:
            input_ids = torch.cat([input_ids, last.argmax(-1)[:, None]], 1)
    for _ in range(max_new_tokens // block_size):
        if stop in input_ids[0, original:]:
            break
        pl = input_ids.shape[1]
        x_t = torch.cat([input_ids, torch.full((1, block_size - pl % block_size), mask_id)], 1)
        block_kv = None
        while True:
            if _stop_break(x_t, pl, stop, mask_id):
                break
            if int((x_t[:, -block_size:] == mask_id).sum()) == 0:
                nxt = fwd.commit(x_t, block_size).argmax(-1)
                x_t = torch.cat([x_t, nxt[:, None]], 1)
                break
            for sb in range(block_size // small_block_size):
                s0 = sb * small_block_size
                start = x_t.shape[1] - block_size + s0
                end = start + small_block_size
                while True:
                    mask_idx = x_t[:, start:end] == mask_id
                    if int(mask_idx.sum()) == 0 or _stop_break(x_t, pl, stop, mask_id):
                        break
                    if use_block_cache and block_kv is not None and not (x_t[:, start] == mask_id).any():
                        logits = fwd.sub(x_t, block_size, s0, small_block_size, block_kv)
                        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                    else:
                        logits, new = fwd.block(x_t, block_size, keep=use_block_cache)
                        block_kv = new if use_block_cache else None
                        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)[:, s0 : s0 + small_block_size]
                    p = torch.softmax(logits.float(), -1)
                    x1 = p.argmax(-1)
                    x1_p = torch.gather(p, -1, x1[..., None]).squeeze(-1)
                    x1_p = torch.where(mask_idx, x1_p, -torch.inf)
                    unmask = x1_p > threshold
                    unmask[torch.arange(1), x1_p.argmax(-1)] = True
                    unmask &= mask_idx
                    seg = x_t[:, start:end]
                    seg[unmask] = x1[unmask]
        input_ids = x_t
    if stop in input_ids[0, original:]:
        k = int((input_ids[0, original:] == stop).nonzero()[0])
        input_ids = input_ids[:, : original + k + 1]
    return input_ids
