"""int4 weight-only format and kernels (localdiff.quantize.int4 / native4): quantize → dequantize error bounds, the
packing layout against a test-side transcription, and every kernel path (this CPU's default build, the fp32-FMA
path forced, an AVX2 build, a generic C build, the torch fallback) against float64 dequantize-then-matmul for odd
shapes and every row count 1..17 and 256."""

from __future__ import annotations

import shutil

import pytest
import torch

from localdiff.kernels import build as native_build
from localdiff.kernels import int4 as native4
from localdiff.quantize import int4
from localdiff.quantize.int4 import dequantize, int4_matmul, quantize_tensor

SHAPES = [(1, 1), (7, 5), (13, 64), (37, 100), (9, 129), (65, 257), (31, 1100), (17, 2049)]  # (N, K)
ROWS = list(range(1, 18)) + [256]
CC = native_build.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch):
    """The native library state reset for the test's environment, and again afterwards."""
    native4.reset()
    yield monkeypatch
    monkeypatch.undo()
    native4.reset()


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, : min(k, 70)] += 0.3  # a group off-centre: its zero point is not near 7.5
    return w


def _ref_dequant(packed, scale, zero, k):
    """Test-side transcription of the format: byte i of group g = codes of k = 64g + i (low) and 64g + 32 + i
    (high); w = s · (q − z) in float64."""
    n = packed.shape[0]
    w = torch.zeros(n, scale.shape[1] * 64, dtype=torch.float64)
    for g in range(scale.shape[1]):
        b = packed[:, g * 32 : (g + 1) * 32].long()
        s, z = scale[:, g].double()[:, None], zero[:, g].double()[:, None]
        w[:, g * 64 : g * 64 + 32] = s * ((b & 15).double() - z)
        w[:, g * 64 + 32 : g * 64 + 64] = s * ((b >> 4).double() - z)
    return w[:, :k]


def test_format_layout_and_bytes():
    w = _weights(5, 100)
    p, s, z = quantize_tensor(w)
    assert p.dtype == torch.uint8 and p.shape == (5, 64) and s.dtype == torch.bfloat16 and s.shape == (5, 2)
    assert z.dtype == torch.float16 and z.shape == (5, 2)
    assert torch.equal(dequantize(p, s, z, 100, torch.float64), _ref_dequant(p, s, z, 100))
    m = int4.Int4Linear.from_linear(torch.nn.Linear(4096, 8, bias=False))
    nbytes = sum(t.numel() * t.element_size() for t in m.buffers())
    assert nbytes == 8 * 4096 * int4.BYTES_PER_WEIGHT == 8 * 4096 * 0.5625


def test_quantize_dequantize_error_bound():
    """|w − s(q − z)| ≤ s/2 (+ the fp16 rounding of z, ≤ 2⁻¹¹|z| steps); s ≤ the group's range / 15 (or max|w| / 256)
    rounded up to bf16; all-zero and constant groups; stacked experts equal their slices."""
    torch.manual_seed(0)
    for n, k in SHAPES + [(3, 640)]:
        w = _weights(n, k, seed=k)
        if k > 64:
            w[1, :64] = 0.0  # an all-zero group
            w[2, 64:128] = 0.123  # a constant group
        p, s, z = quantize_tensor(w)
        deq = dequantize(p, s, z, k, torch.float64)
        step = s.double().repeat_interleave(64, dim=1)[:, :k]
        zz = z.double().abs().repeat_interleave(64, dim=1)[:, :k]
        err = (deq - w.double()).abs()
        assert (err <= step * (0.5 + 2.0**-11 * zz) + 1e-12).all(), (n, k, (err / step).max())
        wp = torch.nn.functional.pad(w, (0, s.shape[1] * 64 - k)).view(n, -1, 64)
        rng = (wp.amax(-1) - wp.amin(-1)) / 15
        bound = torch.maximum(rng, wp.abs().amax(-1) / 256) * (1 + 2.0**-7)
        assert (s.float() <= torch.maximum(bound, torch.ones_like(bound) * (bound == 0))).all()
        if k > 64:
            assert (deq[1, :64] == 0).all() and (deq[2, 64:128] - 0.123).abs().max() <= 0.123 / 256
        codes = int4.unpack_codes(p, k)
        assert codes.max() <= 15 and torch.equal(int4.pack_codes(int4.unpack_codes(p)), p)
    ex = torch.randn(3, 24, 70)
    pe, se, ze = quantize_tensor(ex)
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip((pe[i], se[i], ze[i]), quantize_tensor(ex[i])))


