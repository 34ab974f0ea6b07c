"""The scale bench's FLOP counter (localdiff.bench.scale_flops): equal to torch's own FlopCounterMode where both count,
the same under torch.inference_mode (ops reach the mode undecomposed there), products filed by their shapes, and
the two formulas torch lacks (grouped_mm with offsets, CPU attention) by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from localdiff.bench import scale, scale_flops
from localdiff.bench.scale_flops import FlopCount

V, E = 37, 5


def _work(x, w, emb, p):
    F.linear(x, w)  # other
    F.linear(x[..., :3], emb)  # [.., V] out: LM head
    F.linear(p, emb.t())  # reduction over V: self-conditioning product
    torch.bmm(torch.randn(E, 4, 6), torch.randn(E, 6, 2))  # E matrices: experts


def test_counts_equal_torch_and_inference_mode():
    x, w, emb, p = torch.randn(2, 3, 7), torch.randn(11, 7), torch.randn(V, 3), torch.randn(2, 3, V)
    with FlopCounterMode(display=False) as ref:
        _work(x, w, emb, p)
    fc = FlopCount(V, E)
    with fc:
        _work(x, w, emb, p)
    fi = FlopCount(V, E)
    with torch.inference_mode(), fi:
        _work(x, w, emb, p)
    assert sum(fc.by_component.values()) == ref.get_total_flops() == sum(fi.by_component.values())
    want = {
        "other linears": 2 * 6 * 7 * 11,
        "LM head": 2 * 6 * 3 * V,
        "self-conditioning product": 2 * 6 * V * 3,
        "experts": 2 * E * 4 * 6 * 2,
    }
    assert dict(fc.by_component) == want == dict(fi.by_component)


def test_attention_and_grouped_mm_formulas():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    fc = FlopCount(V, E)
    with torch.inference_mode(), fc:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert dict(fc.by_component) == {"attention scores": 2 * 4 * 5 * 9 * (8 + 8)}
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    a, b = torch.randn(10, 16, dtype=torch.bfloat16), torch.randn(E, 16, 8, dtype=torch.bfloat16)  # 16-byte strides
    offs = torch.tensor([2, 2, 5, 7, 8], dtype=torch.int32)  # rows 8, 9 past the last group: not computed
    fc = FlopCount(V, E)
    with fc:
        torch._grouped_mm(a, b, offs=offs)
    assert dict(fc.by_component) == {"experts": 2 * 8 * 16 * 8}


def test_prefill_arithmetic_groups():
    text = scale.text_config(*scale.SHAPES["smoke"])
    step = scale_flops.group_arithmetic(scale.flops_per_step(text))
    assert sum(step.values()) == sum(scale.flops_per_step(text).values())
    pre = scale_flops.prefill_flops(text, scale.CANVAS)
    assert pre["LM head"] == pre["self-conditioning product"] == 0
    assert pre["experts"] == step["experts"]  # the same rows through the same experts
