"""Masked-family decoders (#15): LLaDA, Dream, Fast-dLLM parallel decoding and prefix / dual caches, against the
compact transcriptions of the upstream code in ``upstream_masked.py``, on the contract-exact fake model
``fake_masked.FakeMaskedNet`` (random weights, temperature 0: deterministic)."""

from __future__ import annotations


import pytest
import torch

from fake_masked import fake_model
from localdiff.errors import CheckpointError, UsageError
from localdiff.events import CanvasDone, Done, StepEvent
import upstream_masked as up

MASK = 36
PROMPTS = [
    torch.randint(3, 36, (int(n),), generator=torch.Generator().manual_seed(100 + i)).tolist()
    for i, n in enumerate(torch.randint(2, 10, (20,), generator=torch.Generator().manual_seed(7)))
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def make(monkeypatch, tmp_path):
    """make(**config overrides) → Model over a FakeMaskedNet (registered as a masked-family model_type)."""

    def _make(seed=0, **over):
        return fake_model(monkeypatch, tmp_path, seed=seed, **over)

    return _make


def _answer(x, prompt):
    return x[0, len(prompt) :].tolist()


def _gen(m, prompt, n, **kw):
    return m.generate(list(prompt), max_new_tokens=n, seed=0, chat=False, **kw)


# ------------------------------------------------------------------------------------------------ LLaDA generate
@pytest.mark.parametrize("gen_length,block_length,steps", [(16, 16, 16), (16, 4, 8), (12, 4, 12), (16, 8, 4)])
def test_llada_equals_upstream_transcription(make, gen_length, block_length, steps):
    m = make()
    for p in PROMPTS:
        want = up.llada_generate(m.net.logits_full, torch.tensor([p]), steps, gen_length, block_length)
        g = _gen(m, p, gen_length, steps=steps, block_length=block_length)
        assert g.token_ids == _answer(want, p), p
        assert g.stats.new_tokens == gen_length == len(g.stats.commit_step)


def test_llada_classifier_free_guidance_equals_upstream(make):
    m = make()
    for p in PROMPTS[:6]:
        want = up.llada_generate(m.net.logits_full, torch.tensor([p]), 8, 8, 4, cfg_scale=1.5)
        assert _gen(m, p, 8, steps=8, block_length=4, cfg_scale=1.5).token_ids == _answer(want, p)


def _eos_inside_a_block(make):
    """(prompt, upstream answer, k, model whose EOS is the answer's token k) for each prompt whose answer has a
    first-time token at 3 ≤ k ≤ 10 not at a block start (block length 4)."""
    m = make()
    for p in PROMPTS:
        full = _answer(up.llada_generate(m.net.logits_full, torch.tensor([p]), 16, 16, 4), p)
        k = next((k for k in range(3, 11) if full[k] not in full[:k] and k % 4 not in (0,)), None)
        if k is not None:
            yield p, full, k, make(eos_token_id=(full[k],))


def test_eos_inside_a_block_ends_generation_and_is_not_counted_past(make):
    checked = 0
    for p, full, k, me in _eos_inside_a_block(make):
        events = list(
            me.stream(list(p), max_new_tokens=16, seed=0, chat=False, steps=16, block_length=4, emit_steps=False)
        )
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason == "eos"
        assert done.token_ids == full[: k + 1]
        assert done.stats.new_tokens == k + 1 and len(done.stats.commit_step) == k + 1
        blocks = [e for e in events if isinstance(e, CanvasDone)]
        assert len(blocks) == k // 4 + 1  # later blocks never decoded
        assert done.stats.forwards == 4 * len(blocks)  # 4 steps per block, nothing after EOS
        assert done.stats.tokens_per_forward == pytest.approx((k + 1) / done.stats.forwards)
        checked += 1
    assert checked >= 10


def test_stop_at_eos_off_decodes_every_block_and_returns_the_same_answer(make):
    checked = 0
    for p, full, k, me in _eos_inside_a_block(make):
        kw = dict(max_new_tokens=16, seed=0, chat=False, steps=16, block_length=4, emit_steps=False)
        stop = list(me.stream(list(p), **kw))
        every = list(me.stream(list(p), stop_at_eos=False, **kw))
        assert every[-1].token_ids == stop[-1].token_ids == full[: k + 1]  # upstream runs every block too
        assert every[-1].finish_reason == "eos" and every[-1].stats.forwards == 16  # 4 blocks x 4 steps
        assert len([e for e in every if isinstance(e, CanvasDone)]) == 4
        assert every[-1].stats.commit_step == stop[-1].stats.commit_step
        checked += 1
    assert checked >= 10


# ------------------------------------------------------------------------------------------------ Fast-dLLM
@pytest.mark.parametrize(
    "rule", [{"threshold": 0.9}, {"threshold": 0.5}, {"threshold": 0.25}, {"factor": 1.0}, {"factor": 3.0}]
)
def test_parallel_decoding_equals_fastdllm_transcription(make, rule):
    m = make()
    tpf = []
    for p in PROMPTS:
        want, nfe = up.fastdllm_generate(m.net.logits_full, torch.tensor([p]), 16, 16, 8, **rule)
        g = _gen(m, p, 16, steps=16, block_length=8, **rule)
        assert g.token_ids == _answer(want, p), p
        assert g.stats.forwards == nfe
        tpf.append(g.stats.tokens_per_forward)
    if rule.get("threshold", 0) < 0.9:
        assert max(tpf) > 1.0  # the random model is confident enough that some steps commit several tokens


def test_threshold_one_equals_one_token_per_step_low_confidence(make):
    m = make()
    for p in PROMPTS:
        a = _gen(m, p, 12, threshold=1.0, block_length=4, steps=3)
        b = _gen(m, p, 12, steps=12, block_length=4)
        assert a.token_ids == b.token_ids and a.stats.forwards == b.stats.forwards == 12


@pytest.mark.parametrize("cache,fn", [("prefix", up.fastdllm_prefix_cache), ("dual", up.fastdllm_dual_cache)])
@pytest.mark.parametrize("rule", [{}, {"threshold": 0.5}])
def test_cached_decoding_equals_fastdllm_cached_transcription(make, cache, fn, rule):
    m = make()
    same = total = 0
    for p in PROMPTS:
        want, nfe = fn(m.net, torch.tensor([p]), 16, 16, 8, **rule)
        g = _gen(m, p, 16, steps=16, block_length=8, kv_cache=cache, **rule)
        assert g.token_ids == _answer(want, p), p
        assert g.stats.forwards == nfe
        ref = _gen(m, p, 16, steps=16, block_length=8, **rule).token_ids
        same += sum(a == b for a, b in zip(g.token_ids, ref))
        total += len(ref)
    assert same / total >= 0.6, same / total  # approximate, but close to full recompute


def test_cache_windows_follow_fast_dllm(make):
    for shift in (False, True):
        m = make(shift_logits=shift, model_type="Dream" if shift else "fake_llada")
        p = PROMPTS[0]
        for cache, rule in [("prefix", "dream"), ("dual", "dream"), ("prefix", "fastdllm"), ("dual", "fastdllm")]:
            m.net.windows.clear()
            _gen(m, p, 8, steps=8, block_length=4, kv_cache=cache, **({"block_rule": rule} if shift else {}))
            w = m.net.windows
            assert w[0] == (0, len(p) + 8, False)  # block 1 refresh: a full pass
            s = int(shift and rule == "dream")  # Fast-dLLM's Dream loop starts its windows at the block
            start = len(p) - s
            n = len(p) + 8 - start if cache == "prefix" else 4 + s
            assert w[1] == (start, n, True)
            refresh = w.index((0, len(p) + 8, False), 1)  # block 2 refresh
            assert w[refresh + 1] == (start + 4, n - 4 if cache == "prefix" else n, True)


# ------------------------------------------------------------------------------------------------ Dream
@pytest.mark.parametrize(
    "alg,steps,alg_temp",
    [
        ("entropy", 12, None),
        ("maskgit_plus", 6, None),
        ("topk_margin", 12, None),
        ("origin", 12, None),
        ("entropy", 4, 0.5),
    ],
)
def test_dream_equals_upstream_transcription(make, alg, steps, alg_temp):
    m = make(model_type="Dream", shift_logits=True)
    assert m.options_cls.POLICY == "dream"
    for i, p in enumerate(PROMPTS):
        want = up.dream_generate(
            m.net.logits_full,
            torch.tensor([p]),
            steps,
            12,
            alg=alg,
            alg_temp=alg_temp,
            generator=torch.Generator().manual_seed(i),
        )
        g = m.generate(list(p), max_new_tokens=12, seed=i, chat=False, steps=steps, alg=alg, alg_temp=alg_temp)
        assert g.token_ids == _answer(want, p), p


def test_dream_parallel_and_cached_run_and_stay_close(make):
    m = make(model_type="Dream", shift_logits=True)
    same = total = 0
    for p in PROMPTS:
        ref = _gen(m, p, 16, block_length=8, steps=16).token_ids
        for kw in ({"threshold": 0.9}, {"kv_cache": "dual"}, {"kv_cache": "prefix", "threshold": 0.5}):
            g = _gen(m, p, 16, block_length=8, steps=16, block_rule="dream", **kw)  # the caches' approximation only
            assert len(g.token_ids) == 16 and MASK not in g.token_ids
            same += sum(a == b for a, b in zip(g.token_ids, ref))
            total += 16
    assert same / total >= 0.6


# ------------------------------------------------------------------------------------------------ engine, events
def test_options_of_another_decoder_are_one_line_usage_errors(make):
    llada, dream = make(), make(model_type="Dream", shift_logits=True)
    for m, kw, want in [
        (llada, {"alg": "entropy"}, "alg: an option of the dream decoder"),
        (llada, {"entropy_bound": 0.2}, "entropy_bound: an option of the canvas_eb decoder"),
        (dream, {"cfg_scale": 1.0}, "cfg_scale: an option of the llada decoder"),
        (llada, {"threshold": 0.9, "factor": 1.0}, "not both"),
        (llada, {"cfg_scale": 1.0, "kv_cache": "dual"}, "kv_cache none"),
        (llada, {"kv_cache": "full"}, "kv_cache: must be one of none, prefix, dual"),
        (dream, {"alg": "greedy"}, "alg: must be one of origin"),
    ]:
        with pytest.raises(UsageError) as e:
            _gen(m, [5, 6], 4, **kw)
        assert want in str(e.value) and "\n" not in str(e.value)
    assert llada.sampler_options(steps="8", temperature="0.5")["steps"] == 8  # shared flag words


def test_pad_equal_to_mask_is_refused(make):
    with pytest.raises(CheckpointError, match="pad_token_id equals mask_token_id"):
        make(pad_token_id=MASK)


def test_left_padded_batch_equals_single_rows(make):
    m = make(pad_token_id=0)
    for a, b in zip(PROMPTS[:6], PROMPTS[6:12]):
        g = m.generate([list(a), list(b)], max_new_tokens=8, seed=0, chat=False, steps=8, block_length=4)
        singles = [_gen(m, q, 8, steps=8, block_length=4).token_ids for q in (a, b)]
        assert g.token_ids == singles
        assert g.stats.new_tokens == sum(len(r) for r in g.token_ids)


def test_stream_events_show_masks_and_decoding_order(make):
    m = make()
    p = PROMPTS[3]
    events = list(m.stream(list(p), max_new_tokens=8, seed=0, chat=False, steps=8, block_length=4))
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(steps) == 8 and [e.canvas_index for e in steps] == [0] * 4 + [1] * 4
    for k, e in enumerate(steps[:4]):
        assert int(e.accepted.sum()) == k + 1
        assert bool(((e.canvas_ids[0] == MASK) == ~e.accepted[0]).all())
    done = events[-1]
    assert sorted(done.stats.commit_step) == list(range(1, 9))  # one token per step: a permutation
    assert all(done.stats.commit_step[i] <= 4 for i in range(4))  # block 1 before block 2
    assert done.token_ids == _gen(m, p, 8, steps=8, block_length=4).token_ids


# ------------------------------------------------------------------------------------------------ chat
def test_chat_shows_masked_cells_and_set_resolves_per_model(make):
    from localdiff.tui.runner import MASK, MASK_TEXT, NEW, TokenText, frame_from_step
    from localdiff.tui.settings import ChatSettings, apply_set_checked

    m = make()
    ev = next(
        e
        for e in m.stream([5, 6, 7], max_new_tokens=8, seed=0, chat=False, steps=8, block_length=8)
        if isinstance(e, StepEvent)
    )
    frame = frame_from_step(ev, TokenText(None), None, m.mask_token_id)
    assert frame.count(MASK) == 7 and frame.count(NEW) == 1
    assert [t for t, s in zip(frame.tokens, frame.states) if s == MASK] == [MASK_TEXT] * 7
    s = ChatSettings()
    assert apply_set_checked(s, "steps 4", m) == "steps = 4"  # LLaDA's own option name
    assert apply_set_checked(s, "kv_cache dual", m) == "kv_cache = dual"
    with pytest.raises(UsageError, match="unknown setting"):
        apply_set_checked(s, "entropy_bound 0.2", m)
    assert s.sampler == {"steps": 4, "kv_cache": "dual"}
    assert m.new_cache() is None


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_caches_under_a_device_budget_equal_unlimited(make, cache):
    """The prefix / dual K/V in the cache tiers (localdiff.cache.window): whole layers past the device budget live in
    the host tier and are copied back to attend, so the tokens equal an unlimited budget's for 0 / partial / large
    budgets, and the device tier never holds more than the budget."""
    m = make(layers=3)
    for p in PROMPTS[:6]:
        ref = _gen(m, p, 16, steps=16, block_length=8, kv_cache=cache)
        full = sum(
            k.untyped_storage().nbytes() * 2
            for k, _ in m.net.forward_window(torch.tensor([p + [m.mask_token_id] * 16]), 0, None, None, return_kv=True)[
                1
            ]
        )
        for budget in (0, full // 2, 10 * full):
            store = m.new_cache(device_budget_bytes=budget)
            g = m.generate(
                list(p), max_new_tokens=16, seed=0, chat=False, steps=16, block_length=8, kv_cache=cache, cache=store
            )
            assert g.token_ids == ref.token_ids, (p, budget)
            acc = g.stats.cache
            assert acc["device_peak_bytes"] <= budget and acc["budget_bytes"] == budget
            if budget == 0:
                assert acc["device_peak_bytes"] == 0 and acc["host_peak_bytes"] > 0
            if budget == full // 2:
                assert 0 < acc["layers_on_host"] < 3 and acc["device_peak_bytes"] > 0
            if budget == 10 * full:
                assert acc["host_peak_bytes"] == 0 and acc["layers_on_host"] == 0
            assert store.tier.bytes == 0 and store.host.bytes == 0  # released at the end
    with pytest.raises(UsageError, match="no cache between generations"):
        _gen(m, PROMPTS[0], 8, cache=object())
