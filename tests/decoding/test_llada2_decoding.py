"""LLaDA2's decoders (policy ``llada2``) on a tiny random ``llada2_moe`` checkpoint (Hub layout), temperature 0:
token-identical to compact transcriptions of the Hub LLaDA2.0 generate (threshold, minimal_topk, eos_early_stop)
and LLaDA2.1 generate (token editing, max_post_steps), which run every step uncached over the whole sequence — so
these also show cached = uncached (KV cache with device budget unlimited / 0 / partial, 20 prompts, several
blocks); the editing bounds; option errors."""

from __future__ import annotations

import pytest
import torch

import localdiff
from llada2_ref import TINY, full_logits_fn as _logits_fn, sharp_model
from localdiff.decoding.editing import EditingConfig, block_finished, edit_positions
from localdiff.errors import UsageError
from upstream_llada2 import llada20_generate, llada21_generate

B, MASK, EOS = TINY["block_size"], TINY["mask_token_id"], TINY["eos_token_id"]


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    """A tiny checkpoint whose EOS row is boosted (EOS shows up in some answers) and whose model is sharp enough
    that thresholds commit several tokens per step."""
    return sharp_model(tmp_path_factory.mktemp("llada2-dec"))


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, EOS - 2, (n,), generator=g).tolist()


@pytest.mark.parametrize(
    "steps,threshold,minimal_topk,early",
    [(4, 0.95, 1, False), (4, 0.3, 1, True), (2, 0.5, 1, False), (4, 0.3, 7, True)],
)
def test_equals_the_hub_llada20_generate(llada2, steps, threshold, minimal_topk, early):
    m, fn = llada2, _logits_fn(llada2)
    eos_seen = 0
    for plen in (3, 4, 5, 6, 9):
        prompt = _prompt(plen, plen)
        want, fwd = llada20_generate(
            fn, torch.tensor([prompt]), B, steps, 14, threshold, minimal_topk, early, EOS, MASK
        )
        g = m.generate(
            prompt,
            max_new_tokens=14,
            steps=steps,
            threshold=threshold,
            minimal_topk=minimal_topk,
            eos_early_stop=early,
            temperature=0,
        )
        assert g.token_ids == want, (plen, g.token_ids, want)
        assert g.stats.forwards == fwd
        eos_seen += EOS in want
    assert eos_seen, "no answer reached EOS: the EOS paths were not exercised"


@pytest.mark.parametrize("top_k,top_p", [(3, None), (None, 0.5), (6, 0.7)])
def test_top_k_top_p_at_temperature_0_equal_the_hub_llada20_generate(llada2, top_k, top_p):
    """The 2.0 generate filters at temperature 0 too: the top token's probability renormalised over the kept tokens
    is the confidence the threshold sees (more commits per step than unfiltered)."""
    m, fn = llada2, _logits_fn(llada2)
    fewer = 0
    for plen in (3, 4, 5, 6, 9):
        prompt = _prompt(plen, 60 + plen)
        want, fwd = llada20_generate(fn, torch.tensor([prompt]), B, 4, 14, 0.6, 1, False, EOS, MASK, top_k, top_p)
        g = m.generate(prompt, max_new_tokens=14, steps=4, threshold=0.6, top_k=top_k, top_p=top_p, temperature=0)
        assert g.token_ids == want, (plen, g.token_ids, want)
        assert g.stats.forwards == fwd
        fewer += fwd < m.generate(prompt, max_new_tokens=14, steps=4, threshold=0.6, temperature=0).stats.forwards
    assert fewer, "the filters never changed a confidence past the threshold: the path was not exercised"


@pytest.mark.parametrize(
    "editing_threshold,max_post_steps,per_step", [(0.2, 16, 1), (0.35, 2, 1), (0.2, 0, 1), (0.2, 3, 2)]
)
def test_equals_the_hub_llada21_generate(llada2, editing_threshold, max_post_steps, per_step):
    """The 2.1 generate's ``num_to_transfer = n`` is our ``steps = B / n``."""
    m, fn = llada2, _logits_fn(llada2)
    edits = 0
    for plen in (3, 4, 5, 6, 9):
        prompt = _prompt(plen, 40 + plen)
        want, fwd, e = llada21_generate(
            fn, torch.tensor([prompt]), B, 14, 0.5, editing_threshold, max_post_steps, per_step, False, EOS, MASK
        )
        g = m.generate(
            prompt,
            max_new_tokens=14,
            steps=B // per_step,
            threshold=0.5,
            editing_threshold=editing_threshold,
            max_post_steps=max_post_steps,
            temperature=0,
        )
        assert g.token_ids == want, (plen, g.token_ids, want)
        assert g.stats.forwards == fwd
        edits += e
    if max_post_steps:
        assert edits, "no token was edited: the editing paths were not exercised"


