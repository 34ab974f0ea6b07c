"""The int8 × int8-activation kernel (localdiff.kernels.int8_vnni, AVX512-VNNI): its activation quantization against
a test-side transcription (bit for bit), its products against float64 on the same int8 activations for odd shapes and
row counts 1..17 and 33, each row bit-identical alone, in a batch of 16 and at another thread count; the recipe opt-in
``int8_activations = "int8"`` (parsed, recorded, through quantize → load, on linears, fused projections and the int8
head), the switch-off, a small model's logits against the default int8 path, and batched == alone with the opt-in."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from batch_lanes import alone, batched

import localdiff
from arch_baby import BABY, build_baby, forward_roles
from localdiff.kernels import build as native_build
from localdiff.kernels import int8_vnni
from localdiff.quantize import int8
from localdiff.quantize.apply import quantize_model, set_activations
from localdiff.quantize.fuse import fuse_model
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe

SHAPES = [(1, 1), (7, 5), (13, 64), (37, 100), (9, 1024), (65, 1100), (31, 2049)]  # (N, K): tails of 64 and 1024
ROWS = list(range(1, 18)) + [33]


@pytest.fixture(scope="module")
def lib():
    int8_vnni.reset()
    if int8_vnni.library() is None:  # no AVX512-VNNI on this CPU, or no compiler
        pytest.skip(int8_vnni.status())
    return int8_vnni.library()


def _quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transcription: x zero-padded to blocks of 1024; feature k in group 16·(k // 1024) + (k % 64) // 4; per row and
    group amax = max|x|, xi = round_half_even(x · (127 / amax)) in fp32, sx = amax / 127 (zero group: 0, 0).
    Returns (xi int8 [M, 1024·B], sx fp32 [M, 16·B])."""
    m, k = x.shape
    b = (k + 1023) // 1024
    xf = F.pad(x.float(), (0, b * 1024 - k))
    g = torch.arange(b * 1024)
    g = 16 * (g // 1024) + (g % 64) // 4
    assert torch.equal(g, int8_vnni.groups_of(b * 1024))
    amax = torch.zeros(m, 16 * b).scatter_reduce(1, g.expand(m, -1), xf.abs(), "amax")
    a = amax[:, g]
    xi = torch.where(a > 0, torch.round(xf * (torch.tensor(127.0) / a)).clamp(-127, 127), torch.zeros_like(xf))
    sx = torch.where(amax > 0, amax / torch.tensor(127.0), torch.zeros_like(amax))
    return xi.to(torch.int8), sx


def _ref(x, q, s):
    """float64 (xi · sx) @ (q · s)ᵀ on the transcribed int8 activations."""
    xi, sx = _quant_ref(x)
    k = x.shape[1]
    xq = (xi.double() * sx.double()[:, int8_vnni.groups_of(xi.shape[1])])[:, :k]
    return (xq @ q.double().T) * s.double()


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def test_activation_quantization_is_the_transcription(lib):
    torch.manual_seed(0)
    for k in (1, 64, 100, 1024, 1100, 2049):
        for dt in (torch.float32, torch.bfloat16):
            x = (torch.randn(5, k) * torch.logspace(-3, 2, k)).to(dt)
            x[1] = 0  # all-zero groups
            x[2, 0] = 1e4  # an outlier: the rest of its group rounds to small codes
            xi, sx = int8_vnni.quantize(x)
            rxi, rsx = _quant_ref(x)
            assert torch.equal(xi, rxi) and torch.equal(sx, rsx), (k, dt)
            assert xi.abs().max() <= 127 and (sx[1] == 0).all()


def test_matmul_equals_float64_on_the_quantized_activations(lib):
    """Every shape, row count, bf16 / fp32 x: ≤ 2e-6 relative against float64 on the same int8 activations; 1 and 2
    threads bit-equal; bf16 output = the fp32 result cast; one changed weight caught."""
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n * k)
        q, s = int8.quantize_tensor(torch.randn(n, k, generator=g) * 0.05)
        for m in ROWS:
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dt)
                out = int8_vnni.matmul(x, q, s, threads=1, out_dtype=torch.float32)
                assert out.dtype == torch.float32 and out.shape == (m, n)
                rel = _rel(out, _ref(x, q, s))
                assert rel <= 2e-6, (n, k, m, dt, rel)
                if m in (3, 17, 33):
                    assert torch.equal(int8_vnni.matmul(x, q, s, threads=2, out_dtype=torch.float32), out)
                    assert torch.equal(int8_vnni.matmul(x, q, s, threads=1, out_dtype=torch.bfloat16), out.bfloat16())
                    assert int8_vnni.matmul(x, q, s, threads=1).dtype == dt
    n, k = SHAPES[-1]
    q, s = int8.quantize_tensor(torch.randn(n, k) * 0.05)
    x = torch.randn(1, k)
    bad = q.clone()
    bad[3, 2040] += 9
    assert _rel(int8_vnni.matmul(x, bad, s, 1), _ref(x, q, s)) > 1e-4
    with pytest.raises(ValueError):
        int8_vnni.matmul(x, q[:, :-1], s)


