"""The native small-M int8 matmul (localdiff.kernels.int8): numerics against dequantize-then-matmul in float64,
both of its paths (AMX-INT8 where this CPU has it, the fp32-FMA kernel everywhere), thread counts, a portable
build, the fallback without a compiler, and a whole int8 block model against the torch int8 path."""

from __future__ import annotations

import copy
import platform
import shutil

import pytest
import torch

from localdiff.kernels import int8 as native
from localdiff.quantize.choose import kernel_summary, reset_kernels
from localdiff.quantize.int8 import dequantize, int8_matmul, quantize_model, quantize_tensor

SHAPES = [(1, 1), (7, 5), (13, 33), (37, 100), (9, 17), (65, 257), (31, 1100), (17, 2049)]  # (N, K): odd, K % 16
needs_lib = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch):
    """The native library and kernel table rebuilt for the test's environment, and again afterwards."""
    reset_kernels()
    yield monkeypatch
    monkeypatch.undo()
    reset_kernels()


def _rel(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _check_paths(threads=(1, 2)):
    """Every M in 1..17, every shape, bf16 and fp32 x: within 1e-6 relative (fp32 out) of float64, threads equal."""
    torch.manual_seed(0)
    for n, k in SHAPES:
        q, s = quantize_tensor(torch.randn(n, k))
        deq = dequantize(q, s).double()
        for m in range(1, 18):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dt)
                ref = x.double() @ deq.T
                outs = [native.matmul(x, q, s, threads=t) for t in threads]
                assert outs[0].dtype == dt and outs[0].shape == (m, n)
                tol = 1e-5 if dt == torch.float32 else 8e-3  # bf16 output: its own rounding
                assert _rel(outs[0], ref) < tol, (n, k, m, dt)
                for o in outs[1:]:
                    assert torch.equal(o, outs[0]), (n, k, m, dt, "thread counts differ")
                if dt == torch.float32:  # fp32 out: compare the sums themselves
                    assert _rel(outs[0], ref) < 1e-6, (n, k, m)


@needs_lib
def test_native_default_path_matches_float64(fresh):
    assert native.library() is not None, native.status()
    _check_paths()


@needs_lib
def test_native_fma_path_matches_float64(fresh):
    fresh.setenv("LOCALDIFF_NATIVE_INT8", "fma")
    assert native.library() is not None and "AMX" not in native.status()
    _check_paths()


@needs_lib
def test_amx_path_when_available(fresh):
    lib = native.library()
    if not lib.localdiff_int8_has_amx():
        pytest.skip("this CPU / build has no AMX-INT8 (the FMA path is tested above)")
    assert "AMX-INT8" in native.status()
    # bf16 activations spanning < 20 binades are represented exactly: equal to float64 up to the output rounding
    torch.manual_seed(1)
    q, s = quantize_tensor(torch.randn(48, 320))
    x = (torch.randn(4, 320) * torch.exp2(torch.randint(-9, 9, (4, 320)).float())).to(torch.bfloat16)
    ref = (x.double() @ dequantize(q, s).double().T).float()
    y = native.matmul(x.float(), q, s)
    assert _rel(y, ref.double()) < 1e-6


ROW_COUNTS = list(range(1, 18)) + [256]


def _bf16_path(x, q, s, threads=1, y_bf16=False):
    """The AVX512-BF16 path called directly: bf16 x [M, K] → fp32 (or bf16) y [M, N]."""
    m, k = x.shape
    y = torch.empty(m, q.shape[0], dtype=torch.bfloat16 if y_bf16 else torch.float32)
    rc = native.library().localdiff_int8_mm_bf16(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        q.data_ptr(),
        q.shape[0],
        s.data_ptr(),
        int(s.dtype == torch.bfloat16),
        y.data_ptr(),
        int(y_bf16),
        q.shape[0],
        threads,
    )
    assert rc == 0
    return y


