"""DFlash (and plain causal decoding) across turns: the conversation cache (``localdiff.cache.causal.CausalCache``)
keeps the target's K/V, the draft's context K/V and the pending target features of the conversation so far, and a
next prompt that starts with it prefills only the rest — tokens and per-step acceptance lengths equal to a run
without the cache, and the cache afterwards equal to what a fresh run leaves (random tiny Qwen3 target + draft as
tests/decoding/test_dflash.py builds them, and the shipped trained pair tiny-qwen3 + tiny-dflash)."""

from __future__ import annotations

import pytest
import torch

import localdiff
from dflash_ref import VOCAB, force_acceptance, target_config, write_draft, write_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, draft folder) of a random pair whose draft is often accepted (force_acceptance)."""
    root = tmp_path_factory.mktemp("turns")
    write_target(root / "target", "qwen3")
    write_draft(root / "draft", target_config("qwen3"), layers=2, block_size=5)
    force_acceptance(root / "target", root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def spec(pair):
    return localdiff.load(str(pair[0]), device="cpu", draft=str(pair[1]))


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB - 3, (n,), generator=g).tolist()


def _kv(cache, i):
    return [t.clone() for t in cache.past(i)] if cache.visible_len(i) else []


def assert_same_state(a, b):
    """Two conversation caches hold the same tokens and (to float rounding) the same K/V and features."""
    assert a.target.token_ids == b.target.token_ids
    assert (a.draft is None) == (b.draft is None)
    pairs = [(a.target, b.target)]
    if a.draft is not None:
        assert a.draft.token_ids == b.draft.token_ids and a.feat_start == b.feat_start == a.draft.seq_len
        assert a.feat_ids.tolist() == b.feat_ids.tolist()
        torch.testing.assert_close(a.feats, b.feats, atol=1e-4, rtol=1e-4)
        pairs.append((a.draft, b.draft))
    for x, y in pairs:
        for i in range(len(x.layers)):
            for u, v in zip(_kv(x, i), _kv(y, i), strict=True):
                torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [None, 3])
def test_turns_reuse_the_conversation_and_equal_runs_without_it(spec, block_size):
    g = torch.Generator().manual_seed(5)
    cache = spec.new_cache()
    conv, held = _rand(6, g), 0
    kw = {"block_size": block_size} if block_size else {}
    for turn in range(5):
        mine = spec.generate(conv, max_new_tokens=17, chat=False, cache=cache, **kw)
        fresh = spec.new_cache()
        alone = spec.generate(conv, max_new_tokens=17, chat=False, cache=fresh, **kw)
        assert mine.token_ids == alone.token_ids and mine.stats.acceptance_lengths == alone.stats.acceptance_lengths
        assert mine.stats.prefill_tokens_reused == held and alone.stats.prefill_tokens_reused == 0
        assert mine.stats.prefill_tokens_computed == len(conv) - held
        assert mine.stats.acceptance_length == pytest.approx(
            sum(mine.stats.acceptance_lengths) / len(mine.stats.acceptance_lengths)
        )
        assert_same_state(cache, fresh)
        held = len(conv) + len(mine.token_ids) - 1  # the answer's last token opens the next block
        assert cache.seq_len == held == cache.draft.seq_len + cache.feats.shape[1]
        conv = conv + mine.token_ids + _rand(3, g)
    assert cache.draft.seq_len > 40  # the draft's K/V were kept, not rebuilt


def test_plain_causal_decoding_reuses_its_cache_too(pair):
    alone = localdiff.load(str(pair[0]), device="cpu")
    g = torch.Generator().manual_seed(9)
    cache = alone.new_cache()
    conv = _rand(5, g)
    for turn in range(3):
        mine = alone.generate(conv, max_new_tokens=12, chat=False, cache=cache)
        assert mine.token_ids == alone.generate(conv, max_new_tokens=12, chat=False).token_ids
        assert mine.stats.prefill_tokens_reused == (0 if turn == 0 else len(conv) - 4)
        assert cache.draft is None
        conv = conv + mine.token_ids + _rand(3, g)


def test_an_edited_or_another_conversation_keeps_only_what_agrees(spec):
    g = torch.Generator().manual_seed(3)
    cache = spec.new_cache()
    conv = _rand(8, g)
    first = spec.generate(conv, max_new_tokens=16, chat=False, cache=cache)
    conv = conv + first.token_ids + _rand(4, g)
    cases = [
        (conv[:5] + [(conv[5] + 1) % (VOCAB - 3)] + conv[6:], 5),  # an edited earlier turn
        (conv[:12], 11),  # a shorter prompt inside the cache
        ([(conv[0] + 1) % (VOCAB - 3)] + conv[1:], 0),  # another conversation
        (conv, None),
    ]
    for prompt, kept in cases:
        spec.generate(conv, max_new_tokens=16, chat=False, cache=cache)  # the cache holds `conv` + an answer
        mine = spec.generate(prompt, max_new_tokens=16, chat=False, cache=cache)
        fresh = spec.new_cache()
        alone = spec.generate(prompt, max_new_tokens=16, chat=False, cache=fresh)
        assert mine.token_ids == alone.token_ids and mine.stats.acceptance_lengths == alone.stats.acceptance_lengths
        if kept is not None:
            assert mine.stats.prefill_tokens_reused == kept
        assert_same_state(cache, fresh)


def test_a_turn_without_drafting_then_one_with_drafts_stays_exact(spec):
    g = torch.Generator().manual_seed(4)
    cache = spec.new_cache()
    conv = _rand(6, g)
    for turn, bs in enumerate((None, 1, 1, None, 4)):
        kw = {"block_size": bs} if bs else {}
        mine = spec.generate(conv, max_new_tokens=14, chat=False, cache=cache, **kw)
        fresh = spec.new_cache()
        alone = spec.generate(conv, max_new_tokens=14, chat=False, cache=fresh, **kw)
        assert mine.token_ids == alone.token_ids and mine.stats.acceptance_lengths == alone.stats.acceptance_lengths
        if turn:
            assert mine.stats.prefill_tokens_reused > 0  # the target's part at least
        if bs != 1:
            assert_same_state(cache, fresh)
        conv = conv + mine.token_ids + _rand(2, g)


def test_a_cancelled_turn_leaves_a_cache_the_next_turn_can_use(spec):
    g = torch.Generator().manual_seed(8)
    cache = spec.new_cache()
    conv = _rand(7, g)
    calls = []
    events = list(
        spec.stream(
            conv, max_new_tokens=30, chat=False, cache=cache, cancel=lambda: calls.append(1) is None and len(calls) > 3
        )
    )
    assert len(calls) == 4 and not any(type(e).__name__ == "Done" for e in events)
    assert cache.seq_len > len(conv)  # the prompt and the steps that ran
    prompt = conv + _rand(3, g)
    mine = spec.generate(prompt, max_new_tokens=12, chat=False, cache=cache)
    assert mine.stats.prefill_tokens_reused >= len(conv)
    fresh = spec.new_cache()
    alone = spec.generate(prompt, max_new_tokens=12, chat=False, cache=fresh)
    assert mine.token_ids == alone.token_ids and mine.stats.acceptance_lengths == alone.stats.acceptance_lengths
    assert_same_state(cache, fresh)


def test_seeded_sampling_with_the_cache_equals_sampling_without(spec):
    g = torch.Generator().manual_seed(11)
    cache = spec.new_cache()
    conv = _rand(6, g)
    for turn in range(3):
        mine = spec.generate(conv, max_new_tokens=15, chat=False, cache=cache, seed=turn, temperature=0.9)
        alone = spec.generate(conv, max_new_tokens=15, chat=False, seed=turn, temperature=0.9)
        assert mine.token_ids == alone.token_ids and mine.stats.acceptance_lengths == alone.stats.acceptance_lengths
        conv = conv + mine.token_ids + _rand(2, g)


def test_the_chat_reuses_the_conversation_each_turn_and_shows_tau():
    import threading

    from localdiff.tui.runner import FrameSlot, GenerationFinished, GenerationJob, run_generation
    from localdiff.tui.slash import format_stats
    from localdiff.tui.widgets.status import StatusLine

    spec = localdiff.load("tiny-qwen3", device="cpu", draft="auto")
    cache = spec.new_cache()
    msgs: list[dict] = []
    for turn, q in enumerate(("What is 41 + 93?", "Reverse the letters: d r a g o n", "Sort these words: elk cat")):
        msgs.append({"role": "user", "content": q})
        posted: list = []
        run_generation(
            spec,
            cache,
            GenerationJob(list(msgs), {"max_new_tokens": 24}),
            FrameSlot(),
            posted.append,
            threading.Event(),
        )
        done = posted[-1]
        assert isinstance(done, GenerationFinished) and done.error is None
        alone = spec.generate(msgs, max_new_tokens=24)
        assert done.text == alone.text and done.stats.acceptance_lengths == alone.stats.acceptance_lengths
        prompt = len(spec.encode_prompt(msgs)[0])
        assert (done.stats.prefill_tokens_reused > 0) == (turn > 0)
        assert done.stats.prefill_tokens_computed == prompt - done.stats.prefill_tokens_reused
        tau = f"DFlash τ {done.stats.acceptance_length:.2f} over {len(done.stats.acceptance_lengths)} drafted block"
        assert tau in format_stats(done.stats)
        bar = StatusLine()
        bar.show_stats(done.stats)
        assert f"τ {done.stats.acceptance_length:.2f}" in bar.line()
        msgs.append({"role": "assistant", "content": done.text})
