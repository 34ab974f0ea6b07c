"""Compact test-side transcriptions of LLaDA2's upstream decoders, temperature 0, batch 1, uncached (every step a
forward over the whole sequence under the block-causal mask, as upstream runs it):

* :func:`llada20_generate` — the Hub ``modeling_llada2_moe.py`` ``generate`` of LLaDA2.0 (threshold, step
  schedule, ``minimal_topk``, ``eos_early_stop``, and ``top_k`` / ``top_p``, which its sampler applies at
  temperature 0 too);
* :func:`llada21_generate` — the Hub ``generate`` of LLaDA2.1 (``num_to_transfer``, token editing with
  ``editing_threshold``, ``max_post_steps``), as mirrored in dllm's ``modeling_llada21_moe.py``.

``logits_fn(x)`` → FloatTensor[1, T, V] plays ``self.forward(x, attention_mask=block mask, position_ids=arange)``.
Both return the generated ids up to and including the first EOS (or ``gen_length`` of them), and the number of
forwards. One departure, shared with our decoders (decoding/sdar.py): the tests' logits_fn never predicts the mask.
"""

from __future__ import annotations

import torch


def _schedule(block, steps):
    base, rem = divmod(block, steps)
    out = torch.full((steps,), base, dtype=torch.int64)
    out[:rem] += 1
    return out


def _greedy(logits):
    probs = torch.softmax(logits, dim=-1)
    x0 = torch.argmax(probs, dim=-1)
    return x0, torch.gather(probs, -1, x0[..., None])[..., 0]


def _top_k_logits(logits, k):
    if k is None or k <= 0:
        return logits
    values, _ = torch.topk(logits, k)
    min_values = values[..., -1, None]
    return torch.where(logits < min_values, torch.full_like(logits, float("-inf")), logits)


def _top_p_logits(logits, p):
    if p is None or p >= 1.0:
        return logits
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_mask = cumulative_probs > p
    sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
    sorted_mask[..., 0] = False
    mask_indices = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, sorted_indices, sorted_mask)
    return logits.masked_fill(mask_indices, float("-inf"))


def _sample_t0_llada20(logits, top_k=None, top_p=None):
    """The 2.0 ``_sample_with_temperature_topk_topp`` at temperature 0 (lingjiechen2/dllm
    ``dllm/pipelines/llada2/models/modeling_llada2_moe.py`` at 8e1d3d7b): the filters, then the softmax over the kept
    tokens, its argmax and probability."""
    orig_shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1])
    logits = _top_k_logits(logits, top_k)
    logits = _top_p_logits(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    token = torch.argmax(probs, dim=-1, keepdim=True)
    token_prob = torch.gather(probs, -1, token)
    return token.view(*orig_shape), token_prob.view(*orig_shape)


def _answer(x, prompt_len, gen_length, eos_id):
    gen = x[0, prompt_len : prompt_len + gen_length]
    hits = (gen == eos_id).nonzero()
    return gen[: int(hits[0, 0]) + 1 if len(hits) else gen_length].tolist()


def llada20_generate(
    logits_fn,
    prompt,
    block_length,
    steps,
    gen_length,
    threshold,
    minimal_topk=1,
    eos_early_stop=False,
    eos_id=None,
    mask_id=None,
    top_k=None,
    top_p=None,
):
    steps = min(steps, gen_length // minimal_topk)
    p = prompt.shape[1]
    nb = (p + gen_length + block_length - 1) // block_length
    x = torch.full((1, nb * block_length), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    sched = _schedule(block_length, steps)
    forwards = 0
    for blk in range(p // block_length, nb):
        end = (blk + 1) * block_length
        cur = x[:, :end]
        for step in range(steps):
            active = cur[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            forwards += 1
            x0, x0_p = _sample_t0_llada20(logits_fn(cur)[:, -block_length:], top_k, top_p)
            k = int(sched[step])
            conf = torch.where(active, x0_p, -torch.inf)
            high = conf[0] > threshold
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if int(high.sum()) >= k:
                transfer[0] = high
            else:
                transfer[0, torch.topk(conf[0], k=min(k, int(active.sum()))).indices] = True
            cur[:, -block_length:][transfer] = x0[transfer]
            if eos_early_stop and (x0[transfer] == eos_id).any():
                # upstream searches the whole sequence (prompt included); our prompts hold no EOS
                eos_pos = (cur[0] == eos_id).nonzero()
                if len(eos_pos) and (cur[0, p : int(eos_pos[0, 0])] != mask_id).all():
                    # (upstream returns all of it even past gen_length, in the last block: cut as the answer is)
                    return cur[0, p : int(eos_pos[0, 0]) + 1].tolist()[:gen_length], forwards
        if (x[0, p:end] == eos_id).any():
            break
    return _answer(x, p, gen_length, eos_id), forwards


def llada21_generate(
    logits_fn,
    prompt,
    block_length,
    gen_length,
    threshold,
    editing_threshold,
    max_post_steps,
    num_to_transfer=1,
    eos_early_stop=False,
    eos_id=None,
    mask_id=None,
):
    p = prompt.shape[1]
    nb = (p + gen_length + block_length - 1) // block_length
    x = torch.full((1, nb * block_length), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    forwards, edits = 0, 0
    for blk in range(p // block_length, nb):
        end = (blk + 1) * block_length
        cur = x[:, :end]
        start = blk * block_length
        prompt_in_block = torch.zeros(block_length, dtype=torch.bool)
        if start < p:
            prompt_in_block[: min(p - start, block_length)] = True
        post = 0
        while True:
            old = cur[:, -block_length:].clone()
            active = cur[:, -block_length:] == mask_id
            if not active.any():
                post += 1
            if post > max_post_steps:
                break
            forwards += 1
            x0, x0_p = _greedy(logits_fn(cur)[:, -block_length:])
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if active.sum() > 0:
                conf = torch.where(active, x0_p, -torch.inf)
                high = (conf[0] > threshold) & active[0]
                if int(high.sum()) >= num_to_transfer:
                    transfer[0] = high
                else:
                    transfer[0, torch.topk(conf[0], k=min(num_to_transfer, int(active.sum()))).indices] = True
            editable = ~active & ~prompt_in_block[None, :]
            edit = (torch.where(editable, x0_p, -torch.inf) > editing_threshold) & editable & (x0 != old)
            edits += int(edit.sum())
            final = transfer | edit
            cur[:, -block_length:][final] = x0[final]
            if active.sum() == 0 and not edit.any():
                break
        if eos_early_stop:
            gen = x[0, p:end]
            if (gen == mask_id).sum() == 0 and (gen == eos_id).any():
                break
        elif (x[0, p:end] == eos_id).any():
            break  # upstream goes on with later blocks, which the answer (cut at the first EOS) never shows
    return _answer(x, p, gen_length, eos_id), forwards, edits