@needs_lib
def test_bf16_dot_path_exact_products_and_row_exact(fresh):
    """The AVX512-BF16 path: within 1e-6 relative of float64 (exact bf16 × int8 products, fp32 sums) for every row
    count 1..17 and 256 (register-converted weights up to 4 rows, the buffered conversion above), each row equal bit
    for bit to the same row alone, at 1 and 3 threads, its bf16 output the rounding of its fp32 output; and
    native.matmul takes it for bf16 x (unless LOCALDIFF_NATIVE_INT8=fma)."""
    lib = native.library()
    if not lib.localdiff_int8_has_bf16dot():
        pytest.skip("this CPU / build has no AVX512-BF16")
    assert "AVX512-BF16" in native.status()
    torch.manual_seed(5)
    for n, k in SHAPES + [(40, 64)]:
        q, s = quantize_tensor(torch.randn(n, k))
        deq = dequantize(q, s).double()
        for m in ROW_COUNTS:
            x = torch.randn(m, k).to(torch.bfloat16)
            y = _bf16_path(x, q, s)
            assert _rel(y, x.double() @ deq.T) < 1e-6, (n, k, m)
            assert torch.equal(torch.cat([_bf16_path(x[i : i + 1], q, s) for i in range(m)]), y), (n, k, m)
            assert torch.equal(_bf16_path(x, q, s, threads=3), y), (n, k, m)
            assert torch.equal(_bf16_path(x, q, s, y_bf16=True), y.to(torch.bfloat16)), (n, k, m)
    if lib.localdiff_int8_has_amx():
        return  # AMX takes bf16 x up to MAX_ROWS rows there
    q, s = quantize_tensor(torch.randn(33, 100))
    x = torch.randn(5, 100).to(torch.bfloat16)
    assert torch.equal(native.matmul(x, q, s), _bf16_path(x, q, s, y_bf16=True))
    fresh.setenv("LOCALDIFF_NATIVE_INT8", "fma")
    reset_kernels()
    assert "AVX512-BF16" not in native.status()
    assert torch.equal(native.matmul(x, q, s), native.matmul(x.float(), q, s).to(torch.bfloat16))


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_alone_equal_rows_batched(fresh, dtype):
    """The packed forward's contract (localdiff.engine.batch.RowPolicy): native.matmul computes each row of x the
    same bits alone and among 1..17 or 256 rows, on the default path for bf16 and fp32 x."""
    torch.manual_seed(6)
    q, s = quantize_tensor(torch.randn(70, 300))
    for m in ROW_COUNTS:
        x = torch.randn(m, 300).to(dtype)
        y = native.matmul(x, q, s)
        assert torch.equal(torch.cat([native.matmul(x[i : i + 1], q, s) for i in range(m)]), y), (m, dtype)


@needs_lib
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_source_builds_without_avx512(tmp_path):
    """The source is portable: an AVX2 + FMA build and a generic build load and give the same numbers."""
    cc = native._compiler()
    torch.manual_seed(2)
    q, s = quantize_tensor(torch.randn(29, 77))
    x = torch.randn(5, 77)
    ref = x.double() @ dequantize(q, s).double().T
    for i, flags in enumerate((("-O3", "-mavx2", "-mfma", "-fPIC", "-shared"), ("-O1", "-fPIC", "-shared"))):
        lib = native._load(native.build(cc, flags, out_dir=tmp_path / str(i)))
        assert lib.localdiff_int8_has_amx() == 0  # no AMX code in these builds
        y = torch.empty(5, 29)
        lib.localdiff_int8_mm(x.data_ptr(), 77, 5, 77, q.data_ptr(), 29, s.data_ptr(), 1, y.data_ptr(), 29, 2)
        assert _rel(y, ref) < 1e-6, flags


def test_no_compiler_falls_back(fresh):
    fresh.setattr(native, "_compiler", lambda: None)
    assert native.library() is None
    assert native.status() == "native int8 kernel unavailable: no C compiler (cc / gcc / clang) on PATH"
    q, s = quantize_tensor(torch.randn(9, 40))
    x = torch.randn(3, 40)
    torch.testing.assert_close(int8_matmul(x, q, s), x @ dequantize(q, s).T, rtol=1e-5, atol=1e-5)
    assert "\n" not in kernel_summary() and kernel_summary().startswith("native int8 kernel unavailable")


def test_failed_compile_falls_back(broken_cc, fresh):
    assert native.library() is None
    assert native.status().startswith("native int8 kernel unavailable: cc ") and "something broke" in native.status()


def test_env_switch_off(fresh):
    fresh.setenv("LOCALDIFF_NATIVE_INT8", "0")
    assert native.library() is None and "LOCALDIFF_NATIVE_INT8=0" in native.status()