def _check(mm, threads=(1,)):
    """``mm(x, p, s, z, threads)`` (fp32 result) against float64 for every shape, row count, bf16 / fp32 x: relative
    max error ≤ 2e-6 (fp32 summation of ≤ 2049 terms), thread counts equal; and one changed code is caught."""
    for n, k in SHAPES:
        w = _weights(n, k, seed=n * k)
        p, s, z = quantize_tensor(w)
        deq = _ref_dequant(p, s, z, k)
        for m in ROWS:
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dt)
                ref = x.double() @ deq.T
                outs = [mm(x, p, s, z, t) for t in threads]
                assert outs[0].dtype == torch.float32 and outs[0].shape == (m, n)
                rel = ((outs[0].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= 2e-6, (n, k, m, dt, rel)
                for o in outs[1:]:
                    assert torch.equal(o, outs[0]), (n, k, m, dt, "thread counts differ")
    # the criterion is sharp enough to see one code off by one (in the largest shape)
    n, k = SHAPES[-1]
    p, s, z = quantize_tensor(_weights(n, k))
    x = torch.randn(4, k)
    ref = x.double() @ _ref_dequant(p, s, z, k).T
    bad = p.clone()
    bad[3, 17] ^= 1
    rel = ((mm(x, bad, s, z, 1).double() - ref).abs().max() / ref.abs().max()).item()
    assert rel > 1e-4, rel


@needs_cc
def test_native_default_build(fresh):
    """This CPU's build: AVX512-BF16 dot products for bf16 x where the CPU has them, zmm / ymm FMAs otherwise."""
    assert native4.library() is not None, native4.status()
    _check(lambda x, p, s, z, t: native4.matmul(x, p, s, z, threads=t, out_dtype=torch.float32), threads=(1, 3))


@needs_cc
def test_native_fma_path_forced(fresh):
    fresh.setenv("LOCALDIFF_NATIVE_INT4", "fma")
    assert not native4.bf16_dot()
    _check(lambda x, p, s, z, t: native4.matmul(x, p, s, z, threads=t, out_dtype=torch.float32))


def _variant(tmp_path, flags):
    try:
        return native4.load(native4.build(CC, flags, tmp_path))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"this compiler cannot build {flags}: {e}")


@needs_cc
@pytest.mark.parametrize(
    "name,flags",
    [
        ("avx2", ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared")),
        ("avx512-no-bf16", ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-fPIC", "-shared")),
        ("generic", native_build.PORTABLE_FLAGS),
    ],
)
def test_native_other_builds(tmp_path, name, flags):
    """The same source built for other targets (each runs where this CPU supports it): the AVX2 path, the AVX-512
    FMA path without BF16, and the generic C path (no -march: plain C vectors, software fp16 conversion)."""
    import platform

    if name != "generic" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    flags_line = native_build.cpu_flags()
    if name == "avx2" and " avx2" not in flags_line or name.startswith("avx512") and " avx512bw" not in flags_line:
        pytest.skip(f"this CPU cannot run the {name} build")
    lib = _variant(tmp_path, flags)
    assert not lib.localdiff_int4_has_bf16()
    assert lib.localdiff_int4_vector_width() == (16 if name.startswith("avx512") else 8)
    _check(
        lambda x, p, s, z, t: native4.matmul(x, p, s, z, threads=t, lib=lib, out_dtype=torch.float32), threads=(1, 2)
    )


def test_torch_fallback_without_compiler(fresh):
    """No compiler: int4_matmul dequantizes and runs one fp32 GEMM; status says why in one line."""
    fresh.setattr(native4, "_compiler", lambda: None)
    assert native4.library() is None and "no C compiler" in native4.status()
    # bf16 x: the fallback computes in fp32 from x's exact values, so x.float() gives its unrounded result
    _check(lambda x, p, s, z, t: int4_matmul(x.float(), p, s, z))
    fresh.setenv("LOCALDIFF_NATIVE_INT4", "0")
    native4.reset()
    assert native4.library() is None and "off" in native4.status()


def test_bad_shapes_are_one_line_errors():
    p, s, z = quantize_tensor(torch.randn(4, 100))
    with pytest.raises(ValueError, match="groups"):
        int4_matmul(torch.randn(2, 200), p, s, z)
    if shutil.which("cc") or shutil.which("gcc"):
        with pytest.raises(ValueError, match="native int4"):
            native4.matmul(torch.randn(2, 100), p, s.float(), z)


@pytest.mark.parametrize("mode", ["", "fma"])
def test_kernel_rounds_bf16_results_exactly_as_a_cast(fresh, mode):
    """bf16 results come rounded by the kernel (no fp32 tensor and cast): equal, bit for bit, to the fp32 result
    cast to bf16 (round to nearest even), on both paths."""
    fresh.setenv("LOCALDIFF_NATIVE_INT4", mode)
    if native4.library() is None:
        pytest.skip(native4.status())
    p, s, z = quantize_tensor(_weights(37, 200, seed=5))
    for m in (1, 5, 17):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(m, 200, generator=torch.Generator().manual_seed(m)) * 30).to(dtype)
            y16 = native4.matmul(x, p, s, z, out_dtype=torch.bfloat16)
            y32 = native4.matmul(x, p, s, z, out_dtype=torch.float32)
            assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16)), (m, dtype)


