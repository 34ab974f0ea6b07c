"""Compact test-side transcription of upstream SDAR ``block_diffusion_generate`` (JetAstra/SDAR ``generate.py``),
batch 1: at temperature 0 the top token with its softmax probability as the confidence (upstream always samples);
at temperature > 0 upstream's ``sample_with_temperature_topk_topp`` (``torch.multinomial`` on the global RNG over
the block's [block, vocab] probabilities, every step).

The K/V cache of upstream (prefill of the prompt's whole blocks, ``store_kv`` of each finished block) is replaced by
the same math without a cache: each denoising forward runs ``logits_fn`` over everything up to the current block
under the block-causal mask and keeps the block's rows. Everything else is upstream's step logic, including its
``topk`` over the whole block with ``-inf`` at non-masked positions (which can overwrite prompt tokens when the
step quota exceeds the masks left).

``entropy_bounded`` (upstream commit 1c06c39) is transcribed with its two slips mended, as localdiff/decoding/sdar.py
states: ``transfer_index`` is created (upstream's branch never does: UnboundLocalError), and the entropy is each
position's over the vocabulary, from ``probs`` (upstream takes it of ``x0_p``, [batch, block], summed over the
block). Upstream's ``torch.sort`` is made stable (ties: the earlier position)."""

from __future__ import annotations

import torch


def top_k_logits(logits, k):
    if k <= 0:
        return logits
    values, _ = torch.topk(logits, k)
    return torch.where(logits < values[..., -1, None], torch.full_like(logits, float("-inf")), logits)


def top_p_logits(logits, p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_mask = cumulative_probs > p
    sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
    sorted_mask[..., 0] = False
    mask_indices = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, sorted_indices, sorted_mask)
    return logits.masked_fill(mask_indices, float("-inf"))


def sample(logits, temperature, top_k, top_p):
    """(tokens [1, B], their probabilities [1, B], the sampling distribution [1, B, V]): upstream's
    ``sample_with_temperature_topk_topp`` (which returns the first two) on the global RNG."""
    shape, v = logits.shape[:-1], logits.shape[-1]
    logits = logits.reshape(-1, v)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        logits = top_k_logits(logits, top_k)
    if top_p < 1.0:
        logits = top_p_logits(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1)
    return token.view(*shape), torch.gather(probs, -1, token).view(*shape), probs.view(*shape, v)


def get_num_transfer_tokens(block_length, steps):
    base, remainder = block_length // steps, block_length % steps
    n = torch.zeros(steps, dtype=torch.int64) + base
    n[:remainder] += 1
    return n


def sdar_generate(
    logits_fn,
    prompt: torch.Tensor,
    mask_id: int,
    gen_length: int,
    block_length: int,
    denoising_steps: int,
    remasking_strategy: str = "low_confidence_dynamic",
    confidence_threshold: float = 0.85,
    stopping_criteria_idx=None,
    eb_threshold: float | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """``logits_fn(ids [1, T]) -> logits [1, T, V]`` (block-causal, uncached); returns x [1, num_blocks·B]."""
    p = prompt.shape[1]
    num_blocks = (p + gen_length + block_length - 1) // block_length
    x = torch.full((1, num_blocks * block_length), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    prefill_blocks = p // block_length
    ntt = get_num_transfer_tokens(block_length, denoising_steps)
    for nb in range(prefill_blocks, num_blocks):
        lo, hi = nb * block_length, (nb + 1) * block_length
        cur_x = x[:, lo:hi].clone()
        for step in range(denoising_steps + 1):
            mask_index = cur_x == mask_id
            if mask_index.sum() == 0:
                break
            ctx = torch.cat([x[:, :lo], cur_x], 1)
            logits = logits_fn(ctx)[:, lo:hi]
            if temperature > 0:
                x0, x0_p, probs = sample(logits.float(), temperature, top_k, top_p)
            else:
                probs = torch.softmax(logits.float(), dim=-1)
                x0_p, x0 = probs.max(-1)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if remasking_strategy == "sequential":
                first = int(mask_index[0].nonzero()[0].min())
                transfer[0, first : first + int(ntt[step])] = True
            elif remasking_strategy == "low_confidence_static":
                _, idx = torch.topk(confidence[0], int(ntt[step]))
                transfer[0, idx] = True
            elif remasking_strategy == "low_confidence_dynamic":
                high = confidence[0] > confidence_threshold
                if high.sum() >= ntt[step]:
                    transfer[0] = high
                else:
                    _, idx = torch.topk(confidence[0], int(ntt[step]))
                    transfer[0, idx] = True
            elif remasking_strategy == "entropy_bounded":
                eps = 1e-12
                ent = -(probs.clamp_min(eps) * probs.clamp_min(eps).log()).sum(dim=-1)
                ent = torch.where(mask_index, ent, torch.inf)
                ent_sorted, order = torch.sort(ent, dim=1, descending=False, stable=True)
                cumsum = torch.cumsum(ent_sorted, dim=1)
                k = torch.searchsorted(cumsum[0], torch.tensor(eb_threshold), right=False).item()
                k = max(1, min(k, int(mask_index[0].sum().item())))
                transfer[0, order[0, :k]] = True
            else:
                raise ValueError(remasking_strategy)
            cur_x[transfer] = x0[transfer]
        x[:, lo:hi] = cur_x
        if stopping_criteria_idx is not None and any(s in x[:, p:] for s in stopping_criteria_idx):
            break
    return x
