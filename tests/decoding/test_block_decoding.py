"""SDAR's decoder on the block family: equals a transcription of upstream SDAR generate (temperature 0) on the
transformers Qwen3 reference's weights; cached decoding (fused prefill, KV cache with device budget unlimited / 0 /
partial) equals uncached decoding token for token over 20 prompts and several blocks; our departure from upstream
(never overwrite prompt tokens); the runner's prompt handling; bad input."""

from __future__ import annotations

import math

import pytest
import torch

import localdiff
from block_ref import EOS, MASK, ref_logits, write_upstream
from localdiff.decoding.answer import strip_generated
from localdiff.decoding.options import SDAROptions
from localdiff.decoding.sdar import SDAR, transfer_schedule
from localdiff.engine.block import split_prompt
from localdiff.errors import UsageError

B = 4
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is far faster on a busy machine


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdar-dec")
    ref = write_upstream("sdar", folder, seed=3)
    return ref, localdiff.load(str(folder), dtype=torch.float32)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, EOS - 2, (n,), generator=g).tolist()


def _upstream(ref, prompt, steps, strategy, n_new, tau=0.85, eb=None, **sampling):
    from upstream_sdar import sdar_generate

    def logits_fn(ids):  # a model that never predicts the mask token (ours never commits it: see decoding/sdar.py)
        out = ref_logits(ref, ids, B)
        out[..., MASK] = -torch.inf
        return out

    x = sdar_generate(
        logits_fn,
        torch.tensor([prompt]),
        MASK,
        n_new,
        B,
        steps,
        strategy,
        tau,
        stopping_criteria_idx=[EOS],
        eb_threshold=eb,
        **sampling,
    )
    return x


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic", "sequential"])
@pytest.mark.parametrize("steps,plen", [(4, 9), (4, 7), (2, 8), (1, 12), (2, 5)])
def test_equals_upstream_sdar_generate(sdar, strategy, steps, plen):
    """Cases where upstream never overwrites the prompt: steps = B (one token per step), or a prompt ending on a
    block boundary, or a tail whose masks cover the quota (plen 5: tail 1, 3 masks, quota 2 then 2 → 2 + 1)."""
    ref, m = sdar
    for seed in range(3):
        prompt = _prompt(plen, seed)
        x = _upstream(ref, prompt, steps, strategy, 14, tau=0.3)
        up = strip_generated(x[0, plen:], [EOS], m.pad_token_id, keep_eos=True)[:14]  # pad dropped, as ours
        g = m.generate(
            prompt, max_new_tokens=14, steps=steps, remasking_strategy=strategy, confidence_threshold=0.3, temperature=0
        )
        assert g.token_ids == up, (seed, g.token_ids, up)


def test_we_never_overwrite_the_prompt_where_upstream_does(sdar):
    """steps 2 < B with a 3-token tail: upstream's first step commits 2 positions among 1 mask — a prompt token
    is replaced. Ours commits the one mask; the tail prefilled into the cache is the prompt's."""
    ref, m = sdar
    prompt = _prompt(7, 11)
    x = _upstream(ref, prompt, 2, "low_confidence_static", 8)
    assert x[0, :7].tolist() != prompt  # upstream's behaviour we do not copy
    cache = m.new_cache()
    g = m.generate(prompt, max_new_tokens=8, steps=2, remasking_strategy="low_confidence_static", cache=cache)
    assert cache.token_ids[0][:7] == prompt
    assert len(g.token_ids) <= 8


