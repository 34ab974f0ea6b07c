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


@pytest.mark.parametrize("temp", [0.8, 0.4])
def test_vocab_pass_equals_the_exact_formulas(temp):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 1000, generator=g) * 6
    logits[0, 0] = -50.0
    logits[0, 0, 3] = 40.0                                           # a near-one-hot row
    proc = logits / temp
    probs = torch.softmax(proc, -1)
    vp = VocabPass()
    arg, ent, conf, p = vp.run(logits.clone(), temp)
    assert torch.equal(arg, proc.argmax(-1))
    assert torch.allclose(ent, token_entropy(proc), atol=2e-5, rtol=1e-5)
    assert torch.allclose(conf, probs.max(-1).values, atol=1e-6, rtol=1e-5)
    assert torch.allclose(p, probs, atol=1e-7, rtol=1e-5)
    buf = p.data_ptr()
    assert vp.run(logits.clone(), temp)[3].data_ptr() == buf         # the buffer is reused across steps


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
    """Forced on an fp32 model, the fast path (rows that stop early keep their canvas, batch of three) gives the
    exact path's tokens on the embedded model."""
    from localdiff.decoding import canvas_eb
    from localdiff.engine import canvas

    m = localdiff.load("tiny", dtype="float32")
    prompts = ["What is 12 + 30?", "Spell cat backwards.", "Name a colour."]
    kw = dict(max_new_tokens=2 * m.config.canvas_length, seed=3, **opts)
    exact = m.generate(prompts, **kw)
    monkeypatch.setattr(canvas, "CanvasEB", functools.partial(canvas_eb.CanvasEB, fast=True))
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
