"""Test-side transcription of LLaDA's ``generate`` with ``logits_eos_inf`` / ``confidence_eos_eot_inf``, close to the
original: ML-GSAI/LLaDA ``generate.py`` at b7e6c3565f194352da44b38dd12b6970597309f3, temperature 0,
``low_confidence`` remasking, no classifier-free guidance, no attention mask. Upstream hard-codes LLaDA-8B's ids
(EOS 126081, EoT 126348); here they are arguments. ``model(x)`` → FloatTensor[B, T, V] (the tests' fake model, whose
mask token's logit is −inf as localdiff's loop has it). The decoder under test is independent code
(``localdiff.decoding.llada``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from upstream_masked import get_num_transfer_tokens


def add_gumbel_noise(logits, temperature):
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def generate(
    model,
    prompt,
    steps,
    gen_length,
    block_length,
    mask_id,
    eos_id,
    eot_id,
    logits_eos_inf=False,
    confidence_eos_eot_inf=False,
):
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt.clone()
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_mask_index = (
            x[:, prompt.shape[1] + num_block * block_length : prompt.shape[1] + (num_block + 1) * block_length :]
            == mask_id
        )
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = x == mask_id
            logits = model(x)
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf
            logits_with_noise = add_gumbel_noise(logits, temperature=0.0)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if confidence_eos_eot_inf:
                logits_with_noise[:, :, eos_id] = logits[:, :, eot_id] = -torch.inf
            p = F.softmax(logits, dim=-1)
            x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length :] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x
