"""LLaDA's sampling draws (#45 item 5): with ``noise="upstream"`` and ``seed=S`` the tokens at temperature > 0 (and
with random remasking) equal upstream's run after ``torch.manual_seed(S)`` — LLaDA ``generate.py`` and Fast-dLLM's
``generate`` / ``generate_with_prefix_cache`` / ``generate_with_dual_cache`` (transcribed in ``upstream_masked.py``,
drawing from the global RNG as upstream) — for 20 prompts each, on the fake masked model (CPU)."""

from __future__ import annotations


import pytest
import torch

from fake_masked import FakeMaskedConfig, FakeMaskedNet
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.decoding.draws import uniform_rows
from localdiff.engine import Model
import upstream_masked as up

MASK = 36
PROMPTS = [
    torch.randint(3, 36, (int(n),), generator=torch.Generator().manual_seed(300 + i)).tolist()
    for i, n in enumerate(torch.randint(2, 10, (20,), generator=torch.Generator().manual_seed(9)))
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    cfg = FakeMaskedConfig(eos_token_id=(), pad_token_id=None)
    REGISTRY[cfg.model_type] = ArchEntry("fake_masked", "fake_masked", "masked")
    return Model(
        FakeMaskedNet(cfg, seed=0), cfg, None, tmp_path_factory.mktemp("noise"), "fake", "cpu", torch.float32, None, {}
    )


class _NoMask:
    """The model as upstream sees it, minus the mask token (ours never predicts it: masked_loop.py): its logit
    −1e4, finite so that classifier-free guidance keeps it there (exp underflows to 0 as for −inf)."""

    def __init__(self, net):
        self.net = net

    def __call__(self, ids):
        out = self.net.logits_full(ids).clone()
        out[..., MASK] = -1e4
        return out

    def forward_window(self, *a, **kw):
        out = self.net.forward_window(*a, **kw)
        logits = (out[0] if kw.get("return_kv") else out).clone()
        logits[..., MASK] = -1e4
        return (logits, out[1]) if kw.get("return_kv") else logits


def _upstream(fn, seed, *args, **kw):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = fn(*args, **kw)
    return out[0] if isinstance(out, tuple) else out


def _ours(m, p, seed, n, **kw):
    return m.generate(list(p), max_new_tokens=n, seed=seed, chat=False, **kw).token_ids


def test_uniform_rows_is_the_whole_draw_cut():
    for shape, lo, hi in [((2, 9, 13), 3, 6), ((1, 5, 4000), 0, 5), ((3, 7, 300), 7, 7), ((1, 4, 3), 0, 0)]:
        a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
        want = torch.rand(shape, dtype=torch.float64, generator=a)[:, lo:hi]
        assert torch.equal(uniform_rows(shape, lo, hi, b, "cpu"), want)
        assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize(
    "gen_length,block_length,steps,temperature,remasking",
    [
        (16, 4, 8, 0.7, "low_confidence"),
        (12, 4, 12, 1.0, "low_confidence"),
        (8, 4, 16, 0.5, "low_confidence"),
        (16, 8, 8, 0.0, "random"),
        (8, 4, 16, 0.8, "random"),
    ],
)
def test_seeded_llada_equals_upstream_generate(m, gen_length, block_length, steps, temperature, remasking):
    """LLaDA ``generate.py``; steps 16 over blocks of 4 runs idle steps (their draws are skipped: same stream)."""
    fn, diff = _NoMask(m.net), 0
    for i, p in enumerate(PROMPTS):
        want = _upstream(
            up.llada_generate_sampled,
            i,
            fn,
            torch.tensor([p]),
            steps,
            gen_length,
            block_length,
            temperature,
            remasking,
            mask_id=MASK,
        )[0, len(p) :].tolist()
        kw = dict(steps=steps, block_length=block_length, temperature=temperature, remasking=remasking)
        assert _ours(m, p, i, gen_length, noise="upstream", **kw) == want, (i, p)
        diff += _ours(m, p, i, gen_length, **kw) != want
    assert diff >= 5, diff  # the block-only draws (the default) really are other numbers


def test_seeded_guidance_equals_upstream(m):
    fn = _NoMask(m.net)
    for i, p in enumerate(PROMPTS):
        want = _upstream(
            up.llada_generate_sampled, i, fn, torch.tensor([p]), 8, 8, 4, 0.9, cfg_scale=1.5, mask_id=MASK
        )[0, len(p) :].tolist()
        assert _ours(m, p, i, 8, steps=8, block_length=4, temperature=0.9, cfg_scale=1.5, noise="upstream") == want


@pytest.mark.parametrize(
    "cache,rule,temperature,remasking",
    [
        ("none", {"threshold": 0.5}, 0.8, "low_confidence"),
        ("none", {"threshold": 0.3}, 0.6, "random"),
        ("prefix", {}, 0.8, "low_confidence"),
        ("prefix", {"threshold": 0.5}, 0.6, "random"),
        ("dual", {}, 0.6, "random"),
        ("dual", {"threshold": 0.5}, 0.8, "low_confidence"),
    ],
)
def test_seeded_fastdllm_equals_upstream(m, cache, rule, temperature, remasking):
    """Fast-dLLM ``generate`` (kv_cache none with a threshold; without one it is LLaDA generate.py, above) and its
    prefix / dual cache functions."""
    fn = {"none": up.fastdllm_generate, "prefix": up.fastdllm_prefix_cache, "dual": up.fastdllm_dual_cache}[cache]
    net = _NoMask(m.net)
    for i, p in enumerate(PROMPTS):
        want = _upstream(
            fn, i, net, torch.tensor([p]), 16, 16, 8, mask_id=MASK, temperature=temperature, remasking=remasking, **rule
        )[0, len(p) :].tolist()
        got = _ours(
            m,
            p,
            i,
            16,
            steps=16,
            block_length=8,
            kv_cache=cache,
            temperature=temperature,
            remasking=remasking,
            noise="upstream",
            **rule,
        )
        assert got == want, (i, p)


def test_noise_option_is_in_the_schema(m):
    from localdiff.errors import UsageError

    spec = m.options_cls.spec("noise")
    assert spec.default == "block" and spec.choices == ("block", "upstream")
    with pytest.raises(UsageError, match="noise: must be one of block, upstream"):
        _ours(m, PROMPTS[0], 0, 4, noise="global")
