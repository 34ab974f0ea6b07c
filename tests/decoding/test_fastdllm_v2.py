"""Fast-dLLM v2's decoder (token shift, AR first token of each block, sub-block threshold decoding) equals a
transcription of upstream ``generate`` (temperature 0) on transformers' Qwen2 weights, through the block KV cache
with device budget unlimited / 0."""

from __future__ import annotations

import json

import pytest
import torch

import localdiff
from block_ref import EOS, MASK, ref_logits, write_upstream
from localdiff.errors import UsageError
from upstream_fastdllm_v2 import v2_generate

BLK = 6
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is far faster on a busy machine


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fdllm2")
    ref = write_upstream("Fast_dLLM_Qwen", folder, seed=7)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, bd_size=BLK)))
    return ref, localdiff.load(str(folder), dtype=torch.float32)


@pytest.mark.parametrize("plen", [3, 7, 12, 13])
@pytest.mark.parametrize("threshold,sbs,budget", [(0.05, 3, None), (1.0, 2, 0), (0.2, 6, None)])
def test_equals_upstream_generate(v2, plen, threshold, sbs, budget):
    ref, m = v2
    g = torch.Generator().manual_seed(plen)
    prompt = torch.randint(0, EOS - 2, (1, plen), generator=g)

    def logits_fn(ids):
        out = ref_logits(ref, ids, BLK)
        out[..., MASK] = -torch.inf  # a model that never predicts the mask token (ours never does)
        return out

    x = v2_generate(logits_fn, prompt, 4 * BLK, MASK, threshold, sbs, BLK, EOS)
    want = [t for t in x[0, plen:].tolist() if t != m.pad_token_id][:14]
    got = m.generate(
        prompt[0].tolist(), max_new_tokens=14, threshold=threshold, small_block_size=sbs, cache=m.new_cache(budget)
    )
    assert got.token_ids == want


def test_small_block_must_divide_the_block(v2):
    _, m = v2
    with pytest.raises(UsageError, match="small_block_size"):
        m.generate([5, 6, 7], max_new_tokens=4, small_block_size=4)


def _logits_fn(ref):
    def fn(ids):
        out = ref_logits(ref, ids, BLK)
        out[..., MASK] = -torch.inf
        return out

    return fn


@pytest.mark.parametrize("plen", [3, 5, 7, 12, 13])
@pytest.mark.parametrize("threshold,sbs,budget", [(0.05, 3, None), (1.0, 2, 0), (0.2, 3, 0), (0.1, 6, None)])
def test_sub_block_cache_equals_upstream(v2, plen, threshold, sbs, budget):
    """``kv_cache="dual"`` (= upstream's ``use_block_cache``): tokens equal the transcription of upstream's cached
    forward (its stale block K/V included), 20 prompts; with small_block_size = the block size upstream's cache is
    exact, and both equal the uncached path; ``kv_cache`` none / prefix are the exact block cache alone."""
    from upstream_fastdllm_v2 import Cached

    ref, m = v2
    prompt = torch.randint(0, EOS - 2, (1, plen), generator=torch.Generator().manual_seed(plen + 50))
    x = v2_generate(Cached(ref), prompt, 4 * BLK, MASK, threshold, sbs, BLK, EOS, use_block_cache=True)
    want = [t for t in x[0, plen:].tolist() if t != m.pad_token_id][:14]
    got = m.generate(
        prompt[0].tolist(),
        max_new_tokens=14,
        threshold=threshold,
        small_block_size=sbs,
        kv_cache="dual",
        cache=m.new_cache(budget),
    )
    assert got.token_ids == want
    same = m.generate(
        prompt[0].tolist(), max_new_tokens=14, threshold=threshold, small_block_size=sbs, use_block_cache=True
    )
    assert same.token_ids == want
    plain = m.generate(prompt[0].tolist(), max_new_tokens=14, threshold=threshold, small_block_size=sbs)
    for kv in ("none", "prefix"):
        assert (
            m.generate(
                prompt[0].tolist(), max_new_tokens=14, threshold=threshold, small_block_size=sbs, kv_cache=kv
            ).token_ids
            == plain.token_ids
        )
    if sbs == BLK:
        up = v2_generate(_logits_fn(ref), prompt, 4 * BLK, MASK, threshold, sbs, BLK, EOS)
        assert got.token_ids == plain.token_ids == [t for t in up[0, plen:].tolist() if t != m.pad_token_id][:14]
    assert got.stats.forwards == plain.stats.forwards or sbs < BLK


