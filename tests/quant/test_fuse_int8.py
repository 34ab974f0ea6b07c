"""Fused int8 projections (localdiff.quantize.fuse): q/k/v and gate/up of an int8 SDAR model as one matmul each give
the same logits as the separate projections (fp32 and bf16 activations, every CPU kernel), the loader fuses int8
loads, a moved weight falls back; the in-place bf16 Llama RMSNorm is bit-identical to its formula."""

from __future__ import annotations

import pytest
import torch

from block_ref import VOCAB, write_upstream
from localdiff.arch.dense import llama_rms_norm
from localdiff.cache.kv import KVCache
from localdiff.loader import load_model
from localdiff.quantize.choose import reset_kernels
from localdiff.quantize.fuse import fuse_model
from localdiff.quantize.int8 import quantize_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("sdar-fuse")
    write_upstream("sdar", f)
    return f


def _ids(t=9, seed=3):
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed))


def _denoise(model, ids, blk):
    cache = KVCache(**model.cache_layout())
    model.prefill(ids[:, : 2 * blk], cache)
    return model.denoise(ids[:, 2 * blk : 3 * blk], cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["native", "int8pack", "dequant"])
def test_fused_logits_equal_the_unfused_ones(folder, dtype, kernel, monkeypatch):
    from localdiff.quantize import choose, int8

    monkeypatch.setenv("LOCALDIFF_INT8_KERNEL", kernel)
    reset_kernels()
    # rows the forced kernel cannot take (native: > 16) go to dequant, not to a per-shape measurement: a measured
    # choice may differ between the fused and the separate shapes (it did at 2 threads), which is not the question
    monkeypatch.setattr(
        int8,
        "cpu_kernel",
        lambda m, k, n, dt=torch.bfloat16: r if (r := choose.cpu_kernel(m, k, n, dt)) == kernel else "dequant",
    )
    model, _ = load_model(folder, dtype=dtype)
    quantize_model(model)
    blk = model.config.block_size
    ids = _ids(t=3 * blk)
    want_full, want_step = model.logits_full(ids), _denoise(model, ids, blk)
    groups = fuse_model(model)
    assert groups == 2 * model.config.num_hidden_layers
    att, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert att.qkv_fused is not None and mlp.gate_up_fused is not None and att.qkv_fused.valid()
    assert att.k_proj.weight.untyped_storage().data_ptr() == att.qkv_fused.weight.untyped_storage().data_ptr()
    calls = []
    orig = type(att.qkv_fused).__call__
    monkeypatch.setattr(type(att.qkv_fused), "__call__", lambda s, x: calls.append(1) or orig(s, x))
    got_full, got_step = model.logits_full(ids), _denoise(model, ids, blk)
    # q/k/v and gate/up per layer in logits_full and denoise; prefill stops after the last layer's q/k/v
    assert len(calls) == 6 * model.config.num_hidden_layers - 1
    torch.testing.assert_close(got_full, want_full, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_step, want_step, rtol=0, atol=1e-6)
    assert torch.equal(got_step.argmax(-1), want_step.argmax(-1))
    reset_kernels()


def test_loader_fuses_int8_and_a_replaced_weight_falls_back(folder):
    model, _ = load_model(folder, dtype=torch.bfloat16, quant="int8")
    att = model.layers[1].self_attn
    assert att.qkv_fused is not None and model.layers[1].mlp.gate_up_fused is not None
    ids = _ids()
    before = model.logits_full(ids)
    att.k_proj.weight = att.k_proj.weight.clone()  # no longer the fused storage's view
    att.k_proj.weight_scale = att.k_proj.weight_scale.clone()
    assert att.qkv_fused.valid()  # the first and last module still sit on it ...
    att.v_proj.weight = att.v_proj.weight.clone()
    assert not att.qkv_fused.valid()  # ... until the last one moves: one by one again
    att.k_proj.weight[0] = 0  # and the separate weights are what runs
    after = model.logits_full(ids)
    assert not torch.equal(after, before)
    float_model, _ = load_model(folder, dtype=torch.bfloat16)
    assert float_model.layers[0].self_attn.qkv_fused is None  # float models are left alone


