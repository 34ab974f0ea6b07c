"""The native per-row bf16 ops (localdiff.kernels.rowops) against the torch ops they replace in
localdiff.arch.dense: RMSNorm (with and without a weight) and Qwen3's fused q/k RMSNorm + RoPE; equal except where
the order of the sum of squares moves a last bit (rare, one bf16 ulp)."""

from __future__ import annotations

import pytest
import torch

from localdiff.arch import dense
from localdiff.kernels import build as native_build
from localdiff.kernels import rowops

needs_cc = pytest.mark.skipif(
    native_build.compiler() is None or rowops.library() is None, reason="no C compiler: the torch ops run"
)


def _torch_path(monkeypatch):
    monkeypatch.setattr(rowops, "rms_norm", lambda *a: None)
    monkeypatch.setattr(rowops, "qk_norm_rope", lambda *a: None)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bit-equal but for ≤ 0.2 % of the elements, those ≤ one bf16 ulp apart."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    diff = a != b
    assert diff.float().mean() <= 2e-3, diff.float().mean()
    ulp = b.float().abs() * 2.0**-7
    assert ((a.float() - b.float()).abs() <= ulp + 1e-30).all()


@needs_cc
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 5, 40), (3, 128), (4, 7, 1000), (1, 1, 1)])
def test_rms_norm_equals_torch_ops(monkeypatch, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    w = (torch.rand(shape[-1], generator=g) + 0.5).bfloat16()
    got = {wt is None: dense.llama_rms_norm(x, wt, 1e-6) for wt in (w, None)}
    assert rowops.rms_norm(x, w, 1e-6) is not None
    _torch_path(monkeypatch)
    for wt in (w, None):
        _close(got[wt is None], dense.llama_rms_norm(x, wt, 1e-6))


@needs_cc
def test_rms_norm_declines():
    x = torch.randn(3, 64).bfloat16()
    assert rowops.rms_norm(x.float(), None, 1e-6) is None
    assert rowops.rms_norm(x.t(), None, 1e-6) is None
    assert rowops.rms_norm(x, torch.ones(64), 1e-6) is None


@needs_cc
@pytest.mark.parametrize("b,n,hq,hk,d", [(1, 1, 16, 8, 128), (2, 4, 4, 2, 64), (1, 3, 3, 1, 14)])
def test_qk_norm_rope_equals_torch_ops(monkeypatch, b, n, hq, hk, d):
    """``Attention.qkv`` on a fused q/k/v output (the int8 / int4 fused projections' layout), native vs torch ops."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        hidden_size=32,
        num_attention_heads=hq,
        num_key_value_heads=hk,
        head_dim=d,
        qkv_bias=False,
        qk_norm=True,
        rms_norm_eps=1e-6,
        clip_qkv=None,
        rope_fp32=False,
    )
    att = dense.Attention(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(d)
    with torch.no_grad():
        att.q_norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        att.k_norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
    fused = (torch.randn(b, n, (hq + 2 * hk) * d, generator=g) * 2).bfloat16()
    att.qkv_fused = lambda x: fused.split([hq * d, hk * d, hk * d], dim=-1)
    cos, sin = dense.rope_cos_sin(dense.inv_freq({"rope_theta": 10000.0}, d), 37, n, "cpu")
    x = torch.zeros(b, n, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = att.qkv(x, cos, sin)
        _torch_path(monkeypatch)
        want = att.qkv(x, cos, sin)
    for a, w in zip(got, want):
        _close(a.contiguous(), w.contiguous())
    assert torch.equal(got[2], want[2])
