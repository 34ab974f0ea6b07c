"""dInfer's decoders (threshold, credit, hierarchy) and its vicinity refresh of the dual cache, as options of the
masked family's ``llada`` decoder, against the transcriptions of dInfer's code in ``upstream_dinfer.py``: the rules on
the same logits step by step (temperature 0 and > 0), and whole generations on the contract-exact fake model
(``fake_masked.FakeMaskedNet``, random weights, temperature 0) — tokens, forwards, the windows recomputed and the
K/V stored at each refresh."""

from __future__ import annotations


import pytest
import torch

import upstream_dinfer as up
from fake_masked import fake_model
from localdiff.decoding import masked_loop
from localdiff.decoding.dinfer_credit import CreditDecoder
from localdiff.decoding.dinfer_hierarchy import HierarchyDecoder
from localdiff.decoding.dinfer_threshold import ThresholdDecoder
from localdiff.errors import UsageError

MASK = 36
PROMPTS = [
    torch.randint(3, 36, (int(n),), generator=torch.Generator().manual_seed(300 + i)).tolist()
    for i, n in enumerate(torch.randint(2, 12, (20,), generator=torch.Generator().manual_seed(9)))
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def make(monkeypatch, tmp_path):
    def _make(seed=0, **over):
        return fake_model(monkeypatch, tmp_path, seed=seed, scale=5.0, **over)

    return _make


def _upstream_decoder(kind, threshold=None, low_threshold=0.3, temperature=0.0):
    thr = 0.9 if threshold is None else threshold
    common = dict(temperature=temperature, mask_id=MASK, eos_id=-1)
    if kind == "threshold":
        return up.ThresholdParallelDecoder(threshold=thr, **common)
    if kind == "credit":
        return up.CreditThresholdParallelDecoder(threshold=thr, **common)
    return up.HierarchyDecoder(threshold=thr, low_threshold=low_threshold, **common)


def _ours(kind, threshold=None, temperature=0.0, gen=None):
    if kind == "threshold":
        return ThresholdDecoder(threshold, temperature, gen, MASK)
    if kind == "credit":
        return CreditDecoder(threshold, temperature, gen, MASK, 0.7, 0.2, 0.8)
    return HierarchyDecoder(threshold, 0.3, temperature, gen)


# ------------------------------------------------------------------------------------------------ the rules alone
@pytest.mark.parametrize("kind", ["threshold", "credit", "hierarchy"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rules_equal_dinfer_step_by_step_on_the_same_logits(kind, temperature):
    """20 blocks of 12 positions, each decoded to the end with fresh random logits per step (spread so that several
    positions pass the thresholds); the block after every step equals dInfer's decoder's."""
    g = torch.Generator().manual_seed(1)
    multi = 0
    for b in range(20):
        block = torch.randint(0, MASK, (1, 12), generator=g)
        block[torch.rand(1, 12, generator=g) < 0.75] = MASK
        ref_x = up.TokenArray(torch.zeros(1, 0, dtype=torch.long), 12, MASK, -1)
        ref_x.data[:] = block
        ours_x = block.clone()
        dec, mine = (
            _upstream_decoder(kind, temperature=temperature),
            _ours(kind, temperature=temperature, gen=torch.Generator()),
        )
        dec.block_init(block, 0)
        mine.begin_block()
        while bool((ours_x == MASK).any()):
            logits = torch.randn(1, 12, 40, generator=g) * 4
            if b % 2:  # near-tied positions (dInfer commits every one within 1e-5 of the top)
                logits[0, 1::3] = logits[0, 0] + 1e-6 * torch.randn(4, 40, generator=g)
            logits[..., MASK] = -torch.inf
            seed = int(torch.randint(0, 2**31, (1,), generator=g))
            torch.manual_seed(seed)
            mine.gen.manual_seed(seed)
            dec.decode(logits, 0, 12, ref_x)
            masked = ours_x == MASK
            x0, transfer = mine.step(logits, ours_x, masked)
            multi += int(transfer.sum()) > 1
            ours_x = torch.where(transfer, x0, ours_x)
            assert torch.equal(ours_x, ref_x.data), b
    assert multi > 5  # the rules committed several tokens at once often enough to matter


def test_threshold_confidence_is_dinfers_float32_softmax():
    """τ set to a position's float32 confidence exactly: dInfer (float32 softmax, ≥) commits it; a float64
    confidence may fall just below."""
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        logits = torch.randn(1, 8, 40, generator=g) * 3
        logits[..., MASK] = -torch.inf
        x = torch.full((1, 8), MASK)
        p = torch.softmax(logits, -1).max(-1).values[0]
        thr = float(p.sort().values[-3])  # the third most confident
        ref = up.TokenArray(torch.zeros(1, 0, dtype=torch.long), 8, MASK, -1)
        up.ThresholdParallelDecoder(0.0, thr, mask_id=MASK).decode(logits, 0, 8, ref)
        x0, t = ThresholdDecoder(thr, 0.0, None, MASK).step(logits, x, x == MASK)
        assert torch.equal(torch.where(t, x0, x), ref.data) and int(t.sum()) >= 3


# ------------------------------------------------------------------------------------------------ generations
def _run(m, p, n, block, kind, upstream_kw, **ours_kw):
    model = up.DInferModel(m.net, MASK)
    dec = _upstream_decoder(kind, ours_kw.get("threshold"))
    want, _ = up.generate(model, dec, torch.tensor([p]), n, block, maximum_unroll=1, **upstream_kw)
    m.net.windows.clear()
    stored = []
    place = masked_loop._OnDevice.place
    masked_loop._OnDevice.place = lambda self, kv: stored.append(kv) or place(self, kv)
    try:
        g = m.generate(
            list(p), max_new_tokens=n, seed=0, chat=False, block_length=block, parallel_decoding=kind, **ours_kw
        )
    finally:
        masked_loop._OnDevice.place = place
    return want[0, len(p) :].tolist(), g, model, stored


@pytest.mark.parametrize("kind", ["threshold", "credit", "hierarchy"])
@pytest.mark.parametrize("cache,align", [("none", False), ("dual", True), ("prefix", False)])
def test_generation_equals_dinfer_blockwise(make, kind, cache, align):
    m = make()
    tpf = []
    for p in PROMPTS:
        want, g, model, stored = _run(
            m,
            p,
            16,
            8,
            kind,
            {"cache": None if cache == "none" else cache, "start_block_align": align},
            kv_cache=cache,
            start_block_align=align,
            threshold=0.6,
        )
        assert g.token_ids == want, p
        assert g.stats.forwards == len(model.windows)
        assert m.net.windows == model.windows  # the same passes over the same windows
        tpf.append(g.stats.tokens_per_forward)
    assert max(tpf) > 1.5


@pytest.mark.parametrize("kind", ["threshold", "credit", "hierarchy"])
@pytest.mark.parametrize("look,align", [((16, 16, 4), True), ((2, 3, 1), False), ((1, 0, 0), True), ((0, 2, 3), True)])
def test_vicinity_refresh_equals_dinfer(make, kind, look, align):
    """Tokens, forwards, what each forward recomputes (window start and length, cached or not) and the K/V stored at
    every refresh equal dInfer's VicinityCacheDiffusionLLM (maximum_unroll 1)."""
    m = make()
    pl, al, wu = look
    for p in PROMPTS:
        want, g, model, stored = _run(
            m,
            p,
            16,
            4,
            kind,
            {"cache": "dual", "vicinity": look, "start_block_align": align},
            kv_cache="vicinity",
            prefix_look=pl,
            after_look=al,
            warmup_steps=wu,
            start_block_align=align,
            threshold=0.6,
        )
        assert g.token_ids == want, p
        assert m.net.windows == model.windows, p
        assert g.stats.forwards == len(model.windows)
        assert len(stored) == len(model.stored) >= 1
        for ours, theirs in zip(stored, model.stored):
            assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(ours, theirs))


def test_vicinity_windows_by_hand(make):
    """Prompt 5, answer 12, blocks of 4, prefix_look 2, after_look 3, warmup 1: one uncached pass, then the cache is
    made in block 0 (a refresh, then windows [3, 12)); block 1 refreshes once, its windows are [7, 16)."""
    m = make()
    m.net.windows.clear()
    m.generate(
        [5, 6, 7, 8, 9],
        max_new_tokens=12,
        seed=0,
        chat=False,
        block_length=4,
        parallel_decoding="hierarchy",
        kv_cache="vicinity",
        prefix_look=2,
        after_look=3,
        warmup_steps=1,
    )
    w = m.net.windows
    full = (0, 17, False)
    assert w[0] == w[1] == full and w[2] == (3, 9, True)
    b1 = w.index(full, 2)
    assert all(x == (3, 9, True) for x in w[2:b1]) and w[b1 + 1] == (7, 9, True)


def test_options_and_errors(make):
    m = make()
    from localdiff.decoding.options import cli_flags

    flags = {f for f, _, _ in cli_flags()}
    for f in (
        "--parallel-decoding",
        "--low-threshold",
        "--credit-alpha",
        "--boost-gamma",
        "--decay-beta",
        "--start-block-align",
        "--prefix-look",
        "--after-look",
        "--warmup-steps",
    ):
        assert f in flags
    assert m.sampler_options(parallel_decoding="credit")["credit_alpha"] == 0.7
    dream = make(model_type="Dream", shift_logits=True)
    for mm, kw, want in [
        (m, {"parallel_decoding": "threshold", "factor": 1.0}, "factor rule is Fast-dLLM's"),
        (m, {"parallel_decoding": "fast"}, "parallel_decoding: must be one of threshold, credit"),
        (m, {"parallel_decoding": "hierarchy", "remasking": "random"}, "low_confidence"),
        (m, {"kv_cache": "vicinity", "cfg_scale": 1.0}, "kv_cache none"),
        (dream, {"kv_cache": "vicinity"}, "kv_cache: must be one of none, prefix, dual"),
    ]:
        with pytest.raises(UsageError) as e:
            mm.generate([5, 6], max_new_tokens=4, seed=0, chat=False, **kw)
        assert want in str(e.value) and "\n" not in str(e.value)
