"""Compact test-side transcriptions of the upstream masked-diffusion decoders: plain loops close to the originals,
full recompute (or Fast-dLLM's cached forwards through ``forward_window``), no stopping (the whole gen_length is
decoded, as upstream does). The decoders under test are independent code (``localdiff.decoding``).

* :func:`llada_generate` — ML-GSAI/LLaDA ``generate.py`` ``generate`` (temperature 0);
  :func:`llada_generate_sampled` — the same at any temperature and remasking, drawing from the global torch RNG as
  upstream (``add_gumbel_noise``, ``torch.rand``), softmax in the logits' dtype.
* :func:`fastdllm_generate` — NVlabs/Fast-dLLM ``llada/generate.py`` ``generate`` (threshold / factor),
  :func:`fastdllm_prefix_cache` / :func:`fastdllm_dual_cache` — its ``generate_with_prefix_cache`` /
  ``generate_with_dual_cache`` with the model's past_key_values expressed through ``forward_window``; with
  ``temperature`` > 0 or ``remasking="random"`` they use :func:`get_transfer_index_sampled` (upstream's
  ``get_transfer_index``, global RNG; the prefix cache's extra unused ``add_gumbel_noise`` call kept).
* :func:`dream_generate` — HKUNLP/Dream ``generation_utils.py`` ``_sample`` (one block, shifted logits).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num[i, : remainder[i]] += 1
    return num


def _canvas(prompt, gen_length, mask_id):
    """The prompt followed by ``gen_length`` mask ids: LongTensor [B, P + gen_length]."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt.clone()
    return x


def llada_generate(
    model, prompt, steps, gen_length, block_length, cfg_scale=0.0, remasking="low_confidence", mask_id=36
):
    """LLaDA ``generate`` at temperature 0 (Gumbel noise^0 = 1: argmax of exp(logits64)); ``model(x)`` → logits."""
    x = _canvas(prompt, gen_length, mask_id)
    prompt_index = x != mask_id
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        lo = prompt.shape[1] + num_block * block_length
        block_mask_index = x[:, lo : lo + block_length] == mask_id
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = x == mask_id
            if cfg_scale > 0.0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                logits = model(torch.cat([x, un_x], dim=0))
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)
            x0 = torch.argmax(logits.to(torch.float64).exp(), dim=-1)
            if remasking == "low_confidence":
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, lo + block_length :] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


def add_gumbel_noise(logits, temperature):
    """Upstream's, on the global RNG: exp(logits64) / (−log u)^T, u ~ U[0, 1) float64 of the logits' shape."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def llada_generate_sampled(
    model, prompt, steps, gen_length, block_length, temperature, remasking="low_confidence", cfg_scale=0.0, mask_id=36
):
    """LLaDA ``generate`` as written (global RNG; ``low_confidence``'s softmax in the logits' dtype)."""
    x = _canvas(prompt, gen_length, mask_id)
    prompt_index = x != mask_id
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        lo = prompt.shape[1] + num_block * block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, lo : lo + block_length] == mask_id, steps)
        for i in range(steps):
            mask_index = x == mask_id
            if cfg_scale > 0.0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                logits, un_logits = torch.chunk(model(torch.cat([x, un_x], dim=0)), 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)
            logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            elif remasking == "random":
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
            else:
                raise NotImplementedError(remasking)
            x0_p[:, lo + block_length :] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


def get_transfer_index_sampled(logits, temperature, remasking, mask_index, x, num_transfer_tokens, threshold=None):
    """Fast-dLLM ``get_transfer_index`` as written (global RNG)."""
    logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
    x0 = torch.argmax(logits_with_noise, dim=-1)
    if remasking == "low_confidence":
        p = F.softmax(logits.to(torch.float64), dim=-1)
        x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    elif remasking == "random":
        x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
    else:
        raise NotImplementedError(remasking)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select_index[k]] < threshold:
                    transfer_index[j, select_index[k]] = False
    return x0, transfer_index


def _low_confidence(logits, mask_index, x):
    """Fast-dLLM's shared start of both transfer rules at temperature 0: the argmax x0 (kept tokens where not
    masked) and its float64 softmax probability as confidence (−inf where not masked)."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    return torch.where(mask_index, x0, x), torch.where(mask_index, x0_p, -np.inf)


def get_transfer_index(logits, mask_index, x, num_transfer_tokens, threshold=None):
    """Fast-dLLM ``get_transfer_index`` at temperature 0, low_confidence."""
    x0, confidence = _low_confidence(logits, mask_index, x)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select_index[k]] < threshold:
                    transfer_index[j, select_index[k]] = False
    return x0, transfer_index


def get_transfer_index_dynamic(logits, mask_index, x, factor):
    """Fast-dLLM ``get_transfer_index_dynamic`` at temperature 0, low_confidence."""
    x0, confidence = _low_confidence(logits, mask_index, x)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        ns = list(range(1, int(num_transfer_tokens[j]) + 1))
        threshs = [1 - factor / (n + 1) for n in ns]
        threshs[0] = -1
        sorted_conf = torch.sort(confidence[j][mask_index[j]], dim=-1, descending=True)[0]
        for top_i in range(len(threshs)):
            if sorted_conf[top_i] < threshs[top_i]:
                break
        if top_i == 0 or top_i == len(threshs) - 1:
            top_i += 1
        _, select_index = torch.topk(confidence[j], k=top_i)
        transfer_index[j, select_index] = True
    return x0, transfer_index


def _pick(logits, mask_index, x, ntt, threshold, factor, temperature=0.0, remasking="low_confidence"):
    if temperature > 0 or remasking != "low_confidence":
        assert factor is None
        return get_transfer_index_sampled(logits, temperature, remasking, mask_index, x, ntt, threshold)
    if factor is None:
        return get_transfer_index(logits, mask_index, x, ntt if threshold is None else None, threshold)
    return get_transfer_index_dynamic(logits, mask_index, x, factor)


