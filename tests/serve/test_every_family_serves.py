"""Every embedded model's family through the engine's cancel contract and through ``localdiff serve``.

``Model.stream(cancel=...)`` promises a call before every denoising step (the first once the request passed its
checks) and an end without Done when it returns True. The causal (Qwen3, DFlash) and slots (ReFusion) runners
never called it, so ``localdiff serve`` answered every request to ``tiny-qwen3`` / ``tiny-refusion`` with a 500
(the worker's first-step bookkeeping never ran) and could not stop their generations when a client left
(round 2 session 12's newcomer finding). Also: a canvas that ran past ``max_new_tokens`` to its EOS reported
``finish_reason: "eos"`` for an answer the length cut.
"""

from __future__ import annotations

import json

import httpx
import pytest
from servehelpers import Running

import localdiff
from localdiff.events import CanvasDone, Done, StepEvent

MODELS = ["tiny", "tiny-mdm", "tiny-bd", "tiny-refusion", "tiny-qwen3"]
Q = "What is 41 + 93?"


@pytest.fixture(scope="module")
def server():
    s = Running()
    yield s
    s.stop()


@pytest.mark.parametrize("name", MODELS)
def test_cancel_is_polled_before_every_step_and_stops(name):
    m = localdiff.load(name)
    calls = []
    evs = list(m.stream(Q, max_new_tokens=16, seed=0, cancel=lambda: calls.append(1) and False))
    done = evs[-1]
    assert isinstance(done, Done) and calls, name
    if done.stats.forwards:  # one poll per forward (prefill fused or not) at least per step
        assert len(calls) >= len([e for e in evs if isinstance(e, StepEvent)])
    for stop_at in (1, 2):  # True at the first / second poll: no Done, nothing after it
        n = [0]

        def cancel():
            n[0] += 1
            return n[0] >= stop_at

        got = list(m.stream(Q, max_new_tokens=16, seed=0, cancel=cancel))
        assert not any(isinstance(e, Done) for e in got) and n[0] == stop_at, (name, stop_at)
        if stop_at == 1:
            assert got == []


@pytest.mark.parametrize("name", MODELS)
def test_every_embedded_model_answers_over_http(server, name):
    want = localdiff.load(name).generate(Q, max_new_tokens=32, seed=3).text
    r = httpx.post(
        server.url + "/api/chat",
        json={
            "model": name,
            "stream": False,
            "messages": [{"role": "user", "content": Q}],
            "options": {"seed": 3, "num_predict": 32},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == want and r.json()["prompt_eval_duration"] > 0
    text, finish = "", None
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": name, "stream": True, "seed": 3, "max_tokens": 32, "messages": [{"role": "user", "content": Q}]},
        timeout=120,
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                text += ch["delta"].get("content") or ""
                finish = ch["finish_reason"] or finish
    assert text == want and finish in ("stop", "length")
    assert "Traceback" not in server.logs.text() and "generation failed" not in server.logs.text()


@pytest.mark.parametrize("name", MODELS)
def test_finish_reason_eos_only_when_the_answer_ends_with_it(name):
    m = localdiff.load(name)
    eos = set(m.eos_token_ids)
    for n in (3, 5, 40):
        for seed in (0, 1):
            d = [e for e in m.stream(Q, max_new_tokens=n, seed=seed) if isinstance(e, Done)][0]
            ids = d.token_ids
            assert len(ids) <= n
            ended = bool(ids and ids[-1] in eos)  # "length" only when the limit cut it (see test_finish_reason_limit)
            if ended or len(ids) == n:
                assert (d.finish_reason == "eos") == ended, (name, n, seed, d.finish_reason, ids)


@pytest.mark.parametrize("name", MODELS)
def test_streamed_pieces_join_to_the_answer(name):
    """Each canvas / block / step's text is what it adds to the answer: joined, they are Done's text (decoding each
    block alone dropped the space a block began with under the Metaspace decoder: "41 + 93= 134.")."""
    m = localdiff.load(name)
    for q, n, seed in [
        (Q, 32, 3),
        ("Reverse the letters: d r a g o n", 40, 0),
        ("Sort these words: elk cat gnu", 40, 1),
    ]:
        evs = list(m.stream(q, max_new_tokens=n, seed=seed))
        pieces = "".join(e.text for e in evs if isinstance(e, CanvasDone))
        assert pieces == evs[-1].text, (name, q, pieces, evs[-1].text)


def test_incremental_text_matches_whole_decoding():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from localdiff.decoding.detok import IncrementalText

    vocab = {"<unk>": 0, "▁a": 1, "b": 2, "▁": 3, "c": 4, "<0xE2>": 5, "<0x82>": 6, "<0xAC>": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    ids = [1, 2, 3, 4, 3, 5, 6, 7, 1, 3, 3, 2]  # "a" "b" " " "c" " " "€" (three bytes) "a" ...
    whole = tok.decode(ids)
    for cut in range(1, 5):
        t = IncrementalText(tok.decode)
        out = [t.add(ids[i : i + cut]) for i in range(0, len(ids), cut)]
        assert "".join(out) == whole and not t.pending, (cut, out, whole)
        assert not any("\ufffd" in o for o in out)
    assert IncrementalText(None).add([1, 2]) == ""


def test_tui_frames_of_a_block_shared_with_the_prompt_tail_line_up():
    """The chat crashed (IndexError in the canvas sparkline) on tiny-bd: the finished first block holds only the
    answer's positions while its steps' confidences also covered the prompt's tail."""
    from localdiff.tui.runner import frame_from_done, frame_from_step

    m = localdiff.load("tiny-bd")
    text = lambda i: m.tokenizer.decode([i])  # noqa: E731
    last = None
    for ev in m.stream("Convert 17 h to min.", max_new_tokens=32, seed=0):
        if isinstance(ev, StepEvent):
            last = frame_from_step(ev, text, None, m.mask_token_id)
        elif isinstance(ev, CanvasDone):
            f = frame_from_done(ev, text, last)
            assert len(f.confidence) == len(f.states) == len(f.tokens)


@pytest.mark.parametrize("name", MODELS)
def test_gen_prints_what_json_returns_when_the_length_cuts_a_block(name, capsys, tmp_path, monkeypatch):
    """``gen`` streamed the last canvas decoded alone (a space lost at a block boundary, tiny-bd) and ReFusion's
    CanvasDone text ran past max_new_tokens (served: a whole slot for max_tokens 1)."""
    from localdiff.cli import main

    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    for n in (2, 3, 7, 11):
        args = ["gen", "-m", name, "--seed", "0", "-n", str(n), "-p", "Reverse the letters: d r a g o n", "-q"]
        assert main(args) == 0
        printed = capsys.readouterr().out.rstrip("\n")
        assert main(args + ["--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert printed == out["text"], (name, n, printed, out["text"])
        pieces = "".join(
            e.text
            for e in localdiff.load(name).stream("Reverse the letters: d r a g o n", max_new_tokens=n, seed=0)
            if isinstance(e, CanvasDone)
        )
        assert pieces == out["text"], (name, n, pieces)