@pytest.mark.parametrize("plen", [9, 7, 8, 12, 5])
def test_entropy_bounded_equals_upstream(sdar, plen):
    """SDAR's ``entropy_bounded`` (one to several masks per step: the bound is a few times one position's entropy on
    this random model) equals the transcription of upstream's branch (its slips mended: tests/helpers/upstream_sdar.py),
    temperature 0, steps = B (upstream's ``steps + 1`` forwards then never leave masks behind)."""
    ref, m = sdar
    tpf = []
    for seed, eb in [(0, 4.0), (1, 9.0), (2, 14.0), (3, 6.0)]:  # 5 prompt lengths x 4 seeds = 20 prompts
        prompt = _prompt(plen, seed)
        x = _upstream(ref, prompt, B, "entropy_bounded", 14, eb=eb)
        up = strip_generated(x[0, plen:], [EOS], m.pad_token_id, keep_eos=True)[:14]
        g = m.generate(prompt, max_new_tokens=14, remasking_strategy="entropy_bounded", eb_threshold=eb, temperature=0)
        assert g.token_ids == up, (seed, eb, g.token_ids, up)
        tpf.append(len(g.token_ids) / g.stats.forwards)
    assert min(tpf) < 1.2 and max(tpf) > 1.5, tpf  # the bound really changes how many commit per step


@pytest.mark.parametrize(
    "base,strategy,kw",
    [
        (40, "low_confidence_dynamic", {}),
        (50, "low_confidence_static", {"top_k": 5}),
        (60, "sequential", {"top_p": 0.8}),
        (70, "entropy_bounded", {"eb": 9.0}),
    ],
)
def test_seeded_sampling_equals_upstream(sdar, base, strategy, kw):
    """Temperature 0.8 with ``seed=S`` equals upstream run after ``torch.manual_seed(S)`` (its multinomial over the
    block's [block, vocab] probabilities each step, as our draw), steps = B (no prompt overwrite); 5 prompts per
    strategy, 20 in all."""
    ref, m = sdar
    eb = kw.pop("eb", None)
    up_kw = {"top_k": kw.get("top_k", 0), "top_p": kw.get("top_p", 1.0)}
    for i in range(5):
        plen = (9, 8, 12, 5, 7)[i]
        prompt = _prompt(plen, base + i)
        with torch.random.fork_rng():
            torch.manual_seed(base + i)
            x = _upstream(ref, prompt, B, strategy, 14, tau=0.3, eb=eb, temperature=0.8, **up_kw)
        up = strip_generated(x[0, plen:], [EOS], m.pad_token_id, keep_eos=True)[:14]
        opt = {"eb_threshold": eb} if eb is not None else {}
        g = m.generate(
            prompt,
            max_new_tokens=14,
            seed=base + i,
            steps=B,
            remasking_strategy=strategy,
            confidence_threshold=0.3,
            temperature=0.8,
            **kw,
            **opt,
        )
        assert g.token_ids == up, (i, g.token_ids, up)


def test_entropy_bounded_choice():
    """Lowest entropies first while the running sum stays below the bound; at least one; never a visible token."""
    from localdiff.decoding.sdar import entropy_bounded

    ent = torch.tensor([[0.3, 0.1, 2.0, 0.2], [5.0, 4.0, 0.0, 0.0]])
    masked = torch.tensor([[True, True, True, True], [True, True, False, False]])
    got = entropy_bounded(ent, masked, 0.61)  # row 0: sums 0.1, 0.3, 0.6 < 0.61 (not 2.6); row 1: one
    assert got.tolist() == [[True, True, False, True], [False, True, False, False]]
    assert entropy_bounded(ent, torch.zeros_like(masked), 10.0).sum() == 0
    with pytest.raises(UsageError, match="eb_threshold"):
        SDAROptions.build({"eb_threshold": -1})