def _blocks(x, prompt_len, steps, gen_length, block_length, mask_id):
    """Fast-dLLM's walk over the blocks: (start, end, tokens to transfer per step [B, steps per block]) of each,
    the counts taken from the block's masks when it starts."""
    num_blocks = gen_length // block_length
    for num_block in range(num_blocks):
        start = prompt_len + num_block * block_length
        yield (
            start,
            start + block_length,
            get_num_transfer_tokens(x[:, start : start + block_length] == mask_id, steps // num_blocks),
        )


def fastdllm_generate(
    model,
    prompt,
    steps,
    gen_length,
    block_length,
    mask_id=36,
    threshold=None,
    factor=None,
    temperature=0.0,
    remasking="low_confidence",
):
    """Fast-dLLM ``generate`` (no cache). Returns (x, nfe)."""
    x = _canvas(prompt, gen_length, mask_id)
    nfe = 0
    for start, end, ntt in _blocks(x, prompt.shape[1], steps, gen_length, block_length, mask_id):
        i = 0
        while True:
            nfe += 1
            mask_index = x == mask_id
            logits = model(x)
            mask_index[:, end:] = 0
            x0, transfer_index = _pick(
                logits,
                mask_index,
                x,
                ntt[:, i] if threshold is None and factor is None else None,
                threshold,
                factor,
                temperature,
                remasking,
            )
            x[transfer_index] = x0[transfer_index]
            i += 1
            if (x[:, start:end] == mask_id).sum() == 0:
                break
    return x, nfe


def fastdllm_prefix_cache(
    net, prompt, steps, gen_length, block_length, mask_id=36, threshold=None, factor=None, **sampling
):
    """Fast-dLLM ``generate_with_prefix_cache``; past_key_values[:, :, :start] → ``forward_window``'s kv."""
    return _fastdllm_cached(
        net, prompt, steps, gen_length, block_length, mask_id, threshold, factor, dual=False, **sampling
    )


def fastdllm_dual_cache(
    net, prompt, steps, gen_length, block_length, mask_id=36, threshold=None, factor=None, **sampling
):
    """Fast-dLLM ``generate_with_dual_cache``; replace_position = the block window of ``forward_window``."""
    return _fastdllm_cached(
        net, prompt, steps, gen_length, block_length, mask_id, threshold, factor, dual=True, **sampling
    )


def _fastdllm_cached(
    net,
    prompt,
    steps,
    gen_length,
    block_length,
    mask_id,
    threshold,
    factor,
    dual,
    temperature=0.0,
    remasking="low_confidence",
):
    """The two cached loops: per block one full forward that also returns the K/V, then forwards of the window —
    the block and everything after it over the prefix's K/V (prefix cache), or the block alone over the whole
    sequence's K/V (dual cache). Returns (x, nfe)."""
    x = _canvas(prompt, gen_length, mask_id)
    nfe = 0
    for start, end, ntt in _blocks(x, prompt.shape[1], steps, gen_length, block_length, mask_id):
        stop = end if dual else x.shape[1]
        logits, past_key_values = net.forward_window(x, 0, None, None, return_kv=True)
        mask_index = x == mask_id
        mask_index[:, end:] = 0
        x0, transfer_index = _pick(logits, mask_index, x, ntt[:, 0], threshold, factor, temperature, remasking)
        x[transfer_index] = x0[transfer_index]
        if not dual:
            past_key_values = [tuple(t[:, :, :start] for t in layer) for layer in past_key_values]
        nfe += 1
        i = 1
        while True:
            if (x[:, start:end] == mask_id).sum() == 0:
                break
            nfe += 1
            mask_index = x[:, start:stop] == mask_id
            mask_index[:, block_length:] = 0
            logits = net.forward_window(x[:, start:stop], start, past_key_values)
            if not dual:  # generate_with_prefix_cache's unused noise
                add_gumbel_noise(logits, temperature=temperature)
            x0, transfer_index = _pick(
                logits,
                mask_index,
                x[:, start:stop],
                ntt[:, i] if i < ntt.shape[1] else None,
                threshold,
                factor,
                temperature,
                remasking,
            )
            x[:, start:stop][transfer_index] = x0[transfer_index]
            i += 1
    return x, nfe


def dream_generate(
    model, input_ids, steps, max_new_tokens, mask_token_id=36, eps=1e-3, alg="entropy", alg_temp=None, generator=None
):
    """Dream ``_sample`` at temperature 0 (``origin`` draws its reveal coin from ``generator``)."""
    x = F.pad(input_ids, (0, max_new_tokens), value=mask_token_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_token_id
        logits = model(x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t = timesteps[i]
        s = timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + mask_token_id
            transfer_index_t_s = torch.rand(*x0.shape, generator=generator) < p_transfer
            x0[transfer_index_t_s] = torch.softmax(mask_logits[transfer_index_t_s], -1).max(-1)[1]
            x[mask_index] = x0.clone()
        else:
            probs = torch.softmax(mask_logits, dim=-1)
            confidence, x0 = probs.max(dim=-1)
            if alg == "topk_margin":
                sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
                confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
            elif alg == "entropy":
                confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
            full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            if number_transfer_tokens > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
                else:
                    full_confidence = F.softmax(full_confidence / alg_temp, dim=-1)
                    transfer_index = torch.multinomial(
                        full_confidence, num_samples=number_transfer_tokens, generator=generator
                    )
                x_ = torch.zeros_like(x, dtype=torch.long) + mask_token_id
                x_[mask_index] = x0.clone()
                row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    return x
