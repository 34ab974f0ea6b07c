"""The exact canvas path hands the model its own softmax (``Probabilities(probs, logits)``) instead of the logits:
the next forward is bit-identical to recomputing it from the logits, the top-k approximation still reads the logits,
and the argmax by ``max(-1).indices`` equals ``argmax(-1)`` (ties, NaN and -inf rows)."""

import torch

import localdiff
from localdiff.arch.soft_embedding import Probabilities, soft_embedding
from localdiff.decoding.canvas_eb import CanvasEB
from localdiff.decoding.options_canvas import CanvasEBOptions


def _policy_after_one_step(m, ids):
    c, v = m.config.canvas_length, m.config.vocab_size
    names = set(CanvasEBOptions.__dataclass_fields__)
    opts = CanvasEBOptions(**{k: x for k, x in m.sampler_options(max_denoising_steps=4).items() if k in names})
    pol = CanvasEB(opts, ids.shape[0], c, v, "cpu", torch.Generator().manual_seed(5), torch.float32)
    cache = m.new_cache()
    m.prefill(ids, cache)
    pol.begin_block()
    canvas, sc = pol.model_inputs()
    pol.advance(pol.assess(m.denoise(canvas, cache, sc), 1))
    return pol, cache


def test_next_forward_equals_the_logits_path(ref_small):
    _, path = ref_small
    m = localdiff.load(path, device="cpu", dtype="float32")
    ids = torch.randint(3, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    pol, cache = _policy_after_one_step(m, ids)
    canvas, sc = pol.model_inputs()
    assert isinstance(sc, Probabilities) and sc.logits is not None
    assert torch.equal(sc.probs, torch.softmax(sc.logits, -1, dtype=torch.float32))
    with_probs = m.denoise(canvas, cache, sc)
    with_logits = m.denoise(canvas, cache, sc.logits)
    assert torch.equal(with_probs, with_logits)


def test_topk_reads_the_logits():
    g = torch.Generator().manual_seed(2)
    logits, w = torch.randn(1, 5, 300, generator=g) * 3, torch.randn(300, 16, generator=g)
    p = Probabilities(torch.softmax(logits, -1), logits)
    assert torch.equal(soft_embedding(p, w, topk=8), soft_embedding(logits, w, topk=8))
    assert torch.equal(soft_embedding(p, w), soft_embedding(logits, w))


def test_max_indices_is_argmax():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(0, 4, (6, 999), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[trial % 6, trial % 999] = float("nan")
        if trial % 4 == 0:
            x[1] = float("-inf")
        assert torch.equal(x.max(-1).indices, x.argmax(-1))