@pytest.mark.parametrize("budget", [None, 0, 3000])
def test_cached_equals_uncached_over_20_prompts(llada2, budget):
    """Prompts of 1..20 tokens (every tail length, several blocks), through a KV cache with the given device budget,
    against the uncached 2.1 transcription; token editing on."""
    m, fn = llada2, _logits_fn(llada2)
    for n in range(1, 21):
        prompt = _prompt(n, 100 + n)
        want, _, _ = llada21_generate(fn, torch.tensor([prompt]), B, 13, 0.4, 0.25, 4, 1, False, EOS, MASK)
        g = m.generate(
            prompt,
            max_new_tokens=13,
            cache=m.new_cache(budget),
            threshold=0.4,
            editing_threshold=0.25,
            max_post_steps=4,
            temperature=0,
        )
        assert g.token_ids == want, (n, g.token_ids, want)


def test_editing_rule_and_bounds():
    cfg = EditingConfig(0.5, 2)
    tokens = torch.tensor([[5, 6, 7, 8]])
    editable = torch.tensor([[False, True, True, True]])  # position 0: the prompt
    top, prob = torch.tensor([[9, 6, 1, 2]]), torch.tensor([[0.9, 0.9, 0.6, 0.4]])
    assert edit_positions(tokens, editable, top, prob, cfg).tolist() == [[False, False, True, False]]
    assert not edit_positions(tokens, editable, top, prob, EditingConfig(None)).any()
    had, left, edited = torch.tensor([True, False, False]), torch.tensor([False] * 3), torch.tensor([True, False, True])
    # a mask step that filled the block: goes on; a post step without edits: ends; the post budget spent: ends
    assert block_finished(had, left, edited, torch.tensor([0, 1, 2]), cfg).tolist() == [False, True, True]
    assert block_finished(had, left, edited, torch.tensor([0, 1, 2]), EditingConfig(None)).tolist() == [True] * 3


def test_events_report_edits_and_the_step_cap(llada2):
    evs = [
        e
        for e in llada2.stream(
            _prompt(6, 3), max_new_tokens=8, threshold=0.5, editing_threshold=0.2, max_post_steps=2, temperature=0
        )
        if type(e).__name__ == "StepEvent"
    ]
    assert evs and max(e.step for e in evs) <= B + 2
    assert all(e.reopened is not None for e in evs)


def test_options_and_errors(llada2):
    with pytest.raises(UsageError, match="top-k / top-p need temperature > 0") as e:  # 2.1 ignores them at T 0
        llada2.generate(_prompt(5, 1), max_new_tokens=4, top_k=3, temperature=0, editing_threshold=0.5)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="editing_threshold"):
        llada2.generate(_prompt(5, 1), max_new_tokens=4, editing_threshold=1.5)
    with pytest.raises(UsageError, match="sdar"):
        llada2.generate(_prompt(5, 1), max_new_tokens=4, remasking_strategy="sequential")
    assert llada2.sampler_options()["threshold"] == 0.95


def test_cli_gen_with_token_editing_equals_the_hub_llada21_generate(tmp_path, capsys):
    """``localdiff gen -m <folder>`` on the tiny Hub-layout checkpoint (word-level tokenizer): the 2.1 decoder's ids;
    bad values and another decoder's options are one line and a non-zero exit."""
    import json

    from llada2_ref import write_checkpoint
    from localdiff.cli import main
    from wordlevel import save_wordlevel_tokenizer

    folder = write_checkpoint(tmp_path / "llada2", seed=11)
    save_wordlevel_tokenizer(folder, TINY["vocab_size"])
    argv = [
        "gen",
        "-m",
        str(folder),
        "--raw",
        "-p",
        "t5 t6 t7 t8 t9 t10",
        "-n",
        "10",
        "--json",
        "--temperature",
        "0",
        "--threshold",
        "0.3",
        "--editing-threshold",
        "0.2",
        "--max-post-steps",
        "3",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    m = localdiff.load(str(folder), dtype=torch.float32)
    want, _, _ = llada21_generate(
        _logits_fn(m), torch.tensor([[5, 6, 7, 8, 9, 10]]), B, 10, 0.3, 0.2, 3, 1, False, EOS, MASK
    )
    assert out["token_ids"] == want and out["sampler"]["editing_threshold"] == 0.2
    for bad, word in (
        (["--editing-threshold", "1.5"], "--editing-threshold"),
        (["--remasking-strategy", "sequential"], "sdar"),
    ):
        assert main(argv[:8] + bad) != 0
        err = capsys.readouterr().err.strip()
        assert word in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_sampling_is_seeded(llada2):
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=20, threshold=0.5, editing_threshold=0.3, max_post_steps=2)
    a = llada2.generate(_prompt(6, 9), seed=3, **kw).token_ids
    assert llada2.generate(_prompt(6, 9), seed=3, **kw).token_ids == a
    assert any(llada2.generate(_prompt(6, 9), seed=s, **kw).token_ids != a for s in (4, 5, 6))
