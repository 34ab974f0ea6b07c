"""The packed DiffusionGemma forward for step-level batching (docs/ARCHITECTURE.md, "Step-level batching"): one
pass over the canvas rows (and fused prefill rows) of several requests' own ``denoise`` calls, each with its own
block KV cache, positions, masks and self-conditioning input.

The row-wise parts — the canvas embeddings' self-conditioning (the soft-embedding product ``softmax(sc) · E`` and
the self-conditioning MLP), per layer the norms, q/k/v projections with RoPE (each row with its own position's
tables), output projection, dense MLP, router and **the routed experts** (tokens of every request grouped by
expert: with N canvases of 256 rows and top-8 of 128 experts each expert sees ~16·N rows instead of ~16), the final
norm and the LM head — run over the concatenated rows of a *group* of requests; attention runs per request against
its own cache exactly as :meth:`DiffusionGemma._forward` does (its own ``_attend_fused`` / ``_attend_canvas``).

Which segments share a computation is the caller's ``policy`` (:class:`localdiff.engine.batch_canvas.CanvasRowPolicy`):
``policy.pack(kind, sizes, layer, dtype)`` (kinds "attn", "ffn" (dense MLP + router), "sc" (soft embedding +
self-conditioning MLP), "head") as in :mod:`localdiff.arch.packed`, and ``policy.experts(layer, counts, dtype)``
(``counts``: the rows each segment routes to each expert, lists of E ints) → groups of segment indexes whose expert
rows the experts kernel computes bit-identically alone and together. So every request's logits equal its own
``denoise`` output bit for bit (tests/serve/test_batch_canvas.py). Source: the forward it packs,
:mod:`localdiff.arch.diffusion_gemma` (transformers 5.23 ``modeling_diffusion_gemma.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.diffusion_gemma_layers import layer_type
from localdiff.arch.layers import linear, norm, rms_norm
from localdiff.arch.packed import _grouped
from localdiff.arch.soft_embedding import Probabilities, RawLogits, soft_embedding


def _rows(pack, kind: str, segs: list, fn, layer=None) -> list:
    """Run ``fn(x) -> tuple of Tensors[M, ...]`` once per group of ``pack`` over the segments (Tensors[m, ...],
    concatenated along dim 0); returns, per segment, the tuple split back by rows."""
    out: list = [None] * len(segs)
    for g in pack(kind, [s.shape[0] for s in segs], layer, segs[0].dtype):
        ys = fn(segs[g[0]] if len(g) == 1 else torch.cat([segs[j] for j in g]))
        sizes = [segs[j].shape[0] for j in g]
        parts = list(zip(*(y.split(sizes) for y in ys)))
        for j, p in zip(g, parts):
            out[j] = p
    return out


def _soft_probs(net, sc) -> torch.Tensor | None:
    """The self-conditioning distribution Tensor[C, V] in the embedding's dtype as :func:`soft_embedding` makes it
    (exact path, float table), or None when the soft embedding runs alone (top-k approximation, quantized table)."""
    e = net.embed_tokens
    if not isinstance(e, nn.Embedding) or net.sc_topk is not None:
        return None
    w = e.weight
    p = (
        sc.probs.to(w.dtype)
        if isinstance(sc, Probabilities)
        else torch.softmax(sc, -1, dtype=torch.float32).to(w.dtype)
    )
    return p.reshape(-1, p.shape[-1])


def _inputs(net, calls: list, policy) -> list:
    """Input stage of every call (``DiffusionGemma._inputs``): Tensors[1, n + c, H], the soft-embedding product and
    the self-conditioning MLP packed over the requests that have a previous step's logits."""
    canv = [net._embed(a["canvas_ids"]) for a in calls]
    soft: list = [None] * len(calls)
    probs, who = [], []
    for j, a in enumerate(calls):
        sc = a.get("self_conditioning_logits")
        if sc is None:
            continue
        p = _soft_probs(net, sc)
        if p is None:
            e = net.embed_tokens.weight if isinstance(net.embed_tokens, nn.Embedding) else net.embed_tokens
            soft[j] = (soft_embedding(sc, e, net.sc_topk) * net._scale(canv[j].dtype, canv[j].device))[0]
        else:
            probs.append(p)
            who.append(j)
    selfc = net.self_conditioning
    if probs:
        w = net.embed_tokens.weight

        def fn(p):
            return (F.linear(p, w.t()),)

        for j, (y,) in zip(who, _rows(policy.pack, "soft", probs, fn)):
            soft[j] = y * net._scale(canv[j].dtype, canv[j].device)
    have = [j for j in range(len(calls)) if soft[j] is not None]
    mlp = {}
    if have:
        segs = [soft[j] for j in have]
        done = _rows(policy.pack, "sc", segs, lambda s: (selfc.mlp.forward(norm(selfc.pre_norm, s)),))
        mlp = {j: y for j, (y,) in zip(have, done)}
    out = []
    for j, a in enumerate(calls):
        xc = canv[j]
        if j in mlp:
            xc = xc + mlp[j][None]
        xc = rms_norm(xc, None, selfc.eps)
        pre = a.get("prefill_ids")
        out.append(xc if pre is None or not pre.shape[1] else torch.cat([net._embed(pre), xc], 1))
    return out