def test_many_bf16_rows_run_dequantized_bf16_blocks_and_a_gemm(fresh):
    """bf16 activations of DEQUANT_ROWS rows or more: the library's bf16 dequantization (bit-equal to
    ``dequantize(..., bfloat16)``) a block of rows at a time, then torch's GEMM — equal to F.linear on the whole
    bf16-dequantized weight; fewer rows and fp32 stay on the exact kernel."""
    if native4.library() is None:
        pytest.skip(native4.status())
    p, s, z = quantize_tensor(_weights(300, 200, seed=9))
    buf = torch.empty(300, 256, dtype=torch.bfloat16)
    w16 = dequantize(p, s, z, 200, torch.bfloat16)
    assert torch.equal(native4.dequantize_bf16(p, s, z, 0, 300, buf)[:, :200], w16)
    assert torch.equal(native4.dequantize_bf16(p, s, z, 7, 19, buf)[:, :200], w16[7:19])
    x = torch.randn(2, int4.DEQUANT_ROWS, 200).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, w16)
    fresh.setattr(int4, "_BLOCK_BYTES", 64 * 256 * 2)  # several blocks of 64 rows
    got = int4_matmul(x, p, s, z)
    assert got.dtype == torch.bfloat16 and got.shape == (2, int4.DEQUANT_ROWS, 300)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    few = x[:1, : int4.DEQUANT_ROWS - 1]  # the exact kernel below the threshold
    assert torch.equal(int4_matmul(few, p, s, z), native4.matmul(few.reshape(-1, 200), p, s, z).reshape(1, -1, 300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_experts_in_one_library_call_equal_the_per_expert_loop(fresh, dtype):
    """Int4Experts.forward's grouped library call (rows sorted by expert, one call per projection) gives the
    per-expert loop's result bit for bit (experts with no rows included)."""
    from localdiff.arch.layers import MoEExperts

    if native4.library() is None:
        pytest.skip(native4.status())
    torch.manual_seed(0)
    ex = MoEExperts(6, 100, 40)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    q = int4.Int4Experts.from_experts(ex)
    x = torch.randn(9, 100).to(dtype)
    index = torch.tensor([[0, 2], [2, 5], [0, 5], [2, 0], [5, 2], [0, 2], [2, 5], [5, 0], [0, 2]])  # 1, 3, 4: none
    weights = torch.rand(9, 2)
    with torch.inference_mode():
        calls = []
        fresh.setattr(native4, "grouped_matmul", lambda *a, _f=native4.grouped_matmul: calls.append(1) or _f(*a))
        got = q(x, weights, index)
        want = MoEExperts.forward(q, x, weights, index)  # the per-expert loop (expert_ffn)
    assert len(calls) == 2 and got.dtype == dtype and torch.equal(got, want)
