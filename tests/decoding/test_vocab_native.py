"""The fused native vocab pass (issue #24, ``localdiff/kernels/vocab.c``) against a float64 computation of
the same math, in its vector build and its portable build; the raw-logit hand-over from the model; the switch.

Stated error (fp32 kernel, float64 reference, random logits of std 4 (max ≈ 16, soft-capped at 30, T ≠ 1)):
probabilities (before their bf16 rounding) and confidence within 2e-5 relative, entropy within 2e-5 relative +
1e-6 absolute, argmax identical (ties excluded: bf16 inputs tie exactly, so tied rows are skipped).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localdiff.kernels import build as native
from localdiff.arch.soft_embedding import RawLogits
from localdiff.kernels import vocab as vocab_native
from localdiff.decoding.vocab_pass import VocabPass
from localdiff.errors import UsageError

REL = 2e-5


def _lib_or_skip():
    if vocab_native.library() is None:
        pytest.skip(vocab_native.status())


def _reference(x: torch.Tensor, cap, temp: float):
    z = x.double()
    if cap:
        z = cap * torch.tanh(z / cap)
    z = z / temp
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    return z, p, -(p * logp).sum(-1)


def _check(lib, n, v, cap, temp, dtype, threads, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 4).to(dtype)
    x[0, v // 3] = 200.0  # a near-one-hot row (soft-capped to ~30 when capped)
    out32 = torch.empty(n, v)
    arg, ent, conf = _call(lib, x, cap, temp, out32, threads)
    z, p, h = _reference(x, cap, temp)
    top2 = z.topk(2, -1).values
    untied = top2[:, 0] > top2[:, 1]
    assert untied.sum() >= n - 1
    assert torch.equal(arg[untied], z.argmax(-1)[untied])
    assert ((out32.double() - p).abs() <= REL * p + 1e-30).all()
    assert ((conf.double() - p.max(-1).values).abs() <= REL * p.max(-1).values).all()
    assert ((ent.double() - h).abs() <= REL * h + 1e-6).all()
    out16 = torch.empty(n, v, dtype=torch.bfloat16)  # bf16 output = the fp32 values rounded (as torch rounds)
    arg16, ent16, conf16 = _call(lib, x, cap, temp, out16, threads)
    assert torch.equal(out16, out32.bfloat16())
    assert torch.equal(arg16, arg) and torch.equal(ent16, ent) and torch.equal(conf16, conf)


def _call(lib, x, cap, temp, out, threads):
    if lib is None:
        return vocab_native.vocab_pass(x, cap, temp, out, threads=threads)
    n, v = x.shape
    arg, ent, conf = torch.empty(n, dtype=torch.long), torch.empty(n), torch.empty(n)
    scratch = torch.empty(threads * v)
    lib.localdiff_vocab_pass(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.stride(0),
        n,
        v,
        float(cap or 0.0),
        1.0 / temp,
        out.data_ptr(),
        int(out.dtype == torch.bfloat16),
        out.stride(0),
        arg.data_ptr(),
        ent.data_ptr(),
        conf.data_ptr(),
        scratch.data_ptr(),
        threads,
    )
    return arg, ent, conf


@pytest.mark.parametrize(
    "n,v,cap,temp,dtype,threads",
    [
        (7, 1001, 30.0, 0.8, torch.bfloat16, 1),  # V not a multiple of 16, soft-capped
        (5, 4099, None, 1.3, torch.float32, 3),  # no cap, fp32 logits, rows over 3 threads
        (3, 17, 30.0, 0.45, torch.float32, 2),  # one vector plus a one-element tail
        (2, 15, 5.0, 2.0, torch.bfloat16, 1),  # shorter than one vector, a tight cap
    ],
)
def test_native_pass_matches_float64(n, v, cap, temp, dtype, threads):
    _lib_or_skip()
    _check(None, n, v, cap, temp, dtype, threads)


def test_portable_build_matches_float64(tmp_path):
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lib = vocab_native.load(vocab_native.build(cc, native.PORTABLE_FLAGS, out_dir=tmp_path))
    assert lib.localdiff_vocab_vector_width() == 1  # the scalar code, not the AVX-512 one
    _check(lib, 4, 1001, 30.0, 0.8, torch.bfloat16, 2, seed=1)
    _check(lib, 3, 33, None, 1.7, torch.float32, 1, seed=2)
    assert _call(lib, _ties(), 30.0, 1.0, torch.empty(2, 40), 1)[0].tolist() == [7, 33]


def _ties() -> torch.Tensor:
    x = torch.zeros(2, 40, dtype=torch.bfloat16)
    x[0, [7, 21, 39]] = 3.0
    x[1, [33, 35]] = 3.0
    return x


def test_first_argmax_on_ties_and_bad_input():
    _lib_or_skip()
    x = _ties()
    arg, _, conf = vocab_native.vocab_pass(x, 30.0, 1.0, torch.empty(2, 40))
    assert arg.tolist() == [7, 33]  # the first of equal maxima, as torch.argmax
    with pytest.raises(ValueError):
        vocab_native.vocab_pass(x.half(), None, 1.0, torch.empty(2, 40))
    with pytest.raises(ValueError):
        vocab_native.vocab_pass(x, None, 0.0, torch.empty(2, 40))


def test_raw_logits_give_the_torch_passes_bit_for_bit():
    """The torch fallback on RawLogits = the model's fp32 cast + in-place soft-capping, then the same passes; the
    native pass on them agrees within the stated error and its draw rows are its probabilities unrounded."""
    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(2, 9, 777, generator=g) * 5).bfloat16()
    capped = raw.float().div_(30.0).tanh_().mul_(30.0)
    a = VocabPass(torch.bfloat16, native=False).run(RawLogits(raw, 30.0), 0.7)
    b = VocabPass(torch.bfloat16, native=False).run(capped.clone(), 0.7)
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    if vocab_native.library() is None:
        return
    c = VocabPass(torch.bfloat16, native=True).run(RawLogits(raw, 30.0), 0.7)
    assert c.probs.dtype == torch.bfloat16 and c.probs.shape == (2, 9, 777)
    assert torch.equal(c.argmax, a.argmax)
    assert torch.allclose(c.entropy, a.entropy, rtol=REL, atol=1e-6)
    assert torch.allclose(c.confidence, a.confidence, rtol=REL)
    idx = torch.tensor([17, 0, 4])
    rows = c.rows(idx)
    assert rows.dtype == torch.float32 and torch.equal(rows.bfloat16(), c.probs.view(-1, 777)[idx])
    assert torch.allclose(rows, a.probs.view(-1, 777)[idx], rtol=REL, atol=1e-12)


def test_model_raw_logits_are_the_head_output_before_soft_capping():
    import localdiff

    m = localdiff.load("tiny", dtype="bfloat16")
    c, v = m.config.canvas_length, m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids, canvas = torch.randint(3, v, (1, 9), generator=g), torch.randint(0, v, (1, c), generator=g)
    cache = m.new_cache()
    m.prefill(ids, cache)
    full = m.net.denoise(canvas, cache)
    raw = m.net.denoise(canvas, cache, raw_logits=True)
    cap = m.config.final_logit_softcapping
    assert isinstance(raw, RawLogits) and raw.values.dtype == torch.bfloat16 and raw.softcap == cap
    want = raw.values.float()
    if cap is not None:
        want = want.div_(cap).tanh_().mul_(cap)
    assert torch.equal(want, full)


def test_switch_is_validated_and_forces_the_torch_passes(monkeypatch):
    from localdiff.config import check_environment

    monkeypatch.setenv(vocab_native.ENV, "fastest")
    vocab_native.reset()
    try:
        with pytest.raises(UsageError, match="LOCALDIFF_VOCAB_KERNEL"):
            vocab_native.library()
        with pytest.raises(UsageError, match="LOCALDIFF_VOCAB_KERNEL"):
            check_environment({vocab_native.ENV: "fastest"})
        monkeypatch.setenv(vocab_native.ENV, "torch")
        vocab_native.reset()
        assert vocab_native.library() is None and "torch" in vocab_native.status()
        assert VocabPass(torch.bfloat16).native is False
        r = VocabPass(torch.bfloat16).run(RawLogits(torch.randn(3, 50).bfloat16(), 30.0), 1.0)
        assert r.probs.dtype == torch.float32
    finally:
        monkeypatch.delenv(vocab_native.ENV)
        vocab_native.reset()


def test_failed_compile_falls_back_to_the_torch_passes(broken_cc):
    vocab_native.reset()
    try:
        assert vocab_native.library() is None and "something broke" in vocab_native.status()
        r = VocabPass(torch.bfloat16).run(RawLogits(torch.randn(2, 3, 64).bfloat16(), 30.0), 0.9)
        assert r.probs.dtype == torch.float32 and r.argmax.shape == (2, 3)
    finally:
        vocab_native.reset()


def test_raw_head_is_f_linear_bit_for_bit_into_a_reused_buffer():
    from localdiff.arch.soft_embedding import raw_head

    g = torch.Generator().manual_seed(4)
    bufs: dict = {}
    for b, c, h, v in [(1, 37, 96, 1001), (2, 5, 64, 333), (1, 37, 96, 1001)]:
        x = torch.randn(b, c, h, generator=g).bfloat16()
        w = (torch.randn(v, h, generator=g) * 0.02).bfloat16()
        r = raw_head(x, w, 30.0, bufs)
        assert r.softcap == 30.0 and r.values.shape == (b, c, v) and torch.equal(r.values, F.linear(x, w))
    again = raw_head(x, w, None, bufs)
    assert again.values.data_ptr() == r.values.data_ptr() and len(bufs) == 1  # one buffer, reused per shape


@pytest.mark.parametrize("opts", [{}, {"threshold": 0.5, "reuse_locked": True}])
def test_bf16_generation_native_equals_the_torch_passes(opts, monkeypatch):
    """On the embedded model in bf16 (rows that stop early, batch of three; with locking + reuse, head rows), the
    fused pass gives the torch passes' tokens (the rounding differences, ~1e-6, flip no decision here)."""
    import localdiff

    _lib_or_skip()
    m = localdiff.load("tiny", dtype="bfloat16")
    prompts = ["What is 12 + 30?", "Spell cat backwards.", "Name a colour."]
    kw = dict(max_new_tokens=2 * m.config.canvas_length, seed=3, **opts)
    native = m.generate(prompts, **kw)
    monkeypatch.setenv(vocab_native.ENV, "torch")
    vocab_native.reset()
    try:
        torch_passes = m.generate(prompts, **kw)
    finally:
        monkeypatch.delenv(vocab_native.ENV)
        vocab_native.reset()
    assert native.token_ids == torch_passes.token_ids and native.stats.forwards == torch_passes.stats.forwards
    assert all(len(t) for t in native.token_ids)


def test_float16_model_takes_the_torch_passes():
    import localdiff

    m = localdiff.load("tiny", dtype="float16")
    out = m.generate("What is 12 + 30?", max_new_tokens=m.config.canvas_length, seed=0)
    assert out.stats.forwards >= 1 and len(out.token_ids) >= 1
