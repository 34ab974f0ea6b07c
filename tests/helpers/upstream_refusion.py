"""Compact test-side transcription of ML-GSAI/ReFusion ``generate.py`` ``generate_refusion`` (temperature 0,
batch 1), run on transformers' own Qwen3ForCausalLM with explicit position ids.

The upstream ``DiffusionDynamicCache`` operations become plain per-layer tensor lists: ``crop(n)`` = keep the first
n positions, ``batch_repeat_interleave(c)`` = repeat rows, ``batch_select_minibatch(n)`` / ``batch_select_indices``
= keep rows, ``full_update`` = concatenate; every model call gets a fresh DynamicCache built from them (so the
draft pass, ``use_cache=False`` upstream but still appending to the shared object, is discarded as the crop after
it does upstream). ``eos_row_quirk`` False applies the one fix localdiff makes (slots dropped from the EOS slot's
index, not the EOS row's); True is upstream verbatim. Returns (x in position order, per-round log, the cache after
each round as [(K, V)] per layer, the kept K/V appended each round, positions in cache order); ``CALLS[0]``
is the number of model calls it made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


CALLS = [0]  # model calls of the last generate_refusion (upstream's forwards)


def _call(model, ids, pos, kv):
    CALLS[0] += 1
    cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
    out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    new = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return out.logits, new


def _crop(kv, n):
    return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]


@torch.no_grad()
def generate_refusion(
    model,
    prompt,
    gen_length,
    mask_id,
    eos_id,
    slot_size,
    serial_num_blocks,
    slot_threshold,
    token_threshold,
    eos_row_quirk=False,
):
    CALLS[0] = 0
    prompt_len = prompt.shape[1]  # upstream: bs, prompt_len = 1, ...; batch size 1
    gen_length = gen_length + (slot_size - gen_length % slot_size) % slot_size
    gen_x = torch.full((1, gen_length), mask_id, dtype=torch.long)
    gen_pos_ids = torch.arange(prompt_len, prompt_len + gen_length)[None]
    cur_x, cur_pos = prompt.clone(), torch.arange(prompt_len)[None]
    k = slot_size
    eos_flag, block_length, pkv = False, gen_length // serial_num_blocks, None
    log, caches, appended = [], [], []
    for nb in range(serial_num_blocks):
        blocks_x = gen_x[:, nb * block_length : (nb + 1) * block_length].reshape(1, -1, k)
        blocks_pos = gen_pos_ids[:, nb * block_length : (nb + 1) * block_length].reshape(1, -1, k)
        while blocks_x.numel() > 0:
            flat_x, flat_pos = blocks_x.reshape(1, -1), blocks_pos.reshape(1, -1)
            if pkv is None:
                logits, pkv = _call(model, torch.cat([cur_x, flat_x], 1), torch.cat([cur_pos, flat_pos], 1), None)
            else:
                logits, pkv = _call(model, flat_x, flat_pos, pkv)
            gen_logits = logits[:, -flat_x.shape[1] :]
            pkv = _crop(pkv, cur_x.shape[1])
            x0 = gen_logits.argmax(-1)
            x0_blocks = x0.view(1, -1, k)
            x0_p = torch.gather(F.softmax(gen_logits, -1), -1, x0[..., None])[..., 0].view(1, -1, k)
            conf = x0_p[:, :, 0]
            top = (conf > slot_threshold)[0].nonzero(as_tuple=True)[0]
            counts = len(top)
            if counts <= 0:
                counts, top = 1, torch.topk(conf[0], k=1)[1]
            top, _ = torch.sort(top)
            chosen, cpos, cp = x0_blocks[0, top], blocks_pos[0, top], x0_p[0, top]
            # global verification
            ar_logits, vkv = _call(model, chosen.reshape(1, -1), cpos.reshape(1, -1), pkv)
            ar_logits = torch.cat([ar_logits[:, :1], ar_logits[:, :-1]], 1)
            ar_p = torch.gather(F.softmax(ar_logits, -1), -1, chosen.reshape(1, -1, 1))[..., 0].reshape(-1, k)
            cp[:, 1:] = ar_p[:, 1:]
            pm = cp > token_threshold
            pm[:, 0] = 1
            tag_blocks = torch.cumprod(pm.int(), -1)
            prefix_len = int(torch.cumprod(pm.int().reshape(1, -1), -1).sum())
            flat_chosen = chosen.reshape(1, -1)
            confident = flat_chosen[:, :prefix_len]
            remain, remove, committed = [], set(), False
            is_eos = confident[0] == eos_id
            if bool(is_eos.any()):
                first = int(torch.argmax(is_eos.int()))
                eb_pos, et_pos = first // k + 1, first - (first // k) * k
                eos_block = int(top[eb_pos - 1])
                remain += top[:eb_pos].tolist()
                eos_flag = True
                remove.update(range(eos_block, blocks_x.shape[1]))
            elif prefix_len // k > 0:
                remain += top[: prefix_len // k].tolist()
            if remain:
                remove.update(remain)
                idx = []
                for i, b in enumerate(remain):
                    ln = et_pos + 1 if bool(is_eos.any()) and i == len(remain) - 1 else k
                    idx.append(torch.arange(b * k, b * k + ln))
                idx = torch.cat(idx)
                old = cur_x.shape[1]
                cur_x = torch.cat([cur_x, x0[:, idx]], 1)
                cur_pos = torch.cat([cur_pos, flat_pos[:, idx]], 1)
                pkv = _crop(vkv, cur_x.shape[1])
                appended.append([(kk[:, :, old:], vv[:, :, old:]) for kk, vv in pkv])
                committed = True
                log.append(("verify", top.tolist(), bool(is_eos.any())))
            if committed:
                keep = torch.ones(blocks_x.shape[1], dtype=torch.bool)
                keep[list(remove)] = False
                blocks_x, blocks_pos = blocks_x[:, keep], blocks_pos[:, keep]
                caches.append(pkv)
                continue
            # parallel infill
            remove = set(top.tolist())
            spec, acc, eos_loop, first_eos_row = chosen.clone(), 0, False, None
            pkv = [(kk.repeat_interleave(counts, 0), vv.repeat_interleave(counts, 0)) for kk, vv in pkv]
            for _ in range(k):
                if not bool((tag_blocks == 0).any()):
                    break
                inp, ipos = spec[:, acc:], cpos[:, acc:]
                tags = tag_blocks[:, acc:]
                masked = torch.where(tags.bool(), inp, mask_id)
                d_logits, _ = _call(model, masked, ipos, pkv)
                inp = torch.where(tags.bool(), inp, d_logits.argmax(-1))
                spec[:, acc:] = inp
                v_logits, vkv = _call(model, inp, ipos, pkv)
                v_logits = torch.cat([v_logits[:, :1], v_logits[:, :-1]], 1)
                pm = torch.gather(F.softmax(v_logits, -1), -1, inp[..., None])[..., 0] > token_threshold
                upd = F.pad(tag_blocks[:, acc:], (1, 0), value=1)[:, :-1]
                pm[upd == 1] = True
                tag_blocks[:, acc:] = torch.cumprod(pm.int(), -1)
                hit = (spec[:, acc:] == eos_id) & (tag_blocks[:, acc:] == 1)
                if bool(hit.any()):
                    eos_loop = True
                    first_eos_row = int(torch.where(hit.any(1))[0][0])
                    spec, tag_blocks = spec[: first_eos_row + 1], tag_blocks[: first_eos_row + 1]
                    tag_blocks[first_eos_row] = 1
                    cpos, top = cpos[: first_eos_row + 1], top[: first_eos_row + 1]
                    vkv = [(kk[: first_eos_row + 1], vv[: first_eos_row + 1]) for kk, vv in vkv]
                new_len = int(tag_blocks[:, acc:].sum(1).min())
                if new_len > 0:
                    acc += new_len - 1 if bool((tag_blocks == 0).any()) else new_len
                    pkv = _crop(vkv, cur_x.shape[1] + acc)
            ar_kv = [(kk[:, :, -k:], vv[:, :, -k:]) for kk, vv in pkv]
            pkv = [(kk[:1, :, : cur_x.shape[1]], vv[:1, :, : cur_x.shape[1]]) for kk, vv in _crop(pkv, cur_x.shape[1])]
            em = (spec == eos_id).flatten().int()
            keepm = (torch.cumsum(em, -1) - em) == 0
            kept_tokens = spec.flatten()[keepm][None]
            kept_pos = cpos.flatten()[keepm][None]
            kept = [
                (
                    kk.permute(1, 0, 2, 3).reshape(1, kk.shape[1], -1, kk.shape[3])[:, :, keepm],
                    vv.permute(1, 0, 2, 3).reshape(1, vv.shape[1], -1, vv.shape[3])[:, :, keepm],
                )
                for kk, vv in ar_kv
            ]
            pkv = [(torch.cat([a, kk], 2), torch.cat([b, vv], 2)) for (a, b), (kk, vv) in zip(pkv, kept)]
            appended.append(kept)
            cur_x = torch.cat([cur_x, kept_tokens], 1)
            cur_pos = torch.cat([cur_pos, kept_pos], 1)
            if eos_loop:
                start = first_eos_row if eos_row_quirk else int(top[first_eos_row])
                remove.update(range(start, blocks_x.shape[1]))
                eos_flag = True
            log.append(("infill", top.tolist() if not eos_loop else top.tolist(), eos_loop))
            keep = torch.ones(blocks_x.shape[1], dtype=torch.bool)
            keep[list(remove)] = False
            blocks_x, blocks_pos = blocks_x[:, keep], blocks_pos[:, keep]
            caches.append(pkv)
        if eos_flag:
            break
    order = torch.sort(cur_pos, -1)[1]
    return torch.gather(cur_x, -1, order), log, caches, appended, cur_pos