def test_bf16_rms_norm_in_place_is_bit_identical_to_the_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 37, generator=g).mul_(4).to(torch.bfloat16)
    w = torch.randn(37, generator=g).to(torch.bfloat16)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    x0 = x.clone()
    assert torch.equal(llama_rms_norm(x, w, 1e-6), w * ref)
    assert torch.equal(llama_rms_norm(x, w.float(), 1e-6), w.float() * ref)
    assert torch.equal(llama_rms_norm(x, None, 1e-6), ref)
    assert torch.equal(x, x0)  # the input is untouched
    x32 = torch.randn(4, 37, generator=g)
    x32c = x32.clone()
    llama_rms_norm(x32, w, 1e-6)  # fp32 input, bf16 scale: no in-place on x
    assert torch.equal(x32, x32c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_with_stacked_query_heads_is_bit_identical_to_sdpa(dtype):
    """Attention.attend stacks the query heads of one key-value head when every row sees the same keys (mask None
    or a key-padding mask [B, 1, 1, Lk]); the result equals SDPA's enable_gqa bit for bit."""
    import torch.nn.functional as F

    from localdiff.arch.dense import Attention

    class Cfg:
        hidden_size, head_dim, num_attention_heads, num_key_value_heads = 36, 12, 6, 2
        qkv_bias, qk_norm, clip_qkv, rope_fp32, rms_norm_eps = False, False, None, False, 1e-6

    att = Attention(Cfg()).to(dtype)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, n, 12, generator=g).to(dtype) for h, n in ((6, 4), (2, 23), (2, 23)))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the layout qkv() returns
    keep = torch.rand(2, 23, generator=g) > 0.3
    keep[:, -1] = True
    with torch.inference_mode():
        for mask in (None, keep[:, None, None, :]):
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            want = att.o_proj(want.transpose(1, 2).reshape(2, 4, 72))
            assert torch.equal(att.attend(q, k, v, mask), want)
        full = keep[:, None, None, :].expand(2, 1, 4, 23).clone()
        full[0, 0, 1, :5] = False  # per-row mask: the unstacked path
        want = att.o_proj(
            F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True).transpose(1, 2).reshape(2, 4, 72)
        )
        assert torch.equal(att.attend(q, k, v, full), want)


def test_fused_q_k_norm_and_rope_in_one_tensor_is_bit_identical():
    """Attention.qkv on a fused q/k/v output (q, k adjacent): norms and RoPE on q and k as one tensor equal the
    per-tensor path bit for bit (bf16, odd sizes, partial rotary)."""
    from types import SimpleNamespace

    from localdiff.arch.dense import Attention, rope_cos_sin

    cfg = SimpleNamespace(
        hidden_size=40,
        head_dim=24,
        num_attention_heads=6,
        num_key_value_heads=2,
        qkv_bias=False,
        qk_norm=True,
        rms_norm_eps=1e-6,
        clip_qkv=None,
        rope_fp32=False,
    )
    torch.manual_seed(0)
    att = Attention(cfg).to(torch.bfloat16)
    with torch.no_grad():
        att.q_norm.weight.copy_(torch.randn(24))
        att.k_norm.weight.copy_(torch.randn(24))
    x = torch.randn(2, 5, 40).to(torch.bfloat16)
    w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    cos, sin = rope_cos_sin(torch.rand(8), 7, 5, "cpu")  # rot 16 < head_dim 24
    want = att.qkv(x, cos, sin)
    att.qkv_fused = lambda t: torch.nn.functional.linear(t, w).split([144, 48, 48], dim=-1)
    assert att._qk_together(*att.qkv_fused(x)[:2])
    got = att.qkv(x, cos, sin)
    for g, e in zip(got, want):
        assert g.shape == e.shape and torch.equal(g, e)
