"""Canvas decoding: reference-exact generation, step-exact sampler, properties of the sampler parts."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import localdiff
from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.decoding import (
    AcceptanceConfig,
    CorrectionConfig,
    accept,
    correct,
    finalize_canvas,
    renoise,
    token_entropy,
)

import transformers  # noqa: F401 — test-only reference (the `test` extra)


def _new_tokens(m, ids, seed, n_new, steps, mask=None):
    """Full new-token rows (pad kept) from our stream, as the reference returns them."""
    canv = []
    for ev in m.stream(
        ids,
        chat=False,
        seed=seed,
        max_new_tokens=n_new,
        max_denoising_steps=steps,
        attention_mask=mask,
        emit_steps=False,
    ):
        if isinstance(ev, CanvasDone):
            canv.append(ev.token_ids)
    return torch.cat(canv, 1)


@pytest.mark.parametrize("batch", [1, 2])
def test_reference_exact_generation(ref_small, batch):
    ref, path = ref_small
    m = localdiff.load(path, device="cpu")
    c_len = m.config.canvas_length
    same = 0
    for seed in range(20):
        g = torch.Generator().manual_seed(1000 + seed)
        ids = torch.randint(3, m.config.vocab_size, (batch, 11), generator=g)
        mask = None
        kw = {}
        if batch == 2:
            mask = torch.ones(2, 11, dtype=torch.long)
            mask[1, :4] = 0
            ids[1, :4] = 0
            kw["attention_mask"] = mask
        torch.manual_seed(seed)
        out = ref.generate(
            ids,
            max_new_tokens=3 * c_len,
            max_denoising_steps=8,
            eos_token_id=m.eos_token_ids,
            pad_token_id=m.pad_token_id,
            **kw,
        )
        theirs = out.sequences[:, ids.shape[1] :]
        ours = _new_tokens(m, ids, seed, 3 * c_len, 8, mask)
        same += theirs.shape == ours.shape and bool((theirs == ours).all())
    assert same >= 17, f"only {same}/20 seeds identical"


def test_step_exact_against_reference_sampler():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
    )
    from localdiff.decoding import linear_temperature
    from localdiff.decoding.acceptance import entropy_bound_mask

    b, c, v = 3, 16, 50
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        raw = torch.randn(b, c, v, generator=g) * 4
        canvas = torch.randint(0, v, (b, c), generator=g)
        for cur in (8, 3, 1):
            proc_ref = LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, 8)(
                None, raw, torch.tensor(cur, dtype=torch.int32)
            )
            proc = raw / linear_temperature(cur, 8, 0.4, 0.8)
            assert torch.equal(proc, proc_ref)
            sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.3), c, v, 8)
            draft = torch.randint(0, v, (b, c), generator=g)
            torch.manual_seed(seed)
            acc_ref = sampler.accept_canvas(canvas, draft, proc_ref, cur)
            next_ref = sampler.renoise_canvas(acc_ref, cur)
            ent = token_entropy(proc)
            acc, _ = accept(ent, None, None, AcceptanceConfig(0.3, None))
            assert torch.equal(acc, sampler.accepted_token_mask)
            gen = torch.Generator().manual_seed(seed)
            nxt, _ = renoise(torch.where(acc, draft, canvas), acc, v, gen)
            assert torch.equal(nxt, next_ref)
            assert torch.equal(proc.argmax(-1), proc_ref.argmax(-1))
            assert torch.equal(entropy_bound_mask(ent, 0.3), sampler.accepted_token_mask)


def test_max_new_tokens_spans_canvases_and_eos_stops(ref_small):
    _, path = ref_small
    m = localdiff.load(path, device="cpu")
    c_len = m.config.canvas_length
    evs = list(m.stream([5, 6, 7, 8], chat=False, seed=1, max_new_tokens=int(2.5 * c_len), max_denoising_steps=3))
    dones = [e for e in evs if isinstance(e, CanvasDone)]
    eos = set(m.eos_token_ids)
    first_eos = next((i for i, d in enumerate(dones) if any(t in eos for t in d.token_ids[0].tolist())), None)
    # 2.5 canvases of room → 3 canvases, unless an EOS ended the generation earlier: then it is the last canvas
    assert len(dones) == (3 if first_eos is None else first_eos + 1)
    done = evs[-1]
    assert isinstance(done, Done) and len(done.token_ids) <= int(2.5 * c_len)
    assert done.finish_reason == ("length" if first_eos is None else "eos")
    # force an EOS in canvas 1 with a start canvas of EOS tokens and a model that keeps it: check finalization
    canvas = torch.tensor([[9, 1, 7, 7]])
    out, fin = finalize_canvas(canvas, torch.tensor([False]), torch.tensor([1]), 0)
    assert out.tolist() == [[9, 1, 0, 0]] and fin.tolist() == [True]


def test_eos_in_first_canvas_ends_generation(ref_small):
    _, path = ref_small
    m = localdiff.load(path, device="cpu")
    # make EOS overwhelmingly likely: bias the tied embedding row of EOS via the LM head
    eos = m.eos_token_ids[0]
    with torch.no_grad():
        m.net.embed_tokens.weight[eos] *= 0
        m.net.embed_tokens.weight[eos] += m.net.norm.weight.sign() * 50
    evs = list(
        m.stream([5, 6, 7], chat=False, seed=0, max_new_tokens=4 * m.config.canvas_length, max_denoising_steps=4)
    )
    done = evs[-1]
    assert isinstance(done, Done) and done.finish_reason == "eos"
    assert sum(isinstance(e, CanvasDone) for e in evs) == 1


def test_tokens_per_forward_counts(ref_small):
    _, path = ref_small
    m = localdiff.load(path, device="cpu")
    evs = list(
        m.stream([4, 5, 6], chat=False, seed=3, max_new_tokens=2 * m.config.canvas_length, max_denoising_steps=5)
    )
    steps = sum(isinstance(e, StepEvent) for e in evs)
    canv = torch.cat([e.token_ids for e in evs if isinstance(e, CanvasDone)], 1)
    st_ = evs[-1].stats
    assert st_.forwards == steps
    assert st_.new_tokens == int((canv != m.pad_token_id).sum())
    assert math.isclose(st_.tokens_per_forward, st_.new_tokens / st_.forwards)


def test_chat_template_sandbox_refuses_hostile_template(tmp_path):
    from localdiff.tokenizer import ChatTemplateError, Tokenizer
    from tokenizers import Tokenizer as HF, models

    HF(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages.__class__.__init__.__globals__['os'].system('echo pwned > " + str(tmp_path / "x") + "') }}"
    )
    tok = Tokenizer(tmp_path, [1], 0)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert not (tmp_path / "x").exists()
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<model>{% endif %}"
    )
    tok = Tokenizer(tmp_path, [1], 0)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<model>"


# -- properties of the sampler parts (synthetic logits) ----------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(2, 24),
    st.integers(3, 40),
    st.floats(0.01, 3.0),
    st.sampled_from([None, 0.5, 0.9, 0.99]),
    st.integers(0, 2**31 - 1),
)
def test_acceptance_properties(b, c, v, bound, tau, seed):
    g = torch.Generator().manual_seed(seed)
    locked = torch.zeros(b, c, dtype=torch.bool) if tau is not None else None
    tokens = torch.randint(0, v, (b, c), generator=g)
    for _ in range(c + 2):
        logits = torch.randn(b, c, v, generator=g) * 3
        probs = logits.softmax(-1)
        acc, new = accept(token_entropy(logits), probs.max(-1).values, locked, AcceptanceConfig(bound, tau))
        assert acc.shape == (b, c)
        if locked is None:
            assert bool(acc.any(-1).all())  # EB always accepts the lowest-entropy position
            break
        free_before = ~locked
        assert bool((new & ~free_before).sum() == 0)  # only free positions newly lock
        assert bool(((new.sum(-1) >= 1) | ~free_before.any(-1)).all())  # progress while anything is free
        draft = torch.randint(0, v, (b, c), generator=g)
        tokens = torch.where(locked, tokens, torch.where(new, draft, tokens))
        before = tokens.clone()
        locked = locked | new
        assert torch.equal(tokens[locked & ~new], before[locked & ~new])
    if locked is not None:
        assert bool(locked.all())  # the canvas completes within C steps


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(2, 20), st.integers(0, 6), st.integers(0, 2**31 - 1))
def test_correction_respects_cap(b, c, cap, seed):
    g = torch.Generator().manual_seed(seed)
    locked = torch.rand(b, c, generator=g) < 0.7
    tokens = torch.randint(0, 3, (b, c), generator=g)
    p = torch.rand(b, c, generator=g)
    spent = torch.randint(0, cap + 1, (b,), generator=g)
    cfg = CorrectionConfig(True, 0.5, True, cap)
    re = correct(locked, tokens, p, spent, cfg)
    assert bool((re & ~locked).sum() == 0)
    assert bool((re.sum(-1) <= (cap - spent).clamp(min=0)).all())
    assert not correct(locked, tokens, p, spent, CorrectionConfig(False)).any()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_finalize_pads_after_first_eos(b, c, seed):
    g = torch.Generator().manual_seed(seed)
    canvas = torch.randint(0, 6, (b, c), generator=g)
    prev = torch.rand(b, generator=g) < 0.3
    out, fin = finalize_canvas(canvas, prev, torch.tensor([1, 2]), 0)
    assert out.shape == canvas.shape
    for r in range(b):
        row = out[r].tolist()
        if prev[r]:
            assert set(row) == {0} and fin[r]
            continue
        eos_at = [i for i, t in enumerate(canvas[r].tolist()) if t in (1, 2)]
        if eos_at:
            k = eos_at[0]
            assert row[: k + 1] == canvas[r, : k + 1].tolist() and set(row[k + 1 :]) <= {0} and fin[r]
        else:
            assert row == canvas[r].tolist() and bool(fin[r]) == (set(row) == {0})  # all-pad canvas ends a row


def test_generation_loop_properties_with_locking_and_correction(ref_small):
    """With locking + correction on, every canvas ends within max steps, canvas length is invariant, locked tokens
    change only through reopening, and the loop accepts at least one position per step."""
    _, path = ref_small
    m = localdiff.load(path, device="cpu")
    prev, seen = None, 0
    for ev in m.stream(
        [4, 5, 6],
        chat=False,
        seed=5,
        max_new_tokens=2 * m.config.canvas_length,
        max_denoising_steps=6,
        threshold=0.5,
        correction=True,
        correction_floor=0.2,
        correction_max_reopens=2,
    ):
        if isinstance(ev, StepEvent):
            seen += 1
            assert ev.canvas_ids.shape == (1, m.config.canvas_length) and ev.step <= 6
            assert bool(ev.accepted.any())
            if prev is not None and prev.canvas_index == ev.canvas_index:
                assert ev.locked is not None and bool((ev.locked <= ev.accepted).all())
                kept = prev.locked & ~ev.reopened
                assert torch.equal(ev.canvas_ids[kept], prev.canvas_ids[kept])
            prev = ev
    assert seen >= 2 and prev is not None and prev.locked is not None  # the properties were checked on real steps


@pytest.mark.parametrize("opts", [{}, {"threshold": 0.9, "correction": True}])
def test_final_step_without_draws_gives_the_same_tokens(ref_small, opts):
    """Without step events, the step that ends the generation skips its (unused) draws: same tokens and forwards
    as the full loop that streams every step, over seeds that end by EOS, by the step cap and by max_new_tokens."""
    m = localdiff.load(ref_small[1], device="cpu")
    c_len = m.config.canvas_length
    for seed in range(12):
        kw = dict(
            chat=False, seed=seed, max_new_tokens=(1 + seed % 3) * c_len, max_denoising_steps=2 + seed % 4, **opts
        )
        g = m.generate([4 + seed, 5, 6], **kw)
        done = [ev for ev in m.stream([4 + seed, 5, 6], emit_steps=True, **kw) if isinstance(ev, Done)][0]
        assert g.token_ids == done.token_ids and g.stats.forwards == done.stats.forwards


@pytest.mark.parametrize("rows,vocab,seed", [(32, 365, 0), (64, 4096, 1), (3, 20000, 2), (7, 700, 3), (1, 262144, 4)])
def test_categorical_equals_torch_multinomial(rows, vocab, seed):
    """Same token per row and the same generator state afterwards as torch.multinomial(p, 1), over consecutive draws
    interleaved with other uses of the generator (so draws start mid-block and cross MT19937 block boundaries), with
    peaked, flat and one-hot rows and zero probabilities."""
    from localdiff.decoding import categorical

    g = torch.Generator().manual_seed(seed)
    ours, theirs = torch.Generator(), torch.Generator()
    ours.set_state(g.get_state())
    theirs.set_state(g.get_state())
    for step in range(6):
        logits = torch.randn(rows, vocab, generator=g) * (0.1, 1.0, 8.0)[step % 3]
        p = torch.softmax(logits, -1)
        p[0, : vocab // 2] = 0.0
        if rows > 1:
            p[1] = 0.0
            p[1, step] = 1.0
        a, b = categorical(p, ours), torch.multinomial(p, 1, generator=theirs)
        assert torch.equal(a, b)
        assert torch.equal(ours.get_state(), theirs.get_state())
        torch.randint(0, 9, (step + 1,), generator=ours)
        torch.randint(0, 9, (step + 1,), generator=theirs)
    from localdiff.decoding import draws

    assert draws._fast_ok is True  # the vectorised path ran (its self-check passed on this platform)


def test_categorical_bad_probabilities_raise_like_torch():
    from localdiff.decoding import categorical

    p = torch.full((4, 5000), 1 / 5000)
    p[2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor"):
        categorical(p, torch.Generator().manual_seed(0))
    p = torch.full((4, 5000), 1 / 5000)
    p[1] = 0.0
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        categorical(p, torch.Generator().manual_seed(0))


def test_categorical_transposed_input_like_torch():
    """torch draws into empty_like(probs), whose memory order follows a transposed input's."""
    from localdiff.decoding import categorical

    p = torch.softmax(torch.randn(5000, 4, generator=torch.Generator().manual_seed(1)), 0).t()
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(categorical(p, a), torch.multinomial(p, 1, generator=b))