def _greedy(net, prompt, blocks, dtype):
    """Tokens of a greedy block decode (one denoising pass per 4-token block, then its prefill) and all logits."""
    from localdiff.cache.kv import KVCache

    cache = KVCache(**net.cache_layout())
    net.prefill(prompt, cache)
    mask = torch.full((prompt.shape[0], 4), net.config.mask_token_id)
    toks, logits = [], []
    for _ in range(blocks):
        lg = net.denoise(mask, cache)
        logits.append(lg)
        blk = lg.argmax(-1)
        toks.append(blk)
        net.prefill(blk, cache)
    return torch.cat(toks, 1), torch.cat(logits, 1)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_block_model_native_equals_torch_path(fresh, dtype):
    """A tiny SDAR-layout model in int8: greedy tokens equal the torch int8 path's, logits within tolerance."""
    from block_models import build_net

    _, net = build_net("sdar", seed=3, hidden_size=48, intermediate_size=80)  # k = 48, 80: int8pack-able too
    net = quantize_model(net.to(dtype))
    prompt = torch.randint(0, 120, (2, 8), generator=torch.Generator().manual_seed(4))
    fresh.setenv("LOCALDIFF_INT8_KERNEL", "native")
    got_t, got_l = _greedy(net, prompt, 4, dtype)
    assert "native" in kernel_summary()
    fresh.setenv("LOCALDIFF_INT8_KERNEL", "dequant")
    ref_t, ref_l = _greedy(copy.deepcopy(net), prompt, 4, dtype)
    if dtype == torch.float32:
        assert (got_l - ref_l).abs().max().item() < 1e-4 * ref_l.abs().max().item()
        assert torch.equal(got_t, ref_t)
    else:  # bf16 rounds every layer's output, so one last-bit difference grows through a random model: 1st block
        tol = 0.05 * ref_l[:, :4].abs().max().item()
        assert (got_l[:, :4] - ref_l[:, :4]).abs().max().item() < tol
        # bf16 logits carry 8 mantissa bits, so two tokens can tie (or nearly) and the last-bit difference picks
        # the other one (seen on an AVX2 CPU): a differing pick must be a near-tie under the torch path's logits
        differ = got_t[:, :4] != ref_t[:, :4]
        r = ref_l[:, :4].float()
        gap = r.max(-1).values - r.gather(-1, got_t[:, :4, None]).squeeze(-1)
        assert (gap[differ] <= tol).all(), gap[differ]
        assert differ.sum().item() <= 1, (got_t[:, :4], ref_t[:, :4])


def test_sdar_recipe_int8_head(tmp_path):
    """SDAR's recipe gives block models an int8 copy of the LM head (outside the state dict) at load and in
    quantize_model; its logits equal the dequantized head's; other recipes keep the float head."""
    from localdiff.loader import load_model
    from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe, recipe_for_model
    from block_models import build_net, write_checkpoint

    rec = recipe_for_model("sdar:1.7b")
    assert rec.name == "sdar" and rec.head == "int8" and DEFAULT_RECIPE.head == "float"
    assert Recipe.from_dict(rec.to_dict()).head == "int8"  # kept in pre-quantized metadata
    with pytest.raises(RecipeError, match="head precision"):
        Recipe.from_dict({"head": "fp8"})
    _, net = build_net("a2d-qwen3-bd3lm", seed=5)  # tied embeddings
    ids = torch.randint(0, 120, (1, 8), generator=torch.Generator().manual_seed(6))
    ref = net.logits_full(ids)
    q8 = quantize_model(copy.deepcopy(net), load_recipe("sdar"))
    assert q8.head_int8 is not None and not any("head_int8" in k for k in q8.state_dict())
    deq = dequantize(q8.head_int8.weight, q8.head_int8.weight_scale)
    assert torch.equal(q8.head_weight(), net.head_weight())  # the lookup table stays float
    got = q8.logits_full(ids)
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()  # int8 model vs float: close
    assert deq.shape == net.head_weight().shape
    assert getattr(quantize_model(copy.deepcopy(net)), "head_int8", None) is None
    ck = write_checkpoint(tmp_path / "ck", "sdar", seed=7)
    assert getattr(load_model(ck, quant="int8", recipe=load_recipe("sdar"))[0], "head_int8", None) is not None
    assert getattr(load_model(ck, quant="int8")[0], "head_int8", None) is None
    assert getattr(load_model(ck)[0], "head_int8", None) is None
