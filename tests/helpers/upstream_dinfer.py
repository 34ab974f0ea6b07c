"""Test-side transcriptions of dInfer's decoders and its vicinity cache refresh, close to the originals
(inclusionAI/dInfer at commit fce4e32804103baa5d55230dff0352da0cdd6ceb):

* ``python/dinfer/decoding/parallel_strategy.py``: ``get_transfer_index_threshold``, ``ThresholdParallelDecoder``,
  ``CreditThresholdParallelDecoder``, ``HierarchyDecoder``;
* ``python/dinfer/decoding/utils.py``: ``add_gumbel_noise``, ``TokenArray``, ``BlockIterator``,
  ``DiffusionKVCacheManager``;
* ``python/dinfer/decoding/generate_uniform.py``: ``BlockRunner.decode``, ``BaseDiffusionIteration.forward``,
  ``VicinityCacheIteration.forward``, ``BlockWiseDiffusionLLM.generate`` / ``VicinityCacheDiffusionLLM``.

The model is the contract-exact fake (``fake_masked.FakeMaskedNet``) behind dInfer's call shapes (:class:`DInferModel`):
``model(x)``, ``model(x, use_cache=True)`` (→ past_key_values) and ``model(window, past_key_values=...,
replace_position=(start, end))`` (the window's fresh K/V replace [start, end) of the cached ones), with the mask
token's logit at −inf as localdiff's loop has it. ``torch.compile`` decorators are dropped. The decoders under test
are independent code (``localdiff.decoding``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F


def add_gumbel_noise(logits, temperature):
    if math.isclose(temperature, 0.0):
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


# ------------------------------------------------------------------------------------------------ parallel_strategy
def get_transfer_index_threshold(
    logits, temperature, mask_index, x, mask_id, threshold, rm_mask=True, use_float64=False, **kwargs
):
    logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
    x0 = torch.argmax(logits_with_noise, dim=-1)
    if use_float64:
        p = F.softmax(logits.to(torch.float64), dim=-1)
    else:
        p = F.softmax(logits.to(torch.float32), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    if rm_mask:
        mask_index = mask_index & (x0 != mask_id)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    actual_threshold = (torch.max(confidence, dim=1)[0] - 1e-5).clamp(-1000, threshold).unsqueeze(-1)
    transfer_index = confidence >= actual_threshold
    return x0, transfer_index


class ThresholdParallelDecoder:
    def __init__(
        self, temperature, threshold, remasking="low_confidence", mask_id=126336, eos_id=126081, use_float64=False
    ):
        self.temperature, self.remasking, self.mask_id = temperature, remasking, mask_id
        self.threshold, self.eos_id, self.use_float64 = threshold, eos_id, use_float64

    def block_init(self, block_x, block_id):
        pass

    def decode(self, logits, block_start, block_end, x, iter_threshold=None):
        if iter_threshold is None:
            iter_threshold = self.threshold
        mask_index = x[:, block_start:block_end] == self.mask_id
        assert mask_index.shape[1] == logits.shape[1]
        curr_x = x[:, block_start:block_end]
        x0, transfer_index = get_transfer_index_threshold(
            logits,
            self.temperature,
            mask_index,
            curr_x,
            self.mask_id,
            threshold=iter_threshold,
            use_float64=self.use_float64,
        )
        transfer_index = torch.logical_and(transfer_index, mask_index)
        x[:, block_start:block_end] = torch.where(transfer_index, x0, curr_x)


class CreditThresholdParallelDecoder(ThresholdParallelDecoder):
    def __init__(self, credit_alpha=0.7, boost_gamma=0.2, decay_beta=0.8, **kwargs):
        super().__init__(**kwargs)
        self.credit_alpha, self.boost_gamma, self.decay_beta = credit_alpha, boost_gamma, decay_beta
        self._credit_mats = {}
        self._credit_iters = {}

    def _apply_credit_fusion(self, logits, mask_index, key):
        B, L, V = logits.shape
        device = logits.device
        mat = self._credit_mats.get(key, None)
        if mat is None or mat.shape != (B, L, V) or mat.device != device:
            mat = torch.zeros((B, L, V), dtype=torch.float32, device=device)
            self._credit_mats[key] = mat
            self._credit_iters[key] = 0
        iter_idx = self._credit_iters[key]
        if iter_idx > 0:
            mat.mul_(self.decay_beta)
        probs = F.softmax(logits.to(torch.float32), dim=-1)
        top1_probs, top1_idx = torch.max(probs, dim=-1)
        enhanced = top1_probs.pow(self.boost_gamma).to(mat.dtype)
        update_vals = enhanced * mask_index.to(enhanced.dtype)
        mat.scatter_add_(2, top1_idx.unsqueeze(-1), update_vals.unsqueeze(-1))
        fused_logits = logits + self.credit_alpha * torch.log(mat + 1)
        self._credit_iters[key] = iter_idx + 1
        return fused_logits

    def decode(self, logits, block_start, block_end, x, iter_threshold=None):
        if iter_threshold is None:
            iter_threshold = self.threshold
        mask_index = x[:, block_start:block_end] == self.mask_id
        curr_x = x[:, block_start:block_end]
        key = (block_start, block_end)
        used_logits = self._apply_credit_fusion(logits, mask_index, key)
        x0, transfer_index = get_transfer_index_threshold(
            used_logits,
            self.temperature,
            mask_index,
            curr_x,
            self.mask_id,
            threshold=iter_threshold,
            use_float64=self.use_float64,
        )
        transfer_index = torch.logical_and(transfer_index, mask_index)
        x[:, block_start:block_end] = torch.where(transfer_index, x0, curr_x)
        if not (x.data == self.mask_id).any():
            self._credit_mats.clear()
            self._credit_iters.clear()


class HierarchyDecoder:
    def __init__(
        self, temperature, remasking="low_confidence", mask_id=126336, eos_id=126081, threshold=None, low_threshold=0.4
    ):
        self.temperature, self.remasking, self.mask_id, self.eos_id = temperature, remasking, mask_id, eos_id
        self.iter = 0
        self.threshold, self.low_threshold = threshold, low_threshold

    def get_transfer_index(self, logits, mask_index, iter_threshold, **kwargs):
        B, L = mask_index.shape
        assert B == 1
        device = logits.device
        if not math.isclose(self.temperature, 0.0):
            logits_with_noise = add_gumbel_noise(logits, temperature=self.temperature)
        else:
            logits_with_noise = logits
        x0 = torch.argmax(logits_with_noise, dim=-1)
        x0_logp = F.log_softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
        x0_p = x0_logp.exp()
        neg_inf_val = torch.finfo(x0_p.dtype).min
        confidence = torch.where(mask_index, x0_p, torch.tensor(neg_inf_val, device=device, dtype=x0_p.dtype))
        prev = torch.cat([mask_index.new_zeros((B, 1), dtype=torch.bool), mask_index[:, :-1]], dim=1)
        starts = torch.logical_and(mask_index, torch.logical_not(prev))
        seg_id = torch.cumsum(starts.to(torch.int64), dim=-1) - 1
        seg_id = torch.where(mask_index, seg_id, 0)
        seg_max = torch.full((B, L), neg_inf_val, device=device, dtype=confidence.dtype)
        seg_max = torch.scatter_reduce(seg_max, dim=1, index=seg_id, src=confidence, reduce="amax", include_self=True)
        seg_max_at_pos = seg_max.gather(dim=1, index=seg_id)
        transfer_index = confidence == seg_max_at_pos
        if self.low_threshold is not None:
            transfer_index = torch.logical_and(transfer_index, torch.gt(confidence, self.low_threshold))
        if iter_threshold is not None:
            transfer_index = torch.logical_or(transfer_index, torch.gt(confidence, iter_threshold))
        top1_idx = torch.argmax(confidence, dim=-1)
        top1 = torch.nn.functional.one_hot(top1_idx, num_classes=L).to(torch.bool)
        transfer_index = torch.logical_or(transfer_index, top1)
        return x0, transfer_index

    def block_init(self, block_x, block_id):
        self.iter = 0

    def decode(self, logits, block_start, block_end, x, iter_threshold=None):
        if iter_threshold is None:
            iter_threshold = self.threshold
        mask_index = x[:, block_start:block_end] == self.mask_id
        x0, transfer_index = self.get_transfer_index(logits, mask_index, iter_threshold)
        self.iter += 1
        transfer_index = torch.logical_and(transfer_index, mask_index)
        x[:, block_start:block_end][transfer_index] = x0[transfer_index]


# ------------------------------------------------------------------------------------------------ utils
class TokenArray:
    def __init__(self, prompt, gen_length, mask_id, eos_id, device="cpu"):
        self.prompt = prompt.to(device)
        self.data = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
        self.data[:, : prompt.shape[1]] = prompt.clone()
        self.gen_length, self.eos_id, self.mask_id = gen_length, eos_id, mask_id

    @property
    def total_length(self):
        return self.prompt.shape[1] + self.gen_length

    @property
    def batch_size(self):
        return self.prompt.shape[0]

    def __getitem__(self, idx):
        return self.data[idx]

    def __setitem__(self, idx, vals):
        self.data[idx] = vals


def block_iterator(x, block_length, start_block_align=False):
    """``BlockIterator``: (BlockLoc, block view) per block."""
    if start_block_align:
        non_mask_number = (x.prompt != x.mask_id).sum(dim=-1).min().item()
        first = (non_mask_number // block_length) * block_length
    else:
        first = x.prompt.shape[1]
    it = 0
    while True:
        start = first + it * block_length
        if start >= x.total_length:
            return
        end = min(start + block_length, x.total_length)
        it += 1
        yield SimpleNamespace(start=start, end=end), x[:, start:end]


class DiffusionKVCacheManager:
    """``utils.DiffusionKVCacheManager`` (cache_update_freq None; the K/V kept as the model returned them)."""

    def __init__(self, cache_update_freq=None, cache_type="prefix"):
        self.past_key_values = None
        self.block_start = self.block_end = None
        self.cache_update_freq, self.cache_type = cache_update_freq, cache_type

    def require_update(self, iter_no, block_start, block_end):
        if self.cache_update_freq is None:
            _require_update = self.block_start != block_start or self.block_end != block_end
        else:
            _require_update = iter_no % self.cache_update_freq == 0 or (
                self.block_start != block_start or self.block_end != block_end
            )
        self.block_start, self.block_end = block_start, block_end
        return _require_update

    def update(self, past_key_values, range_start=None, range_end=None):
        self.past_key_values = past_key_values

    def get_key_values(self, block_start, block_end):
        assert self.past_key_values is not None
        if self.cache_type == "prefix":
            replace_position = (int(block_start), int(self.past_key_values[0][0].shape[2]))
        else:
            replace_position = (int(block_start), int(block_end))
        return self.past_key_values, replace_position


class DInferModel:
    """dInfer's model calls on a localdiff ``forward_window`` net. ``windows``: (start, length, cached) of every
    forward run while the current block still had masks (``block`` is set by the loop; dInfer's other forwards —
    a window pass after a refresh that finished the block, unrolled passes on a finished block — change nothing),
    ``stored``: the past_key_values of every such full pass with use_cache."""

    def __init__(self, net, mask_id):
        self.net, self.mask_id = net, mask_id
        self.windows, self.stored, self.block = [], [], None

    def __call__(self, ids, past_key_values=None, use_cache=False, replace_position=None):
        start = 0 if past_key_values is None else replace_position[0]
        useful = self.block is not None and bool((self.block() == self.mask_id).any())
        if useful:
            self.windows.append((start, ids.shape[1], past_key_values is not None))
        if past_key_values is None:
            logits, kv = self.net.forward_window(ids, 0, None, None, return_kv=True)
            if use_cache and useful:
                self.stored.append(kv)
        else:
            logits, kv = self.net.forward_window(ids, start, past_key_values), None
        logits = logits.clone()
        logits[..., self.mask_id] = -torch.inf
        return SimpleNamespace(logits=logits, past_key_values=kv)


# ------------------------------------------------------------------------------------------------ generate_uniform
class BaseDiffusionIteration:
    def __init__(self):
        self.num_forwards = self.cache_updates = self.iter_no = 0

    def forward(self, model, decoder, x, kv_cache, block, block_loc, block_id):
        if kv_cache is not None and kv_cache.require_update(self.iter_no, block_loc.start, block_loc.end):
            output = model(x.data, use_cache=True)
            self.num_forwards += 1
            decoder.decode(output.logits[:, block_loc.start : block_loc.end], block_loc.start, block_loc.end, x)
            kv_cache.update(output.past_key_values)
            self.cache_updates += 1
        if kv_cache is None:
            logits = model(x.data).logits[:, block_loc.start : block_loc.end]
        elif kv_cache.cache_type == "prefix":
            past_key_values, replace_position = kv_cache.get_key_values(block_loc.start, block_loc.end)
            logits = model(
                x[:, block_loc.start :],
                past_key_values=past_key_values,
                use_cache=True,
                replace_position=replace_position,
            ).logits
            logits = logits[:, : block_loc.end - block_loc.start]
        else:
            past_key_values, replace_position = kv_cache.get_key_values(block_loc.start, block_loc.end)
            logits = model(
                block, past_key_values=past_key_values, use_cache=True, replace_position=replace_position
            ).logits
        decoder.decode(logits, block_loc.start, block_loc.end, x)
        self.num_forwards += 1
        self.iter_no += 1


class VicinityCacheIteration:
    def __init__(self, prefix_look, after_look, warmup_steps):
        self.prefix_look, self.after_look, self.warmup_steps = int(prefix_look), int(after_look), int(warmup_steps)
        self.num_forwards = self.cache_updates = self.iter_no = 0

    def forward(self, model, decoder, x, kv_cache, block, block_loc, block_id):
        total_len = x.total_length
        block_start, block_end = block_loc.start, block_loc.end
        left_start = max(0, block_start - self.prefix_look)
        right_end = min(total_len, block_end + self.after_look)
        if self.iter_no < self.warmup_steps:
            out_full = model(x.data)
            self.num_forwards += 1
            decoder.decode(out_full.logits[:, block_start:block_end], block_start, block_end, x)
            self.iter_no += 1
            return
        if kv_cache.past_key_values is None or (
            kv_cache.require_update(self.iter_no, block_start, block_end) and block_id > 0
        ):
            out_full = model(x.data, use_cache=True)
            self.num_forwards += 1
            decoder.decode(out_full.logits[:, block_start:block_end], block_start, block_end, x)
            kv_cache.update(out_full.past_key_values)
            self.cache_updates += 1
            self.iter_no += 1
        window_input = x.data[:, left_start:right_end]
        past_key_values, replace_position = kv_cache.get_key_values(left_start, right_end)
        out_step = model(
            window_input, past_key_values=past_key_values, use_cache=True, replace_position=replace_position
        )
        self.num_forwards += 1
        offset = block_start - left_start
        logits_block = out_step.logits[:, offset : offset + (block_end - block_start)]
        decoder.decode(logits_block, block_start, block_end, x)
        self.iter_no += 1


def block_runner_decode(
    diff_iteration,
    model,
    decoder,
    x,
    kv_cache,
    block,
    block_loc,
    block_id,
    early_stop=True,
    maximum_unroll=4,
    expected_tpf=8,
):
    """``BlockRunner.decode`` (select_undecoded is the identity in dInfer's version)."""
    while (block == decoder.mask_id).sum() > 0:
        unroll_k = int(max(min((block == decoder.mask_id).sum() // expected_tpf, maximum_unroll), 1))
        for unroll_i in range(unroll_k):
            diff_iteration.forward(model, decoder, x, kv_cache, block, block_loc, block_id)
    eos_idx = torch.any(x[:, block_loc.start : block_loc.end] == decoder.eos_id, dim=1)
    if early_stop:
        x[eos_idx, block_loc.end :] = decoder.eos_id
    return eos_idx


def generate(
    model,
    decoder,
    prompt,
    gen_length,
    block_length,
    cache=None,
    vicinity=None,
    start_block_align=True,
    maximum_unroll=4,
    expected_tpf=8,
):
    """``BlockWiseDiffusionLLM.generate`` (``vicinity`` = (prefix_look, after_look, warmup_steps):
    ``VicinityCacheDiffusionLLM``; ``cache`` None / "prefix" / "dual" as ``KVCacheFactory``). Returns the token
    array's data LongTensor[B, P + gen_length] (EOS kept) and the iteration object (``num_forwards``)."""
    x = TokenArray(prompt, gen_length, decoder.mask_id, decoder.eos_id)
    it = block_iterator(x, block_length, start_block_align)
    diff_iteration = BaseDiffusionIteration() if vicinity is None else VicinityCacheIteration(*vicinity)
    kv_cache = DiffusionKVCacheManager(cache_type=cache) if cache is not None else None
    for block_id, (block_loc, block) in enumerate(it):
        model.block = lambda b=block_loc: x[:, b.start : b.end]
        decoder.block_init(block, block_id)
        decode_compl = block_runner_decode(
            diff_iteration,
            model,
            decoder,
            x,
            kv_cache,
            block,
            block_loc,
            block_id,
            maximum_unroll=maximum_unroll,
            expected_tpf=expected_tpf,
        )
        if torch.all(decode_compl):
            break
    return x.data, diff_iteration
