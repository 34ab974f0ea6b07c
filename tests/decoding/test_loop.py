"""The generic block loop and the engine on a fake model (no transformers): block scheduling, the fused prefill
stage, EOS / max_new_tokens stopping, and honest token counts (#22 item 9: exactly the ids returned)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fakenet import FakeConfig, FakeNet
from localdiff.engine import Model
from localdiff.events import CanvasDone, Done, StepEvent


def _model(answer, cfg=None, fill=7, gen=None):
    net = FakeNet(answer, fill=fill, cfg=cfg).eval()
    cfg = net.config
    return Model(net, cfg, None, Path("."), "fake", "cpu", torch.float32, None, dict(gen or {})), net


OPTS = dict(max_denoising_steps=3, entropy_bound=100.0, t_min=0.5, t_max=0.5)


def test_answer_spans_blocks_and_eos_ends_generation():
    m, net = _model([10, 11, 12, 13, 14, 1, 20, 21])  # EOS (1) in block 2
    evs = list(m.stream([3, 4, 5], chat=False, seed=0, max_new_tokens=12, **OPTS))
    done = evs[-1]
    assert isinstance(done, Done) and done.finish_reason == "eos"
    assert done.token_ids == [10, 11, 12, 13, 14, 1]  # EOS kept, nothing after it
    assert [e.canvas_index for e in evs if isinstance(e, CanvasDone)] == [0, 1]
    assert done.stats.new_tokens == len(done.token_ids) == 6
    assert done.seed == 0 and done.options["max_denoising_steps"] == 3
    steps = [e for e in evs if isinstance(e, StepEvent)]
    assert steps and all(e.confidence is not None for e in steps)


@pytest.mark.parametrize("pad", [None, 0, 1])
def test_new_tokens_count_exactly_the_ids_returned(pad):
    """No pad id, a distinct pad id, and pad == EOS: new_tokens is the length of what the caller gets."""
    cfg = FakeConfig(pad_token_id=pad)
    m, _ = _model([10, 11, 1, 5, 5, 5], cfg=cfg)
    g = m.generate([3, 4], chat=False, seed=1, max_new_tokens=8, **OPTS)
    assert g.token_ids == [10, 11, 1]
    assert g.stats.new_tokens == 3 and g.stats.tokens_per_forward == pytest.approx(3 / g.stats.forwards)


def test_batch_counts_sum_the_rows():
    m, _ = _model([10, 1, 9, 9])
    g = m.generate([[3, 4], [5, 6]], chat=False, seed=1, max_new_tokens=4, **OPTS)
    assert g.token_ids == [[10, 1], [10, 1]] and g.stats.new_tokens == 4


def test_max_new_tokens_cuts_the_last_block():
    m, net = _model(list(range(10, 30)))
    g = m.generate([3], chat=False, seed=2, max_new_tokens=6, **OPTS)
    assert g.token_ids == list(range(10, 16)) and g.finish_reason == "length" and g.stats.canvases == 2


def test_fused_stage_prefills_the_prompt_and_each_finished_block_once():
    m, net = _model(list(range(10, 30)))
    cache = m.new_cache()
    g = m.generate([3, 4, 5], chat=False, seed=3, max_new_tokens=8, cache=cache, **OPTS)
    # prompt (3) + block 1 (4) prefilled, fused with the next blocks' first steps; the last block is not prefilled
    assert cache.token_ids == [[3, 4, 5, 10, 11, 12, 13]] and cache.seq_len == 7
    assert g.stats.prefill_tokens_computed == 7
    assert net.forwards == g.stats.forwards


def test_stream_and_generate_agree_and_second_stream_in_one_thread_is_refused():
    m, _ = _model([10, 11, 12, 13, 1])
    g = m.generate([3, 4], chat=False, seed=4, max_new_tokens=8, **OPTS)
    s = [e for e in m.stream([3, 4], chat=False, seed=4, max_new_tokens=8, **OPTS) if isinstance(e, Done)][0]
    assert g.token_ids == s.token_ids and g.stats.forwards == s.stats.forwards
    first = m.stream([3, 4], chat=False, seed=4, max_new_tokens=8, **OPTS)
    next(first)
    with pytest.raises(Exception, match="already running"):
        next(m.stream([3, 4], chat=False, seed=4, max_new_tokens=8, **OPTS))
    first.close()  # closing releases the lock
    assert m.generate([3, 4], chat=False, seed=4, max_new_tokens=8, **OPTS).token_ids == g.token_ids