def test_kv_cache_option(v2):
    _, m = v2
    spec = m.options_cls.spec("kv_cache")
    assert spec.default == "prefix" and spec.choices == ("none", "prefix", "dual")
    with pytest.raises(UsageError, match="sub-block cache is kv_cache dual"):
        m.generate([5, 6, 7], max_new_tokens=4, use_block_cache=True, kv_cache="prefix")


@pytest.mark.parametrize(
    "kw,runs",
    [({"use_block_cache": True}, True), ({"kv_cache": "dual"}, True), ({"kv_cache": "prefix"}, False), ({}, False)],
)
def test_sub_block_cache_runs_fewer_rows(v2, kw, runs):
    """The cached path's sub-block passes really run only the sub-block (the arch method is called), and only with
    the sub-block cache. (On this random model its approximation never changes a token: the equality tests above
    cannot tell it is on.)"""
    ref, m = v2
    calls = []
    orig = m.net.denoise_sub
    m.net.denoise_sub = lambda ids, *a: calls.append(ids.shape[1]) or orig(ids, *a)
    try:
        m.generate([5, 6, 7, 8], max_new_tokens=12, threshold=1.0, small_block_size=3, **kw)
    finally:
        del m.net.denoise_sub
    assert (calls and set(calls) == {3}) if runs else not calls


def test_cancel_is_polled_before_every_step(v2):
    """The server's ``cancel`` callback stops Fast-dLLM v2's loop before the next forward (no Done), as the other
    loops (localdiff.decoding.loop / masked_loop)."""
    _, m = v2
    full = list(
        m.stream([5, 6, 7], max_new_tokens=12, threshold=1.0, small_block_size=2, emit_steps=True, cancel=lambda: False)
    )
    assert type(full[-1]).__name__ == "Done"
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) >= 3

    cut = list(
        m.stream([5, 6, 7], max_new_tokens=12, threshold=1.0, small_block_size=2, emit_steps=True, cancel=cancel)
    )
    assert len(calls) == 3 and [type(e).__name__ for e in cut] == ["StepEvent", "StepEvent"]


def test_sub_block_pass_logits_equal_upstream_cached_forward(v2):
    """One whole-block pass then a sub-block pass after a commit, logits within 1e-4 of the transcription of
    upstream's cached forward; the sub-block pass reads the other positions' stale K/V, so it differs from a full
    pass (the cache is approximate here, as upstream's)."""
    from upstream_fastdllm_v2 import Cached

    ref, m = v2
    prompt = torch.randint(0, EOS - 2, (1, 12), generator=torch.Generator().manual_seed(9))
    canvas = torch.tensor([[7] + [MASK] * (BLK - 1)])
    up = Cached(ref)
    up.mask_id = MASK
    up.prefill(prompt, BLK)
    cache = m.new_cache()
    m.net.prefill(prompt, cache)
    keep = [t != MASK for t in range(m.net.config.vocab_size)]
    full_up, block_up = up.block(torch.cat([prompt, canvas], 1), BLK, keep=True)
    full, block_kv = m.net.denoise_capture(canvas, cache)
    assert torch.allclose(full[..., keep], full_up[..., keep], atol=1e-4)
    canvas[0, 2] = 11  # a commit in the sub-block [2, 4)
    sub_up = up.sub(torch.cat([prompt, canvas], 1), BLK, 2, 2, block_up)
    sub = m.net.denoise_sub(canvas[:, 2:4], cache, block_kv, 2)
    assert torch.allclose(sub[..., keep], sub_up[..., keep], atol=1e-4)
    exact = m.net.denoise(canvas, cache)[:, 2:4]
    assert (exact - sub).abs().max() > 1e-3
