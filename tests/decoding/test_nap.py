"""Parallel-forced decoding (NAP, issue #21; localdiff.decoding.nap) on the contract-exact fake masked model:
the engine's tokens and decoding order equal a compact test-side transcription of the algorithm in nap.py's
docstring (temperature 0, deterministic); every think step touches every unfinished think block; options select the
policy; bad input is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fake_masked import CharTok, FakeMaskedConfig, FakeMaskedNet
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.decoding import nap
from localdiff.engine import Model
from localdiff.errors import LocaldiffError, UsageError
from localdiff.events import Done, StepEvent

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread for the tiny fake model

MASK, EOS = 36, 2


@pytest.fixture
def make(monkeypatch, tmp_path):
    def _make(seed=0, tokenizer=CharTok(), gen_config=None):
        cfg = dataclasses.replace(FakeMaskedConfig(eos_token_id=(EOS,), pad_token_id=0))
        monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
        return Model(
            FakeMaskedNet(cfg, seed=seed),
            cfg,
            tokenizer,
            tmp_path,
            "fake",
            "cpu",
            torch.float32,
            None,
            dict(gen_config or {}),
        )

    return _make


def reference(net, prompt, m, think, summary, steps, budget):
    """The algorithm of nap.py's docstring, transcribed with plain lists (one row, temperature 0).
    Returns (canvas ids, commit step per canvas position (0 = template), forwards)."""
    enc = CharTok().encode
    canvas, blocks = [], []
    for j in range(1, m + 1):
        canvas += enc(f"<think {j}>")
        blocks.append(list(range(len(canvas), len(canvas) + think)))
        canvas += [MASK] * think
    canvas += enc("<summary>")
    summ = list(range(len(canvas), len(canvas) + summary))
    canvas += [MASK] * summary
    n_t = m * think
    if steps is None:
        s_t, s_s = think, summary
    else:
        s_t = min(max(round(steps * n_t / (n_t + summary)), 1), steps - 1)
        s_s = steps - s_t

    def schedule(n, s):  # LLaDA get_num_transfer_tokens: n // s each step, the first n % s one more
        return [n // s + (1 if i < n % s else 0) for i in range(s)]

    k_t, k_s = schedule(n_t, s_t), schedule(summary, s_s)
    think_set = {q for b in blocks for q in b}
    commit, step, fw = [0] * len(canvas), 0, 0
    p = len(prompt)

    def predict():
        lg = net.logits_full(torch.tensor([prompt + canvas]))[0, p:].double()
        lg[:, MASK] = -float("inf")
        for q in think_set:
            lg[q, EOS] = -float("inf")
        pr = lg.softmax(-1)
        c, t = pr.max(-1)
        return t.tolist(), c.tolist()

    i = 0
    while any(canvas[q] == MASK for q in think_set):
        tok, conf = predict()
        fw += 1
        step += 1
        open_ = [[q for q in b if canvas[q] == MASK] for b in blocks]
        open_ = [b for b in open_ if b]
        u = len(open_)
        k = max(k_t[i] if i < s_t else sum(map(len, open_)), u)
        by_conf = lambda qs: sorted(qs, key=lambda q: (-conf[q], q))  # noqa: E731
        chosen = []
        if budget == "even":
            order = sorted(range(u), key=lambda b: (-max(conf[q] for q in open_[b]), b))
            share, left = [0] * u, min(k, sum(map(len, open_)))
            while left:
                for b in order:
                    if left and share[b] < len(open_[b]):
                        share[b] += 1
                        left -= 1
            for b in range(u):
                chosen += by_conf(open_[b])[: share[b]]
        else:
            chosen = [by_conf(b)[0] for b in open_]
            rest = by_conf([q for b in open_ for q in b if q not in chosen])
            chosen += rest[: max(0, k - u)]
        for q in chosen:
            canvas[q], commit[q] = tok[q], step
        i += 1
    j = 0
    while any(canvas[q] == MASK for q in summ):
        tok, conf = predict()
        fw += 1
        step += 1
        open_ = [q for q in summ if canvas[q] == MASK]
        k = min(max(k_s[j] if j < s_s else len(open_), 1), len(open_))
        for q in sorted(open_, key=lambda q: (-conf[q], q))[:k]:
            canvas[q], commit[q] = tok[q], step
        j += 1
    return canvas, commit, fw


def _run(model, prompt, **kw):
    done = None
    events = []
    for ev in model.stream(prompt, seed=0, chat=False, decoder="nap", **kw):
        if isinstance(ev, StepEvent):
            events.append(ev)
        elif isinstance(ev, Done):
            done = ev
    return done, events


@pytest.mark.parametrize(
    "m,think,summary,steps,budget",
    [
        (1, 5, 4, None, "even"),
        (2, 6, 5, None, "even"),
        (3, 4, 3, None, "confidence"),
        (2, 7, 4, 6, "even"),
        (3, 5, 4, 5, "confidence"),
        (2, 3, 6, 12, "even"),
    ],
)
def test_equals_transcription(make, m, think, summary, steps, budget):
    model = make(seed=1)
    prompt = [5, 9, 11, 4, 20]
    done, _ = _run(
        model, prompt, trajectories=m, think_length=think, summary_length=summary, steps=steps, budget=budget
    )
    canvas, commit, fw = reference(model.net, prompt, m, think, summary, steps, budget)
    end = next((k + 1 for k, t in enumerate(canvas) if t == EOS), len(canvas))  # up to the first EOS, no pad
    keep = [k for k in range(end) if canvas[k] != 0]
    assert done.token_ids == [canvas[k] for k in keep]
    assert done.stats.commit_step == [commit[k] for k in keep]
    assert done.options["trajectories"] == m and done.stats.forwards == fw


def test_every_step_touches_every_unfinished_block(make):
    model = make(seed=2)
    m, think, summary = 3, 6, 4
    _, events = _run(model, [7, 8, 9], trajectories=m, think_length=think, summary_length=summary, steps=5)
    lay = nap.layout(CharTok().encode, m, think, summary)
    before = torch.tensor([t is not None for t in lay.ids])
    think_steps = 0
    for ev in events:
        acc = ev.accepted[0]
        new = acc & ~before
        open_blocks = [(a, e) for a, e in lay.think if not bool(before[a:e].all())]
        if open_blocks:
            think_steps += 1
            for a, e in open_blocks:
                assert bool(new[a:e].any()), f"step {ev.step}: think block {a}:{e} got nothing"
            assert not bool(new[lay.summary[0] :].any())
        before = acc
    assert 1 <= think_steps <= 4  # steps=5 → S_T = round(5·18/22) = 4 think steps at most


def test_no_eos_inside_think_blocks_and_summary_ends(make):
    model = make(seed=3)
    done, _ = _run(model, [4, 4, 6], trajectories=2, think_length=8, summary_length=4)
    tag = CharTok().encode("<summary>")
    ids = done.token_ids
    at = next(k for k in range(len(ids)) if ids[k : k + len(tag)] == tag)  # the summary tag was reached
    assert EOS not in ids[:at]


def test_deterministic_and_lower_arness_than_left_to_right(make):
    model = make(seed=4)
    a, _ = _run(model, [3, 5, 7], trajectories=3, think_length=6, summary_length=4)
    b, _ = _run(model, [3, 5, 7], trajectories=3, think_length=6, summary_length=4)
    assert a.token_ids == b.token_ids and a.stats.commit_step == b.stats.commit_step
    assert a.stats.arness["global@1"] < 1.0  # 3 tokens a step, in 3 blocks: never strictly left to right
    assert a.stats.tokens_per_forward > 1.0


def test_the_decoder_option_selects_nap_and_a_nap_option_alone_names_it(make):
    model = make()
    assert model.sampler_options()["decoder"] == "llada"  # the family default
    assert model.sampler_options()["remasking"] == "low_confidence"
    assert model.sampler_options(decoder="nap", trajectories=2)["trajectories"] == 2
    with pytest.raises(UsageError, match=r"^trajectories: an option of the nap decoder.*give decoder nap"):
        model.sampler_options(trajectories=2)  # no implicit switch
    with pytest.raises(UsageError, match=r"^threshold: an option of the llada decoder.*give decoder llada"):
        model.sampler_options(decoder="nap", trajectories=2, threshold=0.9)
    with pytest.raises(UsageError, match="trajectories"):
        model.sampler_options(decoder="nap", trajectories=0)
    with pytest.raises(UsageError, match=r"^decoder: this model runs the decoders llada, nap; sdar is a block"):
        model.sampler_options(decoder="sdar")
    with pytest.raises(UsageError, match=r"^--decoder: must be one of canvas_eb, llada"):
        model.sampler_options(_typed={"decoder": "--decoder"}, decoder="nope")
    gc = make(gen_config={"decoder": "nap", "trajectories": 2, "think_length": 4, "summary_length": 3})
    assert gc.sampler_options()["trajectories"] == 2  # a checkpoint can default to NAP
    assert gc.sampler_options(decoder="llada", remasking="random")["remasking"] == "random"  # ... and run LLaDA's
    keys = make(gen_config={"trajectories": 2, "think_length": 4, "summary_length": 3})
    assert keys.sampler_options()["decoder"] == "llada"  # NAP's keys alone select nothing


def test_needs_a_tokenizer(make):
    model = make(tokenizer=None)
    with pytest.raises(LocaldiffError, match="tokenizer"):
        _run(model, [3, 4], trajectories=2, think_length=3, summary_length=2)


def test_blocks_of_and_summary_text():
    text = "<think 1> 1 + 2 = 3. <think 2> 2 + 1 = 3. <summary> 3"
    assert nap.blocks_of(text) == [("think 1", "1 + 2 = 3."), ("think 2", "2 + 1 = 3."), ("summary", "3")]
    assert nap.summary_text(text) == "3" and nap.summary_text("plain") == "plain"
    assert nap.blocks_of("plain") == [("answer", "plain")]


def test_batch_rows_decode_as_they_would_alone(make):
    model = make(seed=5)
    kw = dict(trajectories=2, think_length=5, summary_length=4, steps=7, budget="confidence")
    both, _ = _run(model, [[4, 5, 6, 7, 8], [9, 10]], **kw)
    for r, prompt in enumerate([[4, 5, 6, 7, 8], [9, 10]]):
        alone, _ = _run(model, prompt, **kw)
        assert both.token_ids[r] == alone.token_ids and both.stats.commit_step[r] == alone.stats.commit_step


def test_runs_with_the_approximate_caches(make):
    model = make(seed=6)
    for cache in ("prefix", "dual"):
        done, _ = _run(model, [3, 4, 5], trajectories=2, think_length=4, summary_length=3, kv_cache=cache)
        assert done.stats.forwards > 0 and done.stats.arness


def test_show_reports_the_checkpoints_default_decoder(tmp_path):
    from localdiff.decoding.defaults import describe

    (tmp_path / "generation_config.json").write_text('{"decoder": "nap", "trajectories": 3, "steps": 32}')
    d = describe("masked", tmp_path)
    assert d["policy"] == "nap" and d["options"]["trajectories"]["value"] == 3 and d["decoders"] == ["llada", "nap"]
    assert d["options"]["steps"]["value"] is None  # LLaDA's step count does not carry over to NAP
    assert describe("masked", tmp_path, decoder="llada")["options"]["steps"]["value"] == 32
    (tmp_path / "generation_config.json").write_text('{"trajectories": 3, "steps": 32}')
    assert describe("masked", tmp_path)["policy"] == "llada"  # NAP's keys alone select nothing
