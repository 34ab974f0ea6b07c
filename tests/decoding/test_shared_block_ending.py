"""The loops' shared pieces (issue #41 item 2): every loop takes the generation's ``Request`` and ends its blocks
through ``decoding.answer.Answer``; step events are built from the policy's fields by name, not by dict order."""

from __future__ import annotations

from pathlib import Path

import torch

from fakenet import FakeConfig, FakeNet
from localdiff.decoding.answer import Answer
from localdiff.decoding.request import Request
from localdiff.engine import Model
from localdiff.events import CanvasDone, Done, StepEvent

OPTS = dict(max_denoising_steps=3, entropy_bound=100.0, t_min=0.5, t_max=0.5)


class _RowsNet(FakeNet):
    """FakeNet with one answer per batch row."""

    def __init__(self, answers, cfg):
        super().__init__(answers[0], cfg=cfg)
        self.answers = answers

    def denoise(self, canvas_ids, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None):
        out = super().denoise(canvas_ids, cache, self_conditioning_logits, prefill_ids, prefill_mask)
        start = cache.seq_len - self.prompt_len
        out.zero_()
        for r, answer in enumerate(self.answers):
            for j in range(canvas_ids.shape[1]):
                out[r, j, answer[start + j] if start + j < len(answer) else self.fill] = self.margin
        return out


class _Tok:
    """Ids → "10 11 ..." (a decode whose pieces join to the whole)."""

    eos_token_ids: list = []

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def _model(answers, pad=0):
    cfg = FakeConfig(pad_token_id=pad)
    net = _RowsNet(answers, cfg).eval()
    return Model(net, cfg, _Tok(), Path("."), "fake", "cpu", torch.float32, None, {})


def test_a_finished_row_0_adds_no_text_without_a_pad_id():
    """Row 0 ends (EOS) in block 0 while row 1 runs on; without a pad id its later block is not padded, and its
    tokens after the EOS must not reach the CanvasDone text (they did: the block loop decoded them)."""
    m = _model([[10, 1, 11, 12, 13, 14, 15, 16], [10, 11, 12, 13, 14, 15, 16, 17]], pad=None)
    evs = list(m.stream([[3, 4], [5, 6]], chat=False, seed=0, max_new_tokens=8, **OPTS))
    done = evs[-1]
    texts = [e.text for e in evs if isinstance(e, CanvasDone)]
    assert isinstance(done, Done) and done.token_ids[0] == [10, 1] and len(texts) == 2
    assert texts == [" 10", ""] and "".join(texts) == done.text[0]


def test_step_events_take_the_policy_fields_by_name(monkeypatch):
    """A policy's ``advance`` returns the StepEvent fields as a dict; their order does not matter."""
    from localdiff.decoding.canvas_eb import CanvasEB

    def steps():
        m = _model([[10, 11, 12, 1]])
        return [e for e in m.stream([3, 4], chat=False, seed=0, max_new_tokens=4, **OPTS) if isinstance(e, StepEvent)]

    want = steps()
    advance = CanvasEB.advance
    monkeypatch.setattr(CanvasEB, "advance", lambda self, a: dict(reversed(list(advance(self, a).items()))))
    got = steps()
    assert want and len(got) == len(want)
    for a, b in zip(got, want):
        for f in StepEvent.__dataclass_fields__:
            x, y = getattr(a, f), getattr(b, f)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f


def test_answer_ends_blocks_and_counts_what_it_returns():
    """Answer directly: sequence stopping per block, row 0's text cut at max_new_tokens, one Done."""
    req = Request(
        options=None,
        ids=torch.zeros(2, 1, dtype=torch.long),
        max_new_tokens=6,
        eos_ids=[1],
        pad_id=0,
        decode=lambda ids: "".join(f" {i}" for i in ids),
    )
    assert req.rows == [[0], [0]]
    ans = Answer(req, 2, "cpu")
    first = ans.end_block(0, torch.tensor([[5, 6, 1, 7], [5, 6, 7, 8]]), 3)
    assert first.token_ids.tolist() == [[5, 6, 1, 0], [5, 6, 7, 8]] and first.text == " 5 6"
    assert first.finished.tolist() == [True, False] and not ans.all_finished
    second = ans.end_block(1, torch.tensor([[9, 9, 9, 9], [9, 1, 4, 4]]), 2)
    assert second.text == "" and second.token_ids.tolist() == [[0, 0, 0, 0], [9, 1, 0, 0]] and ans.all_finished
    rows = ans.rows()
    assert rows == [[5, 6, 1], [5, 6, 7, 8, 9, 1]] and ans.reason(rows) == "eos"
    req.stats.forwards = 4
    done = ans.done(rows, ans.reason(rows))
    assert done.text == [" 5 6", " 5 6 7 8 9"] and done.stats.new_tokens == 9 and req.stats.canvases == 2
    cut = Answer(
        Request(options=None, ids=torch.zeros(1, 1, dtype=torch.long), max_new_tokens=3, eos_ids=[1]), 1, "cpu"
    )
    cut.end_block(0, torch.tensor([[5, 6, 7, 1]]), 1)
    assert cut.rows() == [[5, 6, 7]] and cut.reason(cut.rows()) == "length"  # the EOS past max_new_tokens
