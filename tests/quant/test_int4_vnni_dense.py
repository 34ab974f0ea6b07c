"""The dense int4 × int8-activation path (``localdiff_int4_vnni_mm``, :func:`localdiff.kernels.int4_vnni.dense_matmul`):
its products against float64 on the same int8-quantized activations for odd shapes and every row count 1..17 and 256,
1 and 3 threads bit-equal, a row's result independent of the other rows; the recipe opt-in on dense int4 layers
(linears, fused q/k/v and gate/up, the int4 table's head) and the fallbacks: ``LOCALDIFF_NATIVE_INT4_VNNI=0`` and
recipes without ``int4_activations = "int8"`` run the exact kernels, bit for bit as before."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from arch_baby import BABY, build_baby, forward_roles
from localdiff.kernels import int4_vnni
from localdiff.quantize import int4
from localdiff.quantize.apply import quantize_model, set_activations
from localdiff.quantize.embedding import QuantEmbedding
from localdiff.quantize.fuse import fuse_model
from localdiff.quantize.recipe import load_recipe

SHAPES = [(1, 1), (7, 5), (13, 64), (37, 100), (9, 129), (65, 257), (31, 1100), (17, 2049)]  # (N, K)
ROWS = list(range(1, 18)) + [256]


@pytest.fixture(scope="module")
def lib():
    int4_vnni.reset()
    if int4_vnni.library() is None:  # no AVX512-VNNI on this CPU, or no compiler
        pytest.skip(int4_vnni.status())
    return int4_vnni.library()


def _quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transcription of the activation quantization: per row and group of 64 (zero-padded), amax = max|x|,
    xi = round_half_even(x · (127 / amax)) in fp32, sx = amax / 127 (a zero group: xi = 0, sx = 0)."""
    m, k = x.shape
    g = (k + 63) // 64
    xf = torch.nn.functional.pad(x.float(), (0, g * 64 - k)).view(m, g, 64)
    amax = xf.abs().amax(-1, keepdim=True)
    xi = torch.where(amax > 0, torch.round(xf * (torch.tensor(127.0) / amax)).clamp(-127, 127), torch.zeros_like(xf))
    sx = torch.where(amax > 0, amax / torch.tensor(127.0), torch.zeros_like(amax))
    return xi, sx


def _ref(x, p, s, z, k):
    """float64 (xi · sx) @ dequantize(p, s, z)ᵀ on the transcribed int8 activations."""
    xi, sx = _quant_ref(x)
    xq = (xi.double() * sx.double()).view(x.shape[0], -1)[:, :k]
    return xq @ int4.dequantize(p, s, z, k, torch.float64).T


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def test_dense_matmul_equals_float64_on_the_quantized_activations(lib):
    """Every shape, row count, bf16 / fp32 x: ≤ 2e-6 relative against float64 on the same int8 activations; 1 and 3
    threads bit-equal; each row as computed alone; bf16 output = the fp32 result cast; one changed code caught."""
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n * k)
        w = torch.randn(n, k, generator=g) * 0.05
        w[0, : min(k, 70)] += 0.3  # a group off-centre: its zero point is not near 7.5
        p, s, z = int4.quantize_tensor(w)
        for m in ROWS:
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dt)
                out = int4_vnni.dense_matmul(x, p, s, z, threads=1, out_dtype=torch.float32)
                assert out.dtype == torch.float32 and out.shape == (m, n)
                rel = _rel(out, _ref(x, p, s, z, k))
                assert rel <= 2e-6, (n, k, m, dt, rel)
                if m in (3, 17, 256):
                    assert torch.equal(int4_vnni.dense_matmul(x, p, s, z, threads=3, out_dtype=torch.float32), out)
                    assert torch.equal(int4_vnni.dense_matmul(x[m - 1 :], p, s, z, 1, torch.float32), out[m - 1 :])
                    bf = int4_vnni.dense_matmul(x, p, s, z, threads=1, out_dtype=torch.bfloat16)
                    assert torch.equal(bf, out.to(torch.bfloat16))
    n, k = SHAPES[-1]
    p, s, z = int4.quantize_tensor(torch.randn(n, k) * 0.05)
    x = torch.randn(1, k)
    bad = p.clone()
    bad[3, 17] ^= 1
    assert _rel(int4_vnni.dense_matmul(x, bad, s, z, 1), _ref(x, p, s, z, k)) > 1e-4
    with pytest.raises(ValueError):
        int4_vnni.dense_matmul(x, p[:, :-1], s, z)


