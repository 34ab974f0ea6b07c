"""int4 on CUDA (``localdiff.quantize.cuda4``), checked on the CPU: the backend choice, tinygemm's constants and
layout (through torch's CPU tinygemm, the same dequantization formula), bitsandbytes' NF4 requantization (its CPU
build), and a whole model converted as the loader does on CUDA. The CUDA timings run in ``.ci/gpu_check.sh``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from arch_baby import BABY, build_baby, forward_roles
from localdiff.errors import LocaldiffError
from localdiff.quantize import cuda4, int4
from localdiff.quantize.apply import quantize_model
from localdiff.quantize.fuse import fuse_model


def test_choose_backend():
    bf = torch.bfloat16
    assert cuda4.choose("cpu", bf, 2048, 6144, env="bnb") == "native"  # the native kernel on CPU
    assert cuda4.choose("cuda", bf, 2048, 6144, env="") == "tinygemm"
    assert cuda4.choose("cuda", bf, 2048, 6144, env="auto") == "tinygemm"
    assert cuda4.choose("cuda", torch.float32, 2048, 6144, env="") == "dequant"  # tinygemm takes bf16 only
    assert cuda4.choose("cuda", bf, 2000, 6144, env="tinygemm") == "dequant"  # in % 128 != 0
    assert cuda4.choose("cuda", bf, 2048, 6136, env="") == "dequant"  # out % 16 != 0
    assert cuda4.choose("cuda", bf, 2048, 6144, env="dequant") == "dequant"
    assert cuda4.choose("cuda", bf, 2048, 6144, env="bnb", bnb=True) == "bnb"
    with pytest.raises(LocaldiffError, match="needs bitsandbytes"):
        cuda4.choose("cuda", bf, 2048, 6144, env="bnb", bnb=False)
    with pytest.raises(LocaldiffError, match="LOCALDIFF_CUDA_INT4='nf3'"):
        cuda4.choose("cuda", bf, 2048, 6144, env="nf3")


def _int4_linear(n, k, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)
    return int4.Int4Linear.from_linear(lin)


def test_tinygemm_constants_reproduce_our_dequantization():
    q = _int4_linear(40, 256)
    sz = cuda4.tinygemm_constants(q.weight_scale, q.weight_zero)
    assert sz.shape == (4, 40, 2) and sz.dtype == torch.bfloat16
    ours = int4.dequantize(q.weight, q.weight_scale, q.weight_zero, dtype=torch.float64)
    theirs = cuda4.tinygemm_dequantize(int4.unpack_codes(q.weight), sz).double()
    s = q.weight_scale.double().repeat_interleave(64, 1)
    bound = (s * (8 - q.weight_zero.double().repeat_interleave(64, 1))).abs() * 2.0**-8  # bf16 zt rounding
    assert ((ours - theirs).abs() <= bound).all()
    assert (ours - theirs).abs().max() <= s.max() / 32  # a small fraction of one step


@pytest.mark.parametrize("n,k,m,bias", [(48, 256, 1, False), (32, 384, 5, True), (64, 128, 17, False)])
def test_tinygemm_linear_equals_its_dequantization(n, k, m, bias):
    q = _int4_linear(n, k, bias=bias, seed=n)
    t = cuda4.TinygemmLinear(q)
    x = torch.randn(2, m, k)
    ref = (
        x.to(torch.bfloat16).double()
        @ cuda4.tinygemm_dequantize(int4.unpack_codes(q.weight), t.scales_and_zeros).double().t()
    )
    if bias:
        ref = ref + q.bias.double()
    y = t(x)
    assert y.shape == (2, m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())  # bf16 output


def test_bnb_nf4_requantization_error_is_bounded():
    pytest.importorskip("bitsandbytes")
    q = _int4_linear(64, 256)
    b = cuda4.BnbNF4Linear(q)
    x = torch.randn(3, 256)
    ref = x.double() @ int4.dequantize(q.weight, q.weight_scale, q.weight_zero, dtype=torch.float64).t()
    err = (b(x).double() - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.15  # a second 4-bit rounding (NF4 has no zero point): close, not equal


def test_convert_model_as_on_cuda_unfuses_and_keeps_logits():
    raw = dict(
        BABY["sdar"], hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )  # every projection tinygemm-shaped (in % 128, out % 16)
    net = build_baby(raw, seed=2).to(torch.bfloat16)
    qnet = quantize_model(copy.deepcopy(net), quant="int4")
    fuse_model(qnet)
    ids = torch.randint(2, qnet.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    before = forward_roles(qnet, ids)
    counts = cuda4.convert_model(qnet, env="", force_device="cuda")
    assert counts == {"tinygemm": 7 * raw["num_hidden_layers"]}, counts
    assert not any(isinstance(m, int4.Int4Linear) for m in qnet.modules())
    assert all(
        getattr(m, "qkv_fused", None) is None and getattr(m, "gate_up_fused", None) is None for m in qnet.modules()
    )
    after = forward_roles(qnet, ids)
    for role in before:  # the same int4 weights through tinygemm's formula: bf16-close, same top-1 mostly
        agree = (before[role].argmax(-1) == after[role].argmax(-1)).float().mean().item()
        assert agree >= 0.9, (role, agree)


def test_gpu_check_script_runs_its_exactness_part_on_cpu(capsys):
    from localdiff.bench import int4_cuda

    res = int4_cuda.exactness(torch.device("cpu"))
    for name, r in res.items():
        assert all(v < (0.15 if "nf4" in name else 2e-2) for v in r.values()), (name, r)
    assert any(name.startswith("tinygemm") for name in res)
    if not torch.cuda.is_available():
        assert int4_cuda.main([]) == 0 and "no CUDA device" in capsys.readouterr().out
