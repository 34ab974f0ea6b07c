"""The 16-bit fast path of the canvas decoder (issue #24): the vocabulary-sized work in few in-place passes
(:mod:`localdiff.decoding.vocab_pass`) and the self-conditioning input handed over as probabilities equal the
exact path's math (to fp32 rounding), and give the exact path's tokens where rounding cannot flip a decision."""

from __future__ import annotations

import functools

import pytest
import torch

import localdiff
from localdiff.arch.soft_embedding import Probabilities, soft_embedding
from localdiff.decoding.acceptance import token_entropy
from localdiff.decoding.vocab_pass import VocabPass


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("temp", [0.8, 0.4])
def test_vocab_pass_equals_the_exact_formulas(temp, native):
    from localdiff.kernels import vocab as vocab_native

    if native and vocab_native.library() is None:
        pytest.skip(vocab_native.status())
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 1000, generator=g) * 6
    logits[0, 0] = -50.0
    logits[0, 0, 3] = 40.0  # a near-one-hot row
    proc = logits / temp
    probs = torch.softmax(proc, -1)
    vp = VocabPass(torch.float32, native=native)
    arg, ent, conf, p, rows = vp.run(logits.clone(), temp)
    assert torch.equal(arg, proc.argmax(-1))
    assert torch.allclose(ent, token_entropy(proc), atol=2e-5, rtol=1e-5)
    assert torch.allclose(conf, probs.max(-1).values, atol=1e-6, rtol=1e-5)
    assert torch.allclose(p, probs, atol=1e-7, rtol=1e-5)
    idx = torch.tensor([5, 0, 13])
    assert torch.equal(rows(idx), p.view(-1, 1000)[idx])  # the draws' rows: the same values
    bufs = [p.data_ptr(), vp.run(logits.clone(), temp).probs.data_ptr()]
    assert bufs[0] != bufs[1]  # never the previous call's buffer ...
    assert vp.run(logits.clone(), temp).probs.data_ptr() == bufs[0]  # ... two reused in turn


def test_soft_embedding_from_probabilities():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 24, generator=g)
    sc = torch.randn(2, 5, 300, generator=g) * 3
    p = torch.softmax(sc, -1)
    assert torch.equal(soft_embedding(Probabilities(p), w), soft_embedding(sc, w))
    wb = w.bfloat16()
    assert torch.equal(soft_embedding(Probabilities(p.bfloat16()), wb), soft_embedding(sc, wb))
    assert torch.allclose(soft_embedding(Probabilities(p), w, 32), soft_embedding(sc, w, 32), atol=1e-5)


@pytest.mark.parametrize("opts", [{}, {"threshold": 0.5}])
def test_fast_path_gives_the_exact_tokens_in_fp32(opts, monkeypatch):
    """Forced on an fp32 model and drawing from the reference's random stream, the fast path (rows that stop early
    keep their canvas, batch of three) gives the exact path's tokens on the embedded model."""
    from localdiff.decoding import canvas_eb
    from localdiff.engine import canvas

    m = localdiff.load("tiny", dtype="float32")
    prompts = ["What is 12 + 30?", "Spell cat backwards.", "Name a colour."]
    kw = dict(max_new_tokens=2 * m.config.canvas_length, seed=3, **opts)
    exact = m.generate(prompts, **kw)
    monkeypatch.setattr(canvas, "policy_class", lambda _o: functools.partial(canvas_eb.CanvasEB, fast=True))
    draw = canvas_eb.CanvasEB._draw

    def full(self, p, read):  # the reference's stream draws from every position's row
        return p(torch.arange(read.numel())).view(*read.shape, -1) if callable(p) else p

    monkeypatch.setattr(
        canvas_eb.CanvasEB, "_draw", lambda self, p, read, valid: draw(self, full(self, p, read), read, False)
    )
    fast = m.generate(prompts, **kw)
    assert fast.token_ids == exact.token_ids
    assert fast.stats.forwards == exact.stats.forwards


