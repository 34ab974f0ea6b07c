"""The native small-query attention (localdiff.kernels.attend): against a float64 transcription of SDPA's math for
GQA shapes, strided cache views, key masks and every head size it takes; the cases it declines; and the dense
layer's use of it (a bf16 block model's 1-token and block steps over a cache, native vs torch's SDPA)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from localdiff.arch import dense
from localdiff.kernels import attend as native_attend
from localdiff.kernels import build as native_build

needs_kernel = pytest.mark.skipif(
    native_build.compiler() is None or native_attend.library() is None,
    reason="no C compiler or no AVX512-BF16 (the kernel is off: torch's SDPA runs)",
)


def _ref(q, k, v, mask):
    """float64 softmax(q kᵀ / √D) v with GQA (query head h reads key-value head h // G), heads laid out [B, n, H·D]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    b, h, n, d = q.shape
    return (s.softmax(-1) @ vv).transpose(1, 2).reshape(b, n, h * d)


def _case(b, h, hkv, n, length, d, seed):
    """q a transposed view of [B, n, H, D]; k / v views of longer cache buffers (strided heads), bf16."""
    g = torch.Generator().manual_seed(seed)
    kb, vb = (torch.randn(b, hkv, length + 37, d, generator=g).bfloat16() for _ in range(2))
    q = (torch.randn(b, n, h, d, generator=g) * 2).bfloat16().transpose(1, 2)
    return q, kb[:, :, 5 : 5 + length], vb[:, :, 5 : 5 + length]


@needs_kernel
@pytest.mark.parametrize(
    "b,h,hkv,n,length,d",
    [
        (1, 16, 8, 1, 513, 128),
        (2, 16, 8, 4, 700, 128),
        (1, 8, 8, 3, 33, 64),
        (1, 4, 2, 5, 17, 256),
        (3, 6, 2, 16, 1, 64),
        (1, 4, 1, 7, 100, 128),
    ],
)
def test_native_attention_equals_float64(b, h, hkv, n, length, d):
    """Within the bf16 rounding of the result (half an ulp: 2⁻⁸ relative) plus fp32 sums; with and without a key mask (per batch
    row, or one row for every batch row)."""
    q, k, v = _case(b, h, hkv, n, length, d, seed=b * 1000 + n * 10 + d)
    g = torch.Generator().manual_seed(7)
    masks = [None, torch.rand(b, 1, 1, length, generator=g) > 0.4, torch.rand(1, 1, 1, length, generator=g) > 0.4]
    for mask in masks:
        if mask is not None:
            mask[..., 0] = True  # every row sees a key
        out = native_attend.attend(q, k, v, mask)
        ref = _ref(q, k, v, mask)
        assert out is not None and out.dtype == torch.bfloat16 and out.shape == (b, n, h * d)
        err = (out.double() - ref).abs()
        bound = ref.abs() * 2.0**-8 + 1e-5 * ref.abs().max()
        assert (err <= bound).all(), (mask is None, (err - bound).max().item())
        # one changed value is seen: the criterion is sharp
        v2 = v.clone()
        v2[0, 0, 0] += 0.25
        if mask is None:
            assert ((native_attend.attend(q, k, v2, None).double() - ref).abs() > bound).any()


@needs_kernel
def test_native_attention_declines():
    """None (the caller runs SDPA) for fp32, too many query rows, per-row masks, other head sizes, strided rows, and
    a batch row that sees no key."""
    q, k, v = _case(1, 4, 2, 2, 20, 64, 0)
    assert native_attend.attend(q.float(), k.float(), v.float(), None) is None
    big = _case(1, 4, 2, native_attend.MAX_ROWS + 1, 20, 64, 0)
    assert native_attend.attend(*big, None) is None
    assert native_attend.attend(q, k, v, torch.ones(1, 1, 2, 20, dtype=torch.bool)) is None
    assert native_attend.attend(*_case(1, 4, 2, 2, 20, 48, 0), None) is None
    assert native_attend.attend(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None) is None
    none = torch.zeros(1, 1, 1, 20, dtype=torch.bool)
    assert native_attend.attend(q, k, v, none) is None
    assert native_attend.attend(q, k, v, torch.ones(1, 1, 1, 20, dtype=torch.bool)) is not None


@needs_kernel
def test_dense_attention_runs_the_native_kernel():
    """bf16 on CPU with a few rows: ``Attention.core`` returns the native kernel's result (not SDPA's, which rounds
    its softmax weights to bf16), for the GQA-stacked and the masked calls."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        qkv_bias=False,
        qk_norm=False,
        rms_norm_eps=1e-6,
        clip_qkv=None,
        rope_fp32=False,
    )
    att = dense.Attention(cfg)
    q, k, v = _case(1, 4, 2, 1, 300, 64, 3)
    mask = torch.rand(1, 1, 1, 300) > 0.5
    mask[..., 0] = True
    for m in (None, mask):
        want = native_attend.attend(q, k, v, m)
        assert torch.equal(att.core(q, k, v, m), want)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).transpose(1, 2).reshape(1, 1, -1)
        assert (want.double() - _ref(q, k, v, m)).abs().max() <= (sdpa.double() - _ref(q, k, v, m)).abs().max()


@needs_kernel
def test_block_model_steps_native_vs_sdpa(monkeypatch):
    """A bf16 block model (head_dim 64) over a 40-token cache: 1-token and block-step logits with the native kernel
    equal the SDPA ones within bf16 noise (random weights: 3 layers, a few steps)."""
    from block_models import build_net

    from localdiff.cache.kv import KVCache

    _, net = build_net("sdar", head_dim=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    net = net.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 120, (1, 40), generator=g)
    outs = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(dense, "native_attend", lambda *a: None)
        cache = KVCache(**net.cache_layout())
        net.prefill(prompt, cache)
        outs[native] = [net.denoise(prompt[:, :n], cache).float() for n in (1, 4, 1)]
    for a, b in zip(outs[True], outs[False]):
        scale = b.abs().max()
        assert (a - b).abs().max() <= 0.02 * scale, ((a - b).abs().max() / scale).item()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
