"""Packed forwards for step-level batching (docs/ARCHITECTURE.md, "Step-level batching"): one pass over the rows of
several requests' own forward calls, each with its own KV cache, positions and masks.

Per layer, the row-wise parts — RMSNorms, the q/k/v projections with RoPE (each row with its own position's tables),
the output projection, the feed-forward, the final norm and the LM head — run over the concatenated rows of a
*group* of requests, while attention runs per request against that request's own cache exactly as its own forward
does (same queries, keys, masks, SDPA call). Which requests may share a matmul is the caller's ``pack(kind, sizes,
layer, dtype) -> list[list[int]]`` (``kind`` "attn" / "ffn" / "head"; ``sizes``: the row count of each segment, in
the order the segments are given; it returns groups of segment indexes covering every segment once): the engine's
:class:`localdiff.engine.batch.RowPolicy` groups only segments whose rows the kernels compute bit-identically alone
and in the group, so every request's logits equal its own forward's, bit for bit.

Functions: :func:`block_denoise` (``BlockLM.denoise`` with or without fused prefill ids; batch 1 per request) and
:func:`masked_window` (``MaskedLM.forward_window`` / ``logits_full``; batch 1 per request). Sources: the forwards
they pack, :mod:`localdiff.arch.block` and :mod:`localdiff.arch.masked`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from localdiff.arch.dense import rope_cos_sin
from localdiff.arch.masked import head_rows


def _grouped(pack, kind: str, segs: list, fn, layer=None) -> list:
    """Run ``fn(x, members)`` once per group of ``pack(kind, sizes, layer, dtype)`` over its row segments
    (Tensors[1, m, ...]) concatenated along dim 1; returns the output per segment, split back by rows: ``fn``
    returns a Tensor[1, M, ...] (split along dim 1) or a tuple of Tensors[1, h, M, d] (q / k / v: along dim 2)."""
    out: list = [None] * len(segs)
    dtype = segs[0].dtype
    for g in pack(kind, [s.shape[1] for s in segs], layer, dtype):
        x = segs[g[0]] if len(g) == 1 else torch.cat([segs[j] for j in g], 1)
        y = fn(x, g)
        if len(g) == 1:
            out[g[0]] = y
            continue
        sizes = [segs[j].shape[1] for j in g]
        parts = list(zip(*(t.split(sizes, 2) for t in y))) if isinstance(y, tuple) else y.split(sizes, 1)
        for j, p in zip(g, parts):
            out[j] = p
    return out


def _qkv(net, pack, i: int, xs: list, tables: list) -> list:
    """Layer i's norm + q/k/v projections + RoPE over every request's rows ``xs`` (Tensors[1, m, H]; ``tables``
    their (cos, sin)); returns (q, k, v) per request."""
    layer = net.layers[i]

    def fn(x, g):
        cos = tables[g[0]][0] if len(g) == 1 else torch.cat([tables[j][0] for j in g])
        sin = tables[g[0]][1] if len(g) == 1 else torch.cat([tables[j][1] for j in g])
        return layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)

    return _grouped(pack, "attn", xs, fn, i)


def _out_ffn(net, pack, i: int, xs: list, parts: list) -> list:
    """Layer i's output projection (one segment per attention call of a request, as its own forward projects them)
    and ``ffn(x + a)`` per request; returns the new rows per request."""
    layer = net.layers[i]
    flat = [a for p in parts for a in p]
    proj = _grouped(pack, "attn", flat, lambda x, g: layer.self_attn.project(x), i)
    res, o = [], 0
    for x, p in zip(xs, parts):
        a = proj[o] if len(p) == 1 else torch.cat(proj[o : o + len(p)], 1)
        o += len(p)
        res.append(x + a)
    return _grouped(pack, "ffn", res, lambda x, g: layer.ffn(x), i)


@torch.inference_mode()
def block_denoise(net, calls: list, pack) -> list:
    """``net.denoise(canvas, cache, None, prefill_ids, prefill_mask)`` for each call, in one packed pass.

    Args:
        net: a :class:`localdiff.arch.block.BlockLM`.
        calls: list of (canvas_ids LongTensor[1, C], cache, prefill_ids LongTensor[1, n] or None, prefill_mask
            Bool[1, n] or None) — each request's own arguments (its own cache, which its prefill rows are
            appended to as its own forward would).
        pack: the grouping of rows (module docstring).
    Returns:
        list of FloatTensor[1, C, V] raw logits, one per call, equal to the calls' own ``denoise`` outputs.
    """
    st = []
    with contextlib.ExitStack() as stack:
        for canvas, cache, pre, pre_mask in calls:
            n = 0 if pre is None else pre.shape[1]
            c = canvas.shape[1]
            x = net.embed_tokens(canvas if not n else torch.cat([pre, canvas], 1))
            start = cache.seq_len
            new_mask = None if (pre_mask is None or not n) else pre_mask.to(x.device).bool()
            if new_mask is not None and bool(new_mask.all()):
                new_mask = None
            if n:
                stack.enter_context(cache.writing(pre, new_mask))
            st.append(
                {
                    "x": x,
                    "n": n,
                    "c": c,
                    "cache": cache,
                    "start": start,
                    "mask": new_mask,
                    "masks": {},
                    "rope": rope_cos_sin(net._inv_freq, start, n + c, x.device),
                }
            )
        last = len(net.layers) - 1
        for i, layer in enumerate(net.layers):
            att = layer.self_attn
            qkv = _qkv(net, pack, i, [s["x"] for s in st], [s["rope"] for s in st])
            parts = []
            for s, (q, k, v) in zip(st, qkv):
                cache, n, c, dev = s["cache"], s["n"], s["c"], s["x"].device
                past_n = cache.visible_len(i)
                if past_n not in s["masks"]:
                    s["masks"][past_n] = net._masks(1, n, c, s["start"], past_n, cache.past_mask(i), s["mask"], dev)
                m_pre, m_can = s["masks"][past_n]
                if n:
                    past = cache.past(i)
                    kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
                    cache.append(i, k[:, :, :n], v[:, :, :n])
                    outs = (
                        []
                        if i == last
                        else [att.core(q[:, :, :n], kk[:, :, : past_n + n], vv[:, :, : past_n + n], m_pre)]
                    )
                    outs.append(att.core(q[:, :, n:], kk, vv, m_can))
                    if i == last:  # only the canvas rows go on
                        s["x"], s["n"] = s["x"][:, n:], 0
                else:
                    kk, vv = cache.with_canvas(i, k, v)
                    outs = [att.core(q, kk, vv, m_can)]
                parts.append(outs)
            new = _out_ffn(net, pack, i, [s["x"] for s in st], parts)
            for s, x in zip(st, new):
                s["x"] = x
    return _grouped(pack, "head", [s["x"] for s in st], lambda x, g: net._logits(net.norm(x)))


@torch.inference_mode()
def masked_window(net, calls: list, pack) -> list:
    """``net.forward_window(ids, start, kv, attention_mask, return_kv, rows, select)`` for each call, in one packed
    pass (``logits_full`` is the call with start 0 and no kv).

    Args:
        net: a :class:`localdiff.arch.masked.MaskedLM`.
        calls: list of dicts with the keys ``input_ids`` (LongTensor[1, n]), ``start``, ``kv``, ``attention_mask``,
            ``return_kv``, ``rows``, ``select`` — each request's own arguments, as ``forward_window`` takes them.
        pack: the grouping of rows (module docstring).
    Returns:
        list of what each call's ``forward_window`` returns (logits, or (logits, fresh K/V) with ``return_kv``).
    Raises:
        ValueError: as ``forward_window`` (checked per call before any work).
    """
    st = []
    for a in calls:
        ids, start, kv = a["input_ids"], a.get("start", 0), a.get("kv")
        b, n = ids.shape
        if start < 0:
            raise ValueError(f"start must be >= 0 (got {start})")
        total = n
        if kv is not None:
            if len(kv) != len(net.layers):
                raise ValueError(f"kv has {len(kv)} layers, the model has {len(net.layers)}")
            s = kv[0][0].shape[2]
            if s < start:
                raise ValueError(f"kv holds {s} positions, fewer than start={start}")
            total = start + n + max(0, s - start - n)
        mask = net._key_mask(a.get("attention_mask"), b, total, start, n, kv is None, ids.device)
        x = net.embed_tokens(ids)
        st.append(
            {
                "x": x,
                "start": start,
                "n": n,
                "kv": kv,
                "mask": mask,
                "fresh": [] if a.get("return_kv") else None,
                "rope": rope_cos_sin(net._inv_freq, start, n, x.device),
            }
        )
    for i, layer in enumerate(net.layers):
        qkv = _qkv(net, pack, i, [s["x"] for s in st], [s["rope"] for s in st])
        parts = []
        for s, (q, k, v) in zip(st, qkv):
            if s["fresh"] is not None:
                s["fresh"].append((k, v))
            if s["kv"] is not None:
                pk, pv = s["kv"][i]
                start, n = s["start"], s["n"]
                k = torch.cat([pk[:, :, :start], k, pk[:, :, start + n :]], 2)
                v = torch.cat([pv[:, :, :start], v, pv[:, :, start + n :]], 2)
            parts.append([layer.self_attn.core(q, k, v, s["mask"])])
        for s, x in zip(st, _out_ffn(net, pack, i, [s["x"] for s in st], parts)):
            s["x"] = x
    heads, where = [], []
    v = net.config.vocab_size
    for s, a in zip(st, calls):
        h = net.norm(s["x"])
        rows, select = a.get("rows"), a.get("select")
        if rows is not None:
            h = h[:, rows[0] : rows[1]]
        if select is None or bool(select.all()):
            heads.append(h)
            where.append(None)
        else:
            sel = head_rows(select)
            heads.append(h[sel][None])
            where.append((sel, tuple(select.shape)))
    w = net.head_weight()
    logits = _grouped(pack, "head", heads, lambda x, g: F.linear(x, w)[..., :v].float())
    out = []
    for s, a, y, wh in zip(st, calls, logits, where):
        if wh is not None:
            full = y.new_zeros(*wh[1], v)
            full[wh[0]] = y[0]
            y = full
        out.append((y, s["fresh"]) if a.get("return_kv") else y)
    return out