def _linear(k=200, n=70, bias=True):
    torch.manual_seed(0)
    return int4.Int4Linear.from_linear(torch.nn.Linear(k, n, bias=bias))


def test_int4_linear_opt_in_runs_vnni_below_vnni_rows_only(lib):
    lin = _linear()
    p, s, z = lin.weight, lin.weight_scale, lin.weight_zero
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            for m in (1, 4, 15, 16, int4.VNNI_ROWS):
                x = torch.randn(2, m, 200).to(dt)  # leading dims flattened to 2m rows
                exact = lin(x)
                assert torch.equal(exact, int4.int4_matmul(x, p, s, z) + lin.bias.to(dt))
                lin.act_int8 = True
                got = lin(x)
                lin.act_int8 = False
                if 2 * m < int4.VNNI_ROWS:
                    want = int4_vnni.dense_matmul(x.reshape(-1, 200), p, s, z) + lin.bias.to(dt)
                    assert torch.equal(got, want.view_as(got)) and not torch.equal(got, exact), (dt, m)
                    assert _rel(got.float(), exact.double()) < 0.05
                else:
                    assert torch.equal(got, exact), (dt, m)


def test_switch_off_falls_back_to_the_exact_kernel(lib, monkeypatch):
    lin = _linear()
    lin.act_int8 = True
    x = torch.randn(3, 200).to(torch.bfloat16)
    with torch.inference_mode():
        vnni = lin(x)
        monkeypatch.setenv(int4_vnni.ENV, "0")
        int4_vnni.reset()
        try:
            off = lin(x)
            lin.act_int8 = False
            assert torch.equal(off, lin(x)) and not torch.equal(off, vnni)
        finally:
            monkeypatch.undo()
            int4_vnni.reset()


def _sdar_models():
    raw = BABY["sdar"]
    net = build_baby(raw, seed=3).to(torch.bfloat16)
    recipe = load_recipe("sdar")
    exact = quantize_model(copy.deepcopy(net), recipe, quant="int4")
    opted = quantize_model(copy.deepcopy(net), replace(recipe, int4_activations="int8"), quant="int4")
    for m in (exact, opted):
        fuse_model(m)
    return net, exact, opted


def test_recipe_opt_in_on_a_dense_model(lib, monkeypatch):
    """SDAR's recipe with ``int4_activations = "int8"``: every int4 linear and the int4 table (the tied head) opt
    in, q/k/v and gate/up still fuse; few-row denoising logits change (activation rounding only: top-1 mostly
    kept). Without the key nothing opts in and the logits are bit-equal to the exact kernels' (VNNI switched off)."""
    _, exact, opted = _sdar_models()
    assert not any(getattr(m, "act_int8", False) for m in exact.modules())
    mods = [m for m in opted.modules() if isinstance(m, (int4.Int4Linear, QuantEmbedding))]
    assert mods and all(m.act_int8 for m in mods)
    assert any(isinstance(m, QuantEmbedding) and m.precision == "int4" for m in mods)
    assert all(getattr(m, "qkv_fused", 1) is not None for m in opted.modules() if hasattr(m, "q_proj"))
    assert set_activations(exact, load_recipe("sdar")) == 0
    ids = torch.randint(2, exact.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a, b = forward_roles(exact, ids)["denoise"], forward_roles(opted, ids)["denoise"]
        monkeypatch.setenv(int4_vnni.ENV, "0")
        int4_vnni.reset()
        try:
            a_off, b_off = forward_roles(exact, ids)["denoise"], forward_roles(opted, ids)["denoise"]
        finally:
            monkeypatch.undo()
            int4_vnni.reset()
    assert torch.equal(a, a_off) and torch.equal(b_off, a)  # no key / switch off: the exact kernels, bit for bit
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.5


def test_opt_in_reaches_an_int4_head_copy():
    """A float table with an int4 head copy (``Int4Head``): the opt-in covers the copy too, and the recipe records
    the key (pre-quantized checkpoints: the loader re-applies it after making the copy)."""
    raw = BABY["sdar"]
    net = build_baby(raw, seed=3)
    recipe = replace(load_recipe("sdar"), int4_embeddings=None, int4_activations="int8")
    q = quantize_model(net, recipe, quant="int4")
    assert isinstance(q.head_int8, int4.Int4Head) and q.head_int8.act_int8
    assert q.quant_recipe.to_dict()["int4_activations"] == "int8"
