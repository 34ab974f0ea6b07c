"""Test-side transcription of dInfer's block-diffusion pipeline, the one its ``init_generator`` builds for LLaDA2
(``use_bd``): inclusionAI/dInfer ``python/dinfer/decoding/generate_uniform.py`` ``BlockDiffusionLLM.generate``,
``BlockDiffusionRunner.decode`` and ``BlockDiffusionIteration.forward``, with ``utils.BlockDiffusionIterator``, at
commit fce4e32804103baa5d55230dff0352da0cdd6ceb; batch 1. The decoders are ``upstream_dinfer``'s transcriptions of
``parallel_strategy.py``.

The model call is ``BlockDiffusionIteration.forward``'s uncached one (``model(x[:, :end])`` under the block-causal
mask, the block's logits): dInfer runs LLaDA2 with its prefix / dual K/V cache, which for a block-diffusion model is
exact (the block attends to the finished blocks' K/V and to itself), so the logits are these. ``logits_fn(x)`` →
FloatTensor[1, T, V] plays that call (the tests' never predicts the mask token, as localdiff's decoders).
``forwards`` counts the passes over a block that still had masks (dInfer's loop unrolls at least two passes
between its mask checks and adds one K/V update pass per block; those change no token).
"""

from __future__ import annotations

import torch


def bd_generate(
    logits_fn, decoder, prompt, gen_length, block_length, early_stop=True, maximum_unroll=4, expected_tpf=4
):
    """dInfer's ``BlockDiffusionLLM.generate`` (as ``init_generator`` builds it: maximum_unroll 4, expected_tpf 4).
    Returns (the answer's ids up to and including its first EOS, at most ``gen_length``; forwards)."""
    mask_id, eos_id = decoder.mask_id, decoder.eos_id
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    x = torch.full((1, total_length), mask_id, dtype=torch.long)  # TokenArray(prompt, new_gen_length)
    x[:, :prompt_length] = prompt
    non_mask_number = (prompt != mask_id).sum(dim=-1).min().item()  # BlockDiffusionIterator
    first_block_start = (non_mask_number // block_length) * block_length
    forwards = 0
    it = 0
    while True:
        start = first_block_start + it * block_length
        if start >= total_length:
            break
        end = min(start + block_length, total_length)
        decoder.block_init(x[:, start:end], it)
        it += 1
        block = x[:, start:end]
        while (block == mask_id).sum() > 0:  # BlockDiffusionRunner.decode
            unroll_k = int(max(min((block == mask_id).sum() // expected_tpf, maximum_unroll), 2))
            for _ in range(unroll_k):
                forwards += int((block == mask_id).any())
                logits = logits_fn(x[:, :end])[:, start:end]  # BlockDiffusionIteration.forward
                decoder.decode(logits, start, end, x)
        eos_idx = torch.any(x[:, start:end] == eos_id, dim=1)
        if early_stop:
            x[eos_idx, end:] = eos_id
        if torch.all(eos_idx) and early_stop:
            break
    gen = x[0, prompt_length : prompt_length + gen_length]
    hits = (gen == eos_id).nonzero()
    return gen[: int(hits[0, 0]) + 1 if len(hits) else gen_length].tolist(), forwards