def _ffn(net, policy, i: int, xs: list, splits: list) -> list:
    """Layer i's ``Layer.ffn(x, split)`` for every request (xs: Tensors[1, m, H]; splits: the ``split`` of each),
    the dense MLP and router packed (kind "ffn"), the experts grouped by :meth:`policy.experts` over the segments
    each request's own pass gives them (prefill rows and canvas rows apart in a fused pass)."""
    layer = net.layers[i]
    pre = layer.pre_feedforward_layernorm
    fp32 = xs[0].dtype == torch.float32 and pre.weight.dtype == torch.float32

    def dense_part(flat):
        if fp32:
            normed = rms_norm(flat, None, pre.eps)
            dense = norm(layer.post_feedforward_layernorm_1, layer.mlp.forward(normed * pre.weight))
            w, idx = layer.router.route(normed)
            return dense, w, idx, normed * layer.pre_feedforward_layernorm_2.weight
        dense = layer.post_feedforward_layernorm_1(layer.mlp(pre(flat)))
        w, idx = layer.router(flat)
        return dense, w, idx, layer.pre_feedforward_layernorm_2(flat)

    parts = _rows(policy.pack, "ffn", [x[0] for x in xs], dense_part, i)
    segs, owner = [], []  # expert segments: (moe_in, w, idx) row ranges as each request's pass splits them
    for j, ((_, w, idx, moe_in), s) in enumerate(zip(parts, splits)):
        cuts = [slice(0, s), slice(s, moe_in.shape[0])] if s else [slice(0, moe_in.shape[0])]
        for r in cuts:
            segs.append((moe_in[r], w[r], idx[r]))
            owner.append(j)
    e = layer.experts.num_experts
    counts = [torch.bincount(ix.reshape(-1), minlength=e).tolist() for _, _, ix in segs]
    moe: list = [None] * len(segs)
    for g in policy.experts(i, counts, segs[0][0].dtype):
        y = layer.experts(*(segs[g[0]] if len(g) == 1 else [torch.cat([segs[j][t] for j in g]) for t in range(3)]))
        for j, part in zip(g, y.split([segs[j][0].shape[0] for j in g])):
            moe[j] = part
    out, k = [], 0
    for j, (x, (dense, _, _, _)) in enumerate(zip(xs, parts)):
        n = owner.count(j)
        m = moe[k] if n == 1 else torch.cat(moe[k : k + n])
        k += n
        y = x[0] + norm(layer.post_feedforward_layernorm, dense + norm(layer.post_feedforward_layernorm_2, m))
        out.append(y[None])
    return out