def test_bf16_runs_the_fast_path():
    from localdiff.decoding.canvas_eb import CanvasEB
    from localdiff.decoding.options import CanvasEBOptions

    g = torch.Generator().manual_seed(0)
    assert CanvasEB(CanvasEBOptions(), 1, 8, 50, "cpu", g, torch.bfloat16).vocab_pass is not None
    assert CanvasEB(CanvasEBOptions(), 1, 8, 50, "cpu", g, torch.float32).vocab_pass is None
    m = localdiff.load("tiny", dtype="bfloat16")
    out = m.generate("What is 12 + 30?", max_new_tokens=m.config.canvas_length, seed=0)
    assert out.stats.forwards >= 1 and len(out.token_ids) >= 1


def test_head_rows_logits_are_the_full_logits_rows():
    m = localdiff.load("tiny", dtype="float32")
    c, v = m.config.canvas_length, m.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids, canvas = torch.randint(3, v, (2, 9), generator=g), torch.randint(0, v, (2, c), generator=g)
    sc = torch.randn(2, c, v, generator=g)
    rows = torch.rand(2, c, generator=g) < 0.3
    cache = m.new_cache()
    m.prefill(ids, cache)
    full = m.denoise(canvas, cache, sc)
    part = m.net.denoise(canvas, cache, sc, head_rows=rows)
    assert part.shape == (int(rows.sum()), v) and torch.equal(part, full[rows])


def test_reuse_locked_is_opt_in_and_needs_a_lock():
    from localdiff.decoding.canvas_reuse import CanvasEBReuse

    m = localdiff.load("tiny", dtype="float32")
    with pytest.raises(localdiff.errors.UsageError, match="reuse_locked"):
        m.generate("What is 12 + 30?", reuse_locked=True)
    with pytest.raises(localdiff.errors.UsageError, match="reuse_locked"):
        m.generate("What is 12 + 30?", reuse_locked=True, threshold=0.9, correction=True)
    assert m.sampler_options()["reuse_locked"] is False
    seen = []
    orig = CanvasEBReuse.head_rows

    def spy(self):
        r = orig(self)
        seen.append(None if r is None else int(r.sum()))
        return r

    CanvasEBReuse.head_rows = spy
    try:
        out = m.generate(["What is 12 + 30?", "What is 7 + 5?"], threshold=0.9, reuse_locked=True, seed=0)
    finally:
        CanvasEBReuse.head_rows = orig
    assert out.stats.forwards >= 2 and all(len(t) for t in out.token_ids)
    assert any(n is not None and n < 2 * m.config.canvas_length for n in seen)  # fewer head rows than positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rms_norm_equals_the_formula_in_16_bits(dtype):
    from localdiff.arch.layers import rms_norm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 37, 448, generator=g) * 5).to(dtype)
    w = (torch.rand(448, generator=g) * 2).to(dtype)

    def formula(x, w):
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
        return (out if w is None else out * w.float()).type_as(x)

    for weight in (w, None):
        want = formula(x, weight)
        assert torch.equal(rms_norm(x, weight, 1e-6), want)  # the in-place inference path
        assert torch.equal(torch.rms_norm(x, (448,), weight, 1e-6), want)  # = torch's kernel (autograd path)
        with torch.inference_mode():
            assert torch.equal(rms_norm(x, weight, 1e-6), want)
        xg = x.clone().requires_grad_(True)
        y = rms_norm(xg, weight, 1e-6)
        assert torch.equal(y.detach(), want) and y.requires_grad
        y.float().sum().backward()
        assert xg.grad is not None
    for x in (x[:, :, :128].reshape(3, 37, 2, 64), x[:, 1:]):  # per-head shape, a non-contiguous view
        assert torch.equal(rms_norm(x, w[: x.shape[-1]], 1e-6), formula(x, w[: x.shape[-1]]))


def test_draw_rows_draws_the_read_rows_only():
    from localdiff.decoding.canvas_eb import draw_rows

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 5000, generator=g), -1)
    probs[2] = 0.0
    probs[2, 4321] = 1.0  # a one-hot row draws its token
    read = torch.tensor([False, True, True, False, False, True])
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    out = draw_rows(probs, read, a)
    assert out[2] == 4321 and bool((out[~read] == 0).all())
    assert torch.equal(out[read], torch.multinomial(probs[read], 1, generator=b).view(-1))
    assert torch.equal(a.get_state(), b.get_state())  # advanced by the three read rows only
    assert torch.equal(draw_rows(probs, torch.zeros(6, dtype=torch.bool), a), torch.zeros(6, dtype=torch.long))
