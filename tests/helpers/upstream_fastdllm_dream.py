"""Test-side transcription of Fast-dLLM v1's Dream block loop, close to the original: NVlabs/Fast-dLLM
``dream/model/generation_utils_block.py`` ``DreamGenerationMixin._sample`` (and ``sample_tokens``) at commit
4e9aeecc4c87fe0c0c9b1e206bd1a6abddf7176e, batch 1, no attention mask, temperature 0 (``sample_tokens`` with
temperature 0 is the softmax's max; top_p / top_k filters never drop the top token).

The model is the contract-exact fake (``fake_masked.FakeMaskedNet``, shifted logits) behind upstream's call shapes:
``self(x, use_cache=True)`` → ``forward_window(x, 0, None, return_kv=True)``; the prefix cache's
``self(x[:, start:], past_key_values=kv[:start])`` → ``forward_window(x[:, start:], start, kv cut at start)``; the dual
cache's ``self(x[:, start:end], past_key_values=kv, replace_position=block)`` → ``forward_window(x[:, start:end],
start, kv)`` (the fake puts the window's fresh K/V between the cached ones before and after it, as upstream's
in-place replace does). The mask token's logit is −inf, as localdiff's loop has it. The decoder under test is
independent code (``localdiff.decoding.dream``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_tokens(logits, neg_entropy=False):
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    if neg_entropy:
        epsilon = 1e-10
        log_probs = torch.log(probs + epsilon)
        confidence = torch.sum(probs * log_probs, dim=-1)
    return confidence, x0


def _model(net, mask_id):
    """upstream ``self(...)``: (logits, past_key_values) with the mask token's logit at −inf."""

    def call(x, start=0, past_key_values=None, use_cache=False):
        out = net.forward_window(x, start, past_key_values, None, return_kv=use_cache and past_key_values is None)
        logits, kv = out if isinstance(out, tuple) else (out, past_key_values)
        logits = logits.clone()
        logits[..., mask_id] = -torch.inf
        return logits, kv

    return call


def fastdllm_dream_generate(
    net,
    input_ids,
    steps,
    gen_length,
    block_length,
    mask_token_id=36,
    eps=1e-3,
    threshold=None,
    dual_cache=False,
    alg_temp=None,
    generator=None,
):
    """``_sample`` with ``alg="confidence_threshold"`` when ``threshold`` is given, else any other alg (upstream
    then ranks by negative entropy). ``generator``: the ``alg_temp`` draw's (upstream: the global one).
    Returns (x LongTensor[1, P + gen_length], forwards)."""
    model = _model(net, mask_token_id)
    alg = "confidence_threshold" if threshold is not None else "entropy"
    max_length = input_ids.shape[1] + gen_length
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=mask_token_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)
    nfe = 0
    for num_block in range(num_blocks):
        current_block_start = input_ids.shape[1] + num_block * block_length
        current_block_end = current_block_start + block_length
        logits, past_key_values = model(x, use_cache=True)
        nfe += 1
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        confidence, x0 = sample_tokens(logits)
        x[:, current_block_start] = x0[:, current_block_start]
        if not dual_cache:
            past_key_values = [tuple(t[:, :, :current_block_start] for t in layer) for layer in past_key_values]
        i = 1
        while True:
            if dual_cache:
                mask_index = x[:, current_block_start:current_block_end] == mask_token_id
                window = x[:, current_block_start:current_block_end]
            else:
                mask_index = x[:, current_block_start:] == mask_token_id
                window = x[:, current_block_start:]
            logits, _ = model(window, current_block_start, past_key_values, use_cache=True)
            nfe += 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            if alg == "confidence_threshold":
                mask_logits = logits[mask_index]
                confidence, x0 = sample_tokens(mask_logits)
                x_ = torch.zeros_like(window, dtype=torch.long) + mask_token_id
                full_confidence = torch.full_like(window, -torch.inf, dtype=logits.dtype)
                x_[mask_index] = x0.clone()
                full_confidence[mask_index] = confidence
                full_confidence[:, block_length:] = -torch.inf
                current_transfer_tokens = (x[:, current_block_start:current_block_end] == mask_token_id).sum()
                selected_confidence, select_index = torch.topk(full_confidence, int(current_transfer_tokens))
                transfer_index = torch.zeros_like(x_, dtype=torch.bool)
                transfer_index[0, select_index[0]] = True
                for k in range(1, int(current_transfer_tokens)):
                    if selected_confidence[0, k] < threshold:
                        transfer_index[0, select_index[0, k]] = False
                window[transfer_index] = x_[transfer_index]  # a view of x
            else:
                if i == steps_per_block:
                    break
                t = timesteps[i]
                s = timesteps[i + 1]
                mask_index[:, block_length:] = False
                mask_logits = logits[mask_index]
                confidence, x0 = sample_tokens(mask_logits, neg_entropy=True)
                num_mask_token = mask_index.sum() / mask_index.shape[0]
                number_transfer_tokens = (
                    int(num_mask_token * (1 - s / t)) if i < steps_per_block - 1 else int(num_mask_token)
                )
                full_confidence = torch.full_like(window, -torch.inf, dtype=logits.dtype)
                full_confidence[mask_index] = confidence
                full_confidence[:, block_length:] = -torch.inf
                if number_transfer_tokens > 0:
                    if alg_temp is None or alg_temp == 0:
                        _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
                    else:
                        full_confidence = full_confidence / alg_temp
                        full_confidence = F.softmax(full_confidence, dim=-1)
                        transfer_index = torch.multinomial(
                            full_confidence, num_samples=number_transfer_tokens, generator=generator
                        )
                    x_ = torch.zeros_like(window, dtype=torch.long) + mask_token_id
                    x_[mask_index] = x0.clone()
                    row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                    window[row_indices, transfer_index] = x_[row_indices, transfer_index]
                i += 1
            if (x[:, current_block_start:current_block_end] == mask_token_id).sum() == 0:
                break
    return x, nfe