@torch.inference_mode()
def canvas_denoise(net, calls: list, policy) -> list:
    """``net.denoise(canvas_ids, cache, self_conditioning_logits, prefill_ids, prefill_mask, raw_logits=...)`` for
    each call, in one packed pass.

    Args:
        net: a :class:`localdiff.arch.diffusion_gemma.DiffusionGemma`.
        calls: list of dicts with the keys of ``denoise`` — ``canvas_ids`` LongTensor[1, C], ``cache`` (each
            request's own; fused prefill rows are appended to it as its own forward would),
            ``self_conditioning_logits`` (FloatTensor[1, C, V], ``Probabilities`` or None), ``prefill_ids``
            LongTensor[1, n] or None, ``prefill_mask`` Bool[1, n] or None, ``raw_logits`` bool; no ``head_rows``.
        policy: the grouping of rows (module docstring).
    Returns:
        list of what each call's ``denoise`` returns: FloatTensor[1, C, V] soft-capped fp32 logits, or
        ``RawLogits`` (values in a fresh tensor, not the reused buffer of ``raw_logits``) — equal bit for bit.
    """
    st = []
    xs = _inputs(net, calls, policy)
    with contextlib.ExitStack() as stack:
        for a, x in zip(calls, xs):
            ids, cache = a.get("prefill_ids"), a["cache"]
            n = 0 if ids is None else ids.shape[1]
            c = a["canvas_ids"].shape[1]
            start = cache.seq_len
            new_mask = None if (a.get("prefill_mask") is None or not n) else a["prefill_mask"].to(x.device).bool()
            if new_mask is not None and bool(new_mask.all()):
                new_mask = None
            if n:
                stack.enter_context(cache.writing(ids, new_mask))
            st.append(
                {
                    "x": x,
                    "n": n,
                    "c": c,
                    "cache": cache,
                    "start": start,
                    "mask": new_mask,
                    "masks": {},
                    "rope": net._rope(start, n + c, x.dtype, x.device),
                }
            )
        last = len(net.layers) - 1
        for i, layer in enumerate(net.layers):
            att = layer.self_attn
            ty = layer_type(att)

            def qkv(x, g, att=att, layer=layer, ty=ty):
                cos = torch.cat([st[j]["rope"][ty][0] for j in g]) if len(g) > 1 else st[g[0]]["rope"][ty][0]
                sin = torch.cat([st[j]["rope"][ty][1] for j in g]) if len(g) > 1 else st[g[0]]["rope"][ty][1]
                return att.qkv(norm(layer.input_layernorm, x), cos, sin)

            heads = _grouped(policy.pack, "attn", [s["x"] for s in st], qkv, i)
            outs = []
            for s, (q, k, v) in zip(st, heads):
                cache, n, c, dev = s["cache"], s["n"], s["c"], s["x"].device
                if n:
                    key = (att.sliding, cache.visible_len(i))
                    if key not in s["masks"]:
                        s["masks"][key] = net._masks(
                            1, n, c, s["start"], key[1], att.sliding, cache.past_mask(i), s["mask"], dev
                        )
                    a = net._attend_fused(i, q, k, v, n, c, cache, s["masks"][key])
                    if i == last:
                        s["x"], s["n"] = s["x"][:, n:], 0
                else:
                    a = net._attend_canvas(i, q, k, v, c, cache, s["masks"], 1, dev)
                outs.append(a)
            proj = _grouped(policy.pack, "attn", outs, lambda a, g, att=att: linear(att.o_proj, a), i)
            res = [s["x"] + norm(layer.post_attention_layernorm, o) for s, o in zip(st, proj)]
            new = _ffn(net, policy, i, res, [s["n"] for s in st])
            for s, x in zip(st, new):
                n = s["n"]
                if not n:
                    s["x"] = x * layer.layer_scalar
                else:
                    s["x"] = torch.cat([x[:, :n] * layer.enc_layer_scalar, x[:, n:] * layer.layer_scalar], 1)
    return _head(net, policy, [s["x"] for s in st], [bool(a.get("raw_logits")) for a in calls])


def _head(net, policy, xs: list, raw: list) -> list:
    """Final norm + LM head (``DiffusionGemma.logits``) per request, packed among the requests asking the same
    form (raw or soft-capped fp32)."""
    cap, head = net.config.final_logit_softcapping, getattr(net, "head_int8", None)
    w = None if head else net.lm_head.weight if net.lm_head is not None else net.embed_tokens.weight
    out: list = [None] * len(xs)
    for want in (False, True):
        idx = [j for j, r in enumerate(raw) if r == want]
        if not idx:
            continue

        def fn(x, g, want=want):
            h = norm(net.norm, x)
            if want:  # raw_head's product, into a fresh tensor
                return head(h) if head else torch.mm(h.reshape(-1, h.shape[-1]), w.t()).view(*h.shape[:-1], -1)
            return (head(h) if head else F.linear(h, w)).float()

        for j, y in zip(idx, _grouped(policy.pack, "head", [xs[j] for j in idx], fn)):
            if want:
                out[j] = RawLogits(y, cap)
            else:
                out[j] = y if cap is None else y.div(cap).tanh_().mul_(cap)
    return out
