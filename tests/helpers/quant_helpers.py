"""Shared by the quantization tests: paired logits of two nets, their agreement, and a float twin of an int4
net (the same weights dequantized)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from localdiff.quantize import int4
from localdiff.quantize.apply import quantized_modules


def denoise_pairs(net_a, net_b, n_canvases=32, batch=8, prompt=10, canvas_len=32, seed=1):
    """Logits of both nets for the same random prompts and canvases (``n_canvases`` canvases of ``canvas_len``
    tokens, ``batch`` per forward): (a, b) Tensors[n_canvases, canvas_len, V] fp32."""
    from localdiff.cache.kv import KVCache

    cfg = net_a.config
    g = torch.Generator().manual_seed(seed)
    outs = ([], [])
    for _ in range(max(n_canvases // batch, 1)):
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=g)
        canvas = torch.randint(0, cfg.vocab_size, (batch, canvas_len), generator=g)
        for net, out in zip((net_a, net_b), outs):
            cache = KVCache(net.layer_windows())
            net.prefill(ids, cache)
            out.append(net.denoise(canvas, cache).float())
    return torch.cat(outs[0]), torch.cat(outs[1])


def agreement(a, b):
    """(top-1 agreement, mean KL(a‖b) per position, top-1 agreement where a's top-1 margin > 0.2 nats)."""
    lp, lq = a.log_softmax(-1), b.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    eq = a.argmax(-1) == b.argmax(-1)
    top2 = a.topk(2, -1).values
    decided = (top2[..., 0] - top2[..., 1]) > 0.2
    return eq.float().mean().item(), kl, eq[decided].float().mean().item(), int(decided.sum())


def dequantized_twin(qnet: nn.Module, net: nn.Module) -> nn.Module:
    """``net`` (float) with every weight ``qnet`` quantizes replaced by its dequantized int4 value."""
    twin = copy.deepcopy(net)
    for name, m in quantized_modules(qnet).items():
        f = twin.get_submodule(name)
        with torch.no_grad():
            if isinstance(m, int4.Int4Linear):
                f.weight.copy_(int4.dequantize(m.weight, m.weight_scale, m.weight_zero, m.in_features))
            else:
                for p in ("gate_up_proj", "down_proj"):
                    t = getattr(f, p)
                    t.copy_(
                        int4.dequantize(getattr(m, p), getattr(m, p + "_scale"), getattr(m, p + "_zero"), t.shape[-1])
                    )
    return twin