def test_step_entropy_is_computed_when_read_and_is_the_distributions():
    """``Assessment.entropy`` is lazy (a temperature-0 ``low_confidence_static`` step without events never computes
    its vocabulary-wide passes) and, read, is −Σ p log p of the step's distribution, the mask token excluded."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, B, 50, generator=g) * 3
    pol = SDAR(SDAROptions.build({"temperature": 0.0}), 2, B, 7, "cpu", None)
    pol.begin_block()
    a = pol.assess(logits, 1)
    assert a._entropy is None
    ev = pol.advance(a)
    assert a._entropy is None  # not even for the step's event fields, unless a StepEvent is built
    p = torch.softmax(logits.double().index_fill(-1, torch.tensor([7]), -math.inf), -1)
    want = -(p * p.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(a.entropy.double(), want, rtol=1e-5, atol=1e-6)
    assert a.entropy is a.entropy and torch.equal(ev["entropy"](), a.entropy)


def test_entropy_bounded_last_step_commits_the_rest(sdar):
    """steps 2 < B with a tiny bound (one mask per step): the second step commits every mask left, so each block
    takes 2 forwards and no mask reaches the answer (upstream would stop after steps + 1 forwards, masks left)."""
    _, m = sdar
    g = m.generate(
        _prompt(8, 3), max_new_tokens=8, steps=2, remasking_strategy="entropy_bounded", eb_threshold=1e-3, temperature=0
    )
    assert MASK not in g.token_ids and g.stats.forwards <= 4


def _uncached(net, ids, mask, opts, n_new, eos, pad):
    """The same policy, every step an uncached logits_full over prompt + finished blocks + the block."""
    ids, mask, tail = split_prompt(ids, mask, B, pad)
    b = ids.shape[0]
    seq, keep = ids[:, : ids.shape[1] - tail], (None if mask is None else mask[:, : ids.shape[1] - tail])
    first = torch.full((b, B), MASK)
    first[:, :tail] = ids[:, ids.shape[1] - tail :]
    pol = SDAR(opts, b, B, MASK, "cpu", None)
    out, finished = [], torch.zeros(b, dtype=torch.bool)
    for ci in range(math.ceil((n_new + tail) / B)):
        pol.begin_block(first if ci == 0 else None)
        for step in range(1, pol.max_steps + 1):
            full = torch.cat([seq, pol.canvas], 1)
            km = None if keep is None else torch.cat([keep, torch.ones(b, B, dtype=torch.bool)], 1)
            pol.advance(pol.assess(net.logits_full(full, km)[:, -B:], step))
            if pol.all_done():
                break
        block = pol.canvas.clone()
        gen = block[:, tail:] if ci == 0 else block
        gen[finished] = pad
        out.append(gen)
        finished |= torch.isin(gen, torch.tensor(eos)).any(-1)
        seq = torch.cat([seq, block], 1)
        keep = None if keep is None else torch.cat([keep, torch.ones(b, B, dtype=torch.bool)], 1)
        if bool(finished.all()):
            break
    rows = torch.cat(out, 1)
    return [strip_generated(r, eos, pad, keep_eos=True)[:n_new] for r in rows]


@pytest.mark.parametrize("budget", [None, 0, 3000])
def test_cached_decoding_equals_uncached_decoding(sdar, budget):
    """20 prompts (lengths 1..20: every tail length, several blocks of output), one at a time through a KV cache
    with the given device budget, and as one left-padded batch; temperature 0, dynamic threshold 0.5."""
    _, m = sdar
    opts = SDAROptions.build({"confidence_threshold": 0.5, "temperature": 0})
    prompts = [_prompt(n, 100 + n) for n in range(1, 21)]
    for p in prompts:
        want = _uncached(m.net, torch.tensor([p]), None, opts, 13, m.eos_token_ids, m.pad_token_id)[0]
        g = m.generate(p, max_new_tokens=13, cache=m.new_cache(budget), confidence_threshold=0.5)
        assert g.token_ids == want
    tiers = g.stats.cache  # the last (longest) prompt: where its blocks lived
    if budget == 0:
        assert tiers["blocks_device"] == 0 and tiers["blocks_host"] > 0
    elif budget:
        assert tiers["blocks_device"] > 0 and tiers["blocks_host"] > 0
    if budget is None:
        ids, mask = _left(prompts, m.pad_token_id)
        want = _uncached(m.net, ids, mask, opts, 13, m.eos_token_ids, m.pad_token_id)
        assert m.generate(prompts, max_new_tokens=13, confidence_threshold=0.5).token_ids == want


def _left(rows, pad):
    t = max(map(len, rows))
    ids = torch.full((len(rows), t), pad)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :] = torch.tensor(r)
        mask[i, t - len(r) :] = True
    return ids, mask


def test_cache_is_reused_across_turns_in_whole_blocks(sdar):
    _, m = sdar
    cache = m.new_cache()
    p1 = _prompt(10, 1)
    g1 = m.generate(p1, max_new_tokens=8, cache=cache)
    p2 = p1 + g1.token_ids + _prompt(5, 2)
    g2 = m.generate(p2, max_new_tokens=8, cache=cache)
    assert g2.stats.prefill_tokens_reused > 0 and g2.stats.prefill_tokens_reused % B == 0
    assert g2.token_ids == m.generate(p2, max_new_tokens=8).token_ids


def test_schedule_and_options():
    assert transfer_schedule(4, 4) == [1, 1, 1, 1] and transfer_schedule(4, 3) == [2, 1, 1]
    assert transfer_schedule(4, 6) == [1, 1, 1, 1, 0, 0]
    with pytest.raises(UsageError, match="confidence_threshold"):
        SDAROptions.build({"confidence_threshold": 2})
    with pytest.raises(UsageError, match="remasking_strategy"):
        SDAROptions.build({"remasking_strategy": "random"})


def test_steps_events_show_the_masked_block(sdar):
    _, m = sdar
    from localdiff.tui.runner import MASK as MASK_CELL, MASK_TEXT, NEW, frame_from_step

    evs = [e for e in m.stream(_prompt(6, 4), max_new_tokens=8) if type(e).__name__ == "StepEvent"]
    assert evs and any((e.canvas_ids == MASK).any() for e in evs)
    assert m.mask_token_id == MASK
    # the chat's canvas view: still-masked cells of the block being denoised read as masks, committed ones as new
    ev = next(e for e in evs if (e.canvas_ids[0] == MASK).any() and e.accepted[0].any())
    frame = frame_from_step(ev, str, None, m.mask_token_id)
    assert MASK_CELL in frame.states and NEW in frame.states and MASK_TEXT in frame.tokens


def test_sampling_is_seeded(sdar):
    _, m = sdar
    a = m.generate(_prompt(6, 5), max_new_tokens=8, temperature=1.0, top_k=5, seed=3).token_ids
    assert a == m.generate(_prompt(6, 5), max_new_tokens=8, temperature=1.0, top_k=5, seed=3).token_ids


def test_decoder_options_of_another_family_are_refused(sdar):
    _, m = sdar
    with pytest.raises(UsageError, match="block_length"):
        m.generate("x" if m.tokenizer else [1, 2], max_new_tokens=4, block_length=8)


def test_strip_generated_matches_the_position_rule():
    """strip_generated (list.index / count) keeps exactly the ids at kept_positions (the per-position rule: up to the
    first EOS, included with keep_eos, pad skipped), for any EOS set, pad id (also one equal to an EOS id), tensor
    or list input; and a kept row without its trailing EOS is the text's ids (what Answer.done decodes)."""
    import random

    from localdiff.decoding.answer import kept_positions

    rng = random.Random(3)
    for _ in range(5000):
        ids = [rng.randrange(6) for _ in range(rng.randrange(12))]
        eos, pad, keep = rng.choice([[], [1], [1, 2], [3, 1], None]), rng.choice([None, 0, 1, 4]), rng.random() < 0.5
        want = [ids[k] for k in kept_positions(ids, eos, pad, keep)]
        assert strip_generated(ids, eos, pad, keep) == want
        assert strip_generated(torch.tensor(ids, dtype=torch.long), eos, pad, keep) == want
        row = strip_generated(ids, eos, pad, keep_eos=True)
        assert (row[:-1] if row and eos and row[-1] in eos else row) == strip_generated(row, eos, pad)
