"""Compact test-side transcription of upstream Fast-dLLM v2 ``generate`` (``Efficient-Large-Model/Fast_dLLM_v2_*``
``modeling.py``; temperature 0, ``use_block_cache=False``, batch 1). Upstream's KV cache of whole blocks is replaced
by the same math without a cache: every forward runs ``logits_fn`` (block-causal, uncached) over the whole sequence
so far and keeps the current block's rows."""
from __future__ import annotations

import torch


def _stop_break(x_t, pl, stop, mask_id) -> bool:
    gen = x_t[0, pl:]
    if stop not in gen:
        return False
    k = int((gen == stop).nonzero()[0])
    return int((gen[:k] == mask_id).sum()) == 0


def v2_generate(logits_fn, input_ids, max_new_tokens, mask_id, threshold, small_block_size, block_size, stop):
    original = input_ids.shape[1]
    if input_ids.shape[1] > block_size:
        last = logits_fn(input_ids[:, :input_ids.shape[1] // block_size * block_size])[:, -1]
        if input_ids.shape[1] % block_size == 0:
            input_ids = torch.cat([input_ids, last.argmax(-1)[:, None]], 1)
    for _ in range(max_new_tokens // block_size):
        if stop in input_ids[0, original:]:
            break
        pl = input_ids.shape[1]
        x_t = torch.cat([input_ids, torch.full((1, block_size - pl % block_size), mask_id)], 1)
        while True:
            if _stop_break(x_t, pl, stop, mask_id):
                break
            if int((x_t[:, -block_size:] == mask_id).sum()) == 0:
                nxt = logits_fn(x_t)[:, -1].argmax(-1)
                x_t = torch.cat([x_t, nxt[:, None]], 1)
                break
            for sb in range(block_size // small_block_size):
                start = x_t.shape[1] - block_size + sb * small_block_size
                end = start + small_block_size
                while True:
                    mask_idx = x_t[:, start:end] == mask_id
                    if int(mask_idx.sum()) == 0 or _stop_break(x_t, pl, stop, mask_id):
                        break
                    logits = logits_fn(x_t)[:, -block_size:]
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                    lo = start - (x_t.shape[1] - block_size)
                    logits = logits[:, lo:lo + small_block_size]
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
        input_ids = input_ids[:, :original + k + 1]
    return input_ids