def test_each_row_is_the_same_alone_in_a_batch_and_at_any_thread_count(lib):
    """The batching contract (localdiff.engine.row_policy): a row's output bits do not depend on the other rows of
    the call (1, 4, 16, 64 rows, at any position), nor on the threads splitting N."""
    torch.manual_seed(2)
    for n, k in ((67, 1100), (40, 2048)):
        q, s = int8.quantize_tensor(torch.randn(n, k) * 0.05)
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(64, k).to(dt)
            full = int8_vnni.matmul(x, q, s, threads=1)
            for a, b in ((0, 1), (5, 6), (0, 4), (7, 11), (0, 16), (21, 37), (48, 64)):
                assert torch.equal(int8_vnni.matmul(x[a:b], q, s, threads=1), full[a:b]), (n, dt, a, b)
                assert torch.equal(int8_vnni.matmul(x[a:b], q, s, threads=2), full[a:b]), (n, dt, a, b)
            assert torch.equal(int8_vnni.matmul(x[:16], q, s, threads=3), full[:16])


def _linear(k=200, n=70, bias=False):
    torch.manual_seed(0)
    return int8.Int8Linear.from_linear(torch.nn.Linear(k, n, bias=bias))


def test_int8_linear_opt_in_runs_vnni_up_to_vnni_rows_only(lib):
    lin = _linear(bias=True)
    w, s = lin.weight, lin.weight_scale
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            for m in (1, 2, 8, int8.VNNI_ROWS // 2, int8.VNNI_ROWS // 2 + 1):
                x = torch.randn(2, m, 200).to(dt)  # leading dims flattened to 2m rows
                exact = lin(x)
                lin.act_int8 = True
                got = lin(x)
                lin.act_int8 = False
                if 2 * m <= int8.VNNI_ROWS:
                    want = int8_vnni.matmul(x.reshape(-1, 200), w, s) + lin.bias.to(dt)
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
        monkeypatch.setenv(int8_vnni.ENV, "0")
        int8_vnni.reset()
        try:
            assert int8_vnni.library() is None and "off" in int8_vnni.status()
            off = lin(x)
            lin.act_int8 = False
            assert torch.equal(off, lin(x)) and not torch.equal(off, vnni)
        finally:
            monkeypatch.undo()
            int8_vnni.reset()


def test_recipe_key_is_parsed_recorded_and_validated():
    base = {"name": "r", "rules": [["*proj", "int8"]]}
    assert (
        Recipe.from_dict(base).int8_activations == "float"
        and "int8_activations" not in Recipe.from_dict(base).to_dict()
    )
    r = Recipe.from_dict(base | {"int8_activations": "int8"})
    assert r.int8_activations == "int8" and r.with_precision("int4").int8_activations == "int8"
    assert Recipe.from_dict(r.to_dict()) == r and r.to_dict()["int8_activations"] == "int8"
    with pytest.raises(RecipeError, match="int8_activations 'int4'"):
        Recipe.from_dict(base | {"int8_activations": "int4"})


def _sdar_models():
    net = build_baby(BABY["sdar"], seed=3).to(torch.bfloat16)
    recipe = replace(load_recipe("sdar"), head="int8", embeddings="float")
    exact = quantize_model(copy.deepcopy(net), recipe, quant="int8")
    opted = quantize_model(copy.deepcopy(net), replace(recipe, int8_activations="int8"), quant="int8")
    for m in (exact, opted):
        fuse_model(m)
    return exact, opted


def test_recipe_opt_in_on_a_small_model(lib, monkeypatch):
    """SDAR's recipe (int8, an int8 head copy) with ``int8_activations = "int8"``: every int8 linear and the head opt
    in, q/k/v and gate/up still fuse; denoising logits stay close to the default int8 path (top-1 agreement
    reported); without the key, or with the kernel switched off, the logits are the default path's bit for bit."""
    exact, opted = _sdar_models()
    assert not any(getattr(m, "act_int8", False) for m in exact.modules())
    lins = [m for m in opted.modules() if isinstance(m, int8.Int8Linear)]
    assert lins and all(m.act_int8 for m in lins)
    assert isinstance(opted.head_int8, int8.Int8Head) and opted.head_int8.act_int8
    assert all(getattr(m, "qkv_fused", 1) is not None for m in opted.modules() if hasattr(m, "q_proj"))
    assert set_activations(exact, load_recipe("sdar")) == 0
    ids = torch.randint(2, exact.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a, b = forward_roles(exact, ids)["denoise"], forward_roles(opted, ids)["denoise"]
        monkeypatch.setenv(int8_vnni.ENV, "0")
        int8_vnni.reset()
        try:
            b_off = forward_roles(opted, ids)["denoise"]
        finally:
            monkeypatch.undo()
            int8_vnni.reset()
    assert torch.equal(b_off, a) and not torch.equal(a, b)
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
    print(f"int8 activations vs the default int8 path: top-1 agreement {top1:.3f}, relative L2 {rel:.4f}")
    assert top1 >= 0.75 and rel < 0.1, (top1, rel)


def test_quantize_then_load_keeps_the_opt_in(lib, tmp_path):
    from localdiff.paths import models_dir
    from localdiff.quantize.io import quantize_checkpoint

    recipe = replace(DEFAULT_RECIPE, int8_activations="int8")
    quantize_checkpoint(models_dir() / "tiny-bd", tmp_path / "q8", recipe=recipe, quant="int8")
    m = localdiff.load(tmp_path / "q8", device="cpu", dtype=torch.float32)
    lins = [x for x in m.net.modules() if isinstance(x, int8.Int8Linear)]
    assert lins and all(x.act_int8 for x in lins) and m.net.quant_recipe.int8_activations == "int8"
    plain = localdiff.load("tiny-bd", device="cpu", dtype=torch.float32, quant="int8")
    assert not any(getattr(x, "act_int8", False) for x in plain.net.modules())


def test_batched_requests_equal_alone_with_the_opt_in(lib):
    """tiny-bd (int8) with the opt-in: the lanes' packed block steps share the VNNI matmuls (the row policy's
    "vnni" class) and every request's tokens equal the same request run alone."""
    from localdiff.engine.batch import RowPolicy

    m = localdiff.load("tiny-bd", quant="int8")
    assert set_activations(m.net, replace(m.net.quant_recipe, int8_activations="int8")) > 0
    policy = RowPolicy(m.net)
    assert set(policy.token("mlp", 0, torch.float32, 12)) == {"vnni"}
    assert policy.pack("mlp", [4, 4, 4], 0, torch.float32) == [[0, 1, 2]]
    assert policy.pack("mlp", [40, 40], 0, torch.float32) == [[0], [1]]  # 80 rows: past VNNI_ROWS, another kernel
    reqs = []
    for i, p in enumerate(["What is 41 + 93?", "hi", "Tell me a story about a cat that", "2 * 7 ="]):
        r = {"prompt": p, "max_new_tokens": (9, 12, 16, 20)[i], "seed": 10 + i}
        if i % 2:
            r["temperature"] = 0.7
        reqs.append(r)
    want = [alone(m, r) for r in reqs]
    got, b, widths = batched(m, reqs, [0, 0, 2, 1])
    assert got == want and max(widths) >= 3 and b.rows_total > 0


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")
def test_a_build_without_vnni_says_so(tmp_path):
    """The portable build (no -march=native) has no VNNI path: the library loads, says unavailable, and its calls
    write nothing (-3); the kernel's status line then says why and Int8Linear keeps the exact path."""
    lib = int8_vnni.load(int8_vnni._KERNEL.build(native_build.compiler(), native_build.PORTABLE_FLAGS, tmp_path))
    assert lib.localdiff_int8_vnni_available() == 0
    y = torch.full((2, 3), 7.0)
    x = torch.ones(2, 64)
    q, s = int8.quantize_tensor(torch.randn(3, 64))
    rc = lib.localdiff_int8_vnni_mm(x.data_ptr(), 0, 64, 2, 64, q.data_ptr(), 3, s.data_ptr(), 1, y.data_ptr(), 0, 3, 1)
    assert rc == -3 and (y == 7).all()
    line = int8_vnni._ready(lib, "cc", native_build.PORTABLE_FLAGS)
    assert line[0] is None and "no AVX512-VNNI" in line[1]
