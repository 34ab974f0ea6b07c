"""The int4 × int8-activation kernel (localdiff.kernels.int4_vnni, AVX512-VNNI): its activation quantization against
a test-side transcription (bit for bit), its products against float64 on the same quantized activations for odd
shapes and every row count 1..17 and 256, the grouped call against the per-expert loop, and the recipe opt-in."""

from __future__ import annotations

import pytest
import torch

from localdiff.kernels import build as native_build
from localdiff.kernels import int4_vnni
from localdiff.quantize import int4
from localdiff.quantize.recipe import Recipe, RecipeError

SHAPES = [(1, 1), (7, 5), (13, 64), (37, 100), (9, 129), (65, 257), (31, 1100), (17, 2049)]  # (N, K)
ROWS = list(range(1, 18)) + [256]


@pytest.fixture(scope="module")
def lib():
    int4_vnni.reset()
    if int4_vnni.library() is None:  # no AVX512-VNNI on this CPU, or no compiler
        pytest.skip(int4_vnni.status())
    return int4_vnni.library()


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, : min(k, 70)] += 0.3  # a group off-centre: its zero point is not near 7.5
    return w


def _quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transcription: per row and group of 64 (zero-padded), amax = max|x|, xi = round_half_even(x · (127 / amax))
    in fp32, sx = amax / 127 (a zero group: xi = 0, sx = 0)."""
    m, k = x.shape
    g = (k + 63) // 64
    xf = torch.nn.functional.pad(x.float(), (0, g * 64 - k)).view(m, g, 64)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.tensor(127.0) / amax
    xi = torch.where(amax > 0, torch.round(xf * inv).clamp(-127, 127), torch.zeros_like(xf))
    sx = torch.where(amax > 0, amax / torch.tensor(127.0), torch.zeros_like(amax))
    return xi.to(torch.int8).view(m, g * 64), sx.view(m, g)


def _ref(x, p, s, z, k):
    """float64 (xi · sx) @ dequantize(p, s, z)ᵀ with the transcribed activation quantization."""
    xi, sx = _quant_ref(x)
    xq = (xi.double().view(x.shape[0], -1, 64) * sx.double()[..., None]).view(x.shape[0], -1)[:, :k]
    return xq @ int4.dequantize(p, s, z, k, torch.float64).T


def test_activation_quantization_is_the_transcription(lib):
    torch.manual_seed(0)
    for k in (1, 64, 100, 257, 1100):
        for dt in (torch.float32, torch.bfloat16):
            x = (torch.randn(5, k) * torch.logspace(-3, 2, k)).to(dt)
            x[1, :64] = 0  # an all-zero group
            x[2, 0] = 1e4  # an outlier: the rest of its group rounds to small codes
            xi, sx = int4_vnni.quantize(x)
            rxi, rsx = _quant_ref(x)
            assert torch.equal(xi, rxi) and torch.equal(sx, rsx), (k, dt)
            assert xi.abs().max() <= 127 and (sx[1, 0] == 0 or k < 64)


def test_matmul_equals_float64_on_the_quantized_activations(lib):
    """Every shape, row count, bf16 / fp32 x: relative max error ≤ 2e-6 against float64 on the same int8
    activations (fp32 summation), 1 and 3 threads bit-equal; one changed code is caught."""
    for n, k in SHAPES:
        p, s, z = int4.quantize_tensor(_weights(n, k, seed=n * k))
        for m in ROWS:
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dt)
                ref = _ref(x, p, s, z, k)
                out = int4_vnni.matmul(x, p, s, z, threads=1, out_dtype=torch.float32)
                assert out.dtype == torch.float32 and out.shape == (m, n)
                rel = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= 2e-6, (n, k, m, dt, rel)
                if m in (5, 256):
                    assert torch.equal(int4_vnni.matmul(x, p, s, z, threads=3, out_dtype=torch.float32), out)
                    bf = int4_vnni.matmul(x, p, s, z, threads=1, out_dtype=torch.bfloat16)
                    assert torch.equal(bf, out.to(torch.bfloat16))  # rounded once, as a cast
    n, k = SHAPES[-1]
    p, s, z = int4.quantize_tensor(_weights(n, k))
    x = torch.randn(4, k)
    bad = p.clone()
    bad[3, 17] ^= 1
    rel = (
        (int4_vnni.matmul(x, bad, s, z, 1).double() - _ref(x, p, s, z, k)).abs().max() / _ref(x, p, s, z, k).abs().max()
    ).item()
    assert rel > 1e-4, rel


def test_grouped_call_equals_the_per_expert_loop(lib):
    torch.manual_seed(1)
    e, n, k = 5, 33, 200
    p, s, z = int4.quantize_tensor(torch.randn(e, n, k) * 0.05)
    counts = [3, 0, 17, 1, 9]  # an expert with no rows
    off = torch.tensor([0] + counts).cumsum(0)
    for dt in (torch.float32, torch.bfloat16):
        xs = torch.randn(int(off[-1]), k).to(dt)
        got = int4_vnni.grouped_matmul(xs, off, p, s, z, threads=1)
        assert got.dtype == dt
        for i in range(e):
            a, b = int(off[i]), int(off[i + 1])
            if b > a:
                assert torch.equal(got[a:b], int4_vnni.matmul(xs[a:b], p[i], s[i], z[i], threads=1)), (dt, i)
    with pytest.raises(ValueError):
        int4_vnni.grouped_matmul(xs, off[1:], p, s, z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_experts_with_int8_activations(lib, dtype):
    """Int4Experts with ``act_int8``: the grouped forward equals the per-expert loop (expert_ffn) bit for bit, runs
    the VNNI kernel, and stays close to the exact int4 experts (activation rounding only)."""
    from localdiff.arch.layers import MoEExperts

    torch.manual_seed(0)
    ex = MoEExperts(6, 100, 40)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    q = int4.Int4Experts.from_experts(ex)
    x = torch.randn(9, 100).to(dtype)
    index = torch.tensor([[0, 2], [2, 5], [0, 5], [2, 0], [5, 2], [0, 2], [2, 5], [5, 0], [0, 2]])
    weights = torch.rand(9, 2)
    with torch.inference_mode():
        exact = q(x, weights, index)
        q.act_int8 = True
        got = q(x, weights, index)
        want = MoEExperts.forward(q, x, weights, index)
    assert torch.equal(got, want) and not torch.equal(got, exact)
    rel = ((got.float() - exact.float()).abs().max() / exact.float().abs().max()).item()
    assert rel < 0.05, rel


def test_recipe_opt_in(tmp_path):
    from localdiff.quantize.apply import quantize_model
    from localdiff.arch.layers import MoEExperts

    base = {"name": "r", "rules": [["*experts", "int8"]]}
    assert Recipe.from_dict(base).int4_activations == "float"
    r = Recipe.from_dict(base | {"int4_activations": "int8"})
    assert r.int4_activations == "int8" and r.with_precision("int4").int4_activations == "int8"
    assert Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(RecipeError, match="int4_activations"):
        Recipe.from_dict(base | {"int4_activations": "int4"})

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = MoEExperts(2, 64, 32)

    for recipe, want in ((r, True), (Recipe.from_dict(base), False)):
        net = quantize_model(Net(), recipe, quant="int4")
        assert isinstance(net.experts, int4.Int4Experts) and net.experts.act_int8 is want


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")
def test_a_build_without_vnni_says_so(tmp_path, monkeypatch):
    """The portable build (no -march=native) has no VNNI path: the library loads, says unavailable, and its grouped
    call writes nothing (-3); Int4Experts with act_int8 then keep the exact kernels."""
    lib = int4_vnni.load(int4_vnni._KERNEL.build(native_build.compiler(), native_build.PORTABLE_FLAGS, tmp_path))
    assert lib.localdiff_int4_vnni_available() == 0
    y = torch.full((2, 3), 7.0)
    x = torch.zeros(2, 64)
    p, s, z = int4.quantize_tensor(torch.randn(1, 3, 64))
    rc = lib.localdiff_int4_vnni_mm_grouped(
        x.data_ptr(),
        0,
        64,
        torch.tensor([0, 2]).data_ptr(),
        1,
        1,
        p.data_ptr(),
        3,
        s.data_ptr(),
        z.data_ptr(),
        y.data_ptr(),
        3,
        1,
        0,
    )
    assert rc == -3 and (y == 7).all()
    line = int4_vnni._ready(lib, "cc", native_build.PORTABLE_FLAGS)
    assert line[0] is None and "no AVX512-VNNI" in line[1]
    monkeypatch.setenv(int4_vnni.ENV, "0")
    int4_vnni.reset()
    try:
        assert int4_vnni.library() is None and "off" in int4_vnni.status()
        ex = int4.Int4Experts(2, 64, 32)
        ex.act_int8 = True
        assert not ex._vnni(torch.zeros(1, 64))
        with pytest.raises(RuntimeError, match="off"):
            int4_vnni.quantize(torch.zeros(1, 64))
    finally:
        monkeypatch.undo()
        int4_vnni.reset()
