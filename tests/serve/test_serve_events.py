"""localdiff's canvas events over HTTP (``localdiff.wire``): opt-in per request, invisible to standard clients,
bit-equal to the in-process StepEvents for the same seed; the remote chat draws the canvas from them; the engine's
cancel poll (what lets the server run without step events and still stop within one step)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from servehelpers import Running
from tuihelpers import wait_for

from localdiff.backends.remote import RemoteClient, RemoteModel
from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.wire import canvas_done, step_event

PROMPT = "What is 27 + 58?"
STEPS8 = {"max_denoising_steps": 8, "confidence_threshold": 1e-12}  # 8 steps per canvas
FIELDS = (
    "canvas_index",
    "step",
    "max_steps",
    "canvas_ids",
    "argmax_ids",
    "accepted",
    "renoised",
    "reopened",
    "confidence",
    "entropy",
    "locked",
)


@pytest.fixture(scope="module")
def server():
    s = Running()
    yield s
    s.stop()


def _same_step(a: StepEvent, b: StepEvent) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(y, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (f, a.canvas_index, a.step)
        else:
            assert x == y, (f, x, y)


def _local(tiny, **kw):
    return list(tiny.stream(PROMPT, max_new_tokens=64, seed=4, emit_steps=True, **STEPS8, **kw))


def _sse_events(url, body):
    text, events = [], []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
            if "event" in (chunk.get("localdiff") or {}):
                assert chunk["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
                events.append(chunk["localdiff"])
    return "".join(text), events


def test_step_events_reproduce_the_in_process_ones(server, tiny):
    want = _local(tiny)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "seed": 4,
        "max_tokens": 64,
        "stream": True,
        "localdiff": {**STEPS8, "events": "steps"},
    }
    text, events = _sse_events(server.url, body)
    assert events[0]["event"] == "begin" and events[0]["eos_token_ids"] == tiny.eos_token_ids
    assert events[0]["canvas_length"] == tiny.config.canvas_length and events[0]["family"] == "canvas"
    steps = [step_event(e) for e in events if e["event"] == "step"]
    local_steps = [e for e in want if isinstance(e, StepEvent)]
    assert len(steps) == len(local_steps) >= 8  # 8 steps in the first canvas
    for a, b in zip(steps, local_steps):
        _same_step(a, b)
    canvases = [canvas_done(e) for e in events if e["event"] == "canvas"]
    local_canvases = [e for e in want if isinstance(e, CanvasDone)]
    assert [c.token_ids.tolist() for c in canvases] == [c.token_ids.tolist() for c in local_canvases]
    assert [c.steps for c in canvases] == [c.steps for c in local_canvases]
    assert text == next(e for e in want if isinstance(e, Done)).text
    pieces = {}
    for e in events:
        pieces.update(e.get("pieces") or {})
    ids = {i for s in steps for i in s.canvas_ids[0].tolist()}
    assert set(map(int, pieces)) == ids | {i for c in canvases for i in c.token_ids[0].tolist()}
    # canvases only: the canvas events without the steps
    _, only = _sse_events(server.url, {**body, "localdiff": {**STEPS8, "events": "canvases"}})
    assert [e["event"] for e in only] == ["begin"] + ["canvas"] * len(local_canvases)


def test_standard_clients_see_the_same_answer_with_events_on(server, tiny):
    n_canvas = sum(isinstance(e, CanvasDone) for e in _local(tiny))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(
        model="tiny", messages=msgs, seed=4, max_tokens=64, stream=True, extra_body={"localdiff": STEPS8}
    )
    plain_text = "".join(c.choices[0].delta.content or "" for c in plain)  # every chunk has a choice
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            seed=4,
            max_tokens=64,
            stream=True,
            extra_body={"localdiff": {**STEPS8, "events": "steps"}},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain_text
    kinds = [c.model_extra["localdiff"]["event"] for c in chunks if (c.model_extra or {}).get("localdiff")]
    assert kinds[0] == "begin" and kinds.count("canvas") == n_canvas and kinds.count("step") >= 8
    assert chunks[0].choices[0].delta.role == "assistant"
    full = client.chat.completions.create(
        model="tiny", messages=msgs, seed=4, max_tokens=64, extra_body={"localdiff": STEPS8}
    )
    assert full.choices[0].message.content == plain_text  # not streamed: the same answer
    with pytest.raises(openai.BadRequestError, match="needs"):  # and events need a stream (session 12:
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            seed=4,
            max_tokens=64,  # were dropped)
            extra_body={"localdiff": {**STEPS8, "events": "steps"}},
        )
    raw = list(
        client.completions.create(
            model="tiny",
            prompt="What is",
            max_tokens=40,
            seed=1,
            stream=True,
            extra_body={"localdiff": {"events": "canvases"}},
        )
    )
    marked = [c.choices[0].text for c in raw if (c.model_extra or {}).get("localdiff", {}).get("event")]
    assert marked and set(marked) == {""}


def test_ollama_ndjson_carries_the_same_events(server, tiny):
    want = [e for e in _local(tiny) if isinstance(e, StepEvent)]
    with httpx.stream(
        "POST",
        server.url + "/api/chat",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "localdiff": {"events": "steps"},
            "options": {"seed": 4, "num_predict": 64, **STEPS8},
        },
        timeout=60,
    ) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    steps = [step_event(x["localdiff"]) for x in lines if x.get("localdiff", {}).get("event") == "step"]
    assert len(steps) == len(want)
    for a, b in zip(steps, want):
        _same_step(a, b)
    assert all(x["message"]["content"] == "" and not x["done"] for x in lines if "localdiff" in x)
    assert lines[-1]["done"] and "".join(x["message"]["content"] for x in lines) == "27 + 58 = 85."


def test_remote_model_rebuilds_events_and_plain_servers_get_plain_requests(server, tiny):
    rm = RemoteModel(RemoteClient(server.url), "tiny")
    assert rm.canvas_events
    got = list(rm.stream(PROMPT, max_new_tokens=64, seed=4, **STEPS8))
    want = _local(tiny)
    for a, b in zip([e for e in got if isinstance(e, StepEvent)], [e for e in want if isinstance(e, StepEvent)]):
        _same_step(a, b)
    assert rm.eos_token_ids == tiny.eos_token_ids and rm.tokenizer.eos_token_ids == tiny.eos_token_ids
    assert got[-1].text == want[-1].text
    seen = []

    def plain_server(request: httpx.Request):
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})
        seen.append(json.loads(request.content))
        sse = (
            'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
            'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        )
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    client = RemoteClient("http://127.0.0.1:9/v1")
    client._http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(plain_server))
    other = RemoteModel(client)
    assert not other.canvas_events and other.tokenizer is None
    out = list(other.stream("hello", seed=1))
    assert "localdiff" not in seen[0] and [e.text for e in out] == ["hi", "hi"]


def test_bad_events_values_are_400(server):
    msgs = [{"role": "user", "content": PROMPT}]
    for path, body in [
        ("/v1/chat/completions", {"messages": msgs, "localdiff": {"events": "all"}}),
        ("/v1/chat/completions", {"messages": msgs, "localdiff": {"events": True}}),
        ("/api/chat", {"messages": msgs, "localdiff": {"events": 3}}),
        ("/api/chat", {"messages": msgs, "localdiff": {"max_denoising_steps": 3}}),
        ("/api/chat", {"messages": msgs, "localdiff": "steps"}),
    ]:
        r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400 and "localdiff" in r.text, (path, body, r.text)


def test_remote_chat_draws_the_canvas(server, tmp_path, tiny):
    from localdiff.cli.remote import remote_loader
    from localdiff.tui.app import ChatApp
    from localdiff.tui.runner import LOCKED, TokenText
    from localdiff.tui.settings import ChatSettings
    from localdiff.tui.store import ChatStore

    final_ids = [e for e in tiny.stream(PROMPT, seed=0, emit_steps=False) if isinstance(e, CanvasDone)][-1]
    want_tokens = [TokenText(tiny.tokenizer)(i) for i in final_ids.token_ids[0].tolist()]

    async def go():
        app = ChatApp(
            "",
            store=ChatStore(tmp_path / "h.sqlite3"),
            loader=remote_loader(server.url, None),
            settings=ChatSettings(seed=0),
        )
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None and not app.generating)
            assert app.model.canvas_events
            await pilot.press(*PROMPT)
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.finished_count >= 1)
            frame = app.canvas.frame
            assert app.last_finish.text == "27 + 58 = 85." and frame is not None and frame.final
            assert frame.tokens == want_tokens and set(frame.states) == {LOCKED}
            assert app.canvas.frames_drawn >= 2  # a step frame, then the final canvas
            assert "canvas 1 · done" in app.canvas.border_title
            ids = final_ids.token_ids[0].tolist()
            assert frame.answer_tokens == next(k for k, t in enumerate(ids) if t in tiny.eos_token_ids) + 1

    asyncio.run(go())


def test_remote_pieces_with_control_characters_stay_visible_text():
    from localdiff.tui.runner import TokenText
    from localdiff.wire import PieceTable

    table = PieceTable()
    table.update({"5": "\x1b[2J", "6": "ok\x07", "7": "a\nb"})
    show = TokenText(table)
    assert show(5) == "·[2J" and show(6) == "ok·" and show(7) == "a↵b"
    with pytest.raises(ValueError):
        table.update({"8": 3})


def test_cancel_poll_stops_both_families_before_the_next_step(tiny):
    import dataclasses

    from fake_masked import FakeMaskedConfig, FakeMaskedNet
    from localdiff.arch import REGISTRY, ArchEntry
    from localdiff.engine import Model

    calls = []

    def stop_at(n):
        def cancel():
            calls.append(1)
            return len(calls) >= n

        return cancel

    full = list(tiny.stream(PROMPT, max_new_tokens=64, seed=4, emit_steps=True, **STEPS8))
    calls.clear()
    same = list(tiny.stream(PROMPT, max_new_tokens=64, seed=4, emit_steps=True, cancel=lambda: False, **STEPS8))
    assert [type(e) for e in same] == [type(e) for e in full] and same[-1].token_ids == full[-1].token_ids
    calls.clear()
    cut = list(tiny.stream(PROMPT, max_new_tokens=64, seed=4, emit_steps=True, cancel=stop_at(3), **STEPS8))
    assert len(calls) == 3 and [type(e) for e in cut] == [StepEvent, StepEvent]  # no Done: stopped before step 3

    cfg = dataclasses.replace(FakeMaskedConfig(eos_token_id=(), pad_token_id=None))
    REGISTRY[cfg.model_type] = ArchEntry("fake_masked", "fake_masked", "masked")
    try:
        m = Model(FakeMaskedNet(cfg, seed=0), cfg, None, None, "fake", "cpu", torch.float32, None, {})
        calls.clear()
        cut = list(
            m.stream([3, 4, 5], max_new_tokens=8, seed=0, chat=False, steps=8, emit_steps=False, cancel=stop_at(4))
        )
        assert cut == [] and len(calls) == 4
        calls.clear()
        done = list(
            m.stream(
                [3, 4, 5],
                max_new_tokens=8,
                seed=0,
                chat=False,
                steps=8,
                emit_steps=False,
                cancel=lambda: bool(calls.append(1)),
            )
        )
        assert (
            isinstance(done[-1], Done)
            and len(calls) == 8
            and done[-1].token_ids == m.generate([3, 4, 5], max_new_tokens=8, seed=0, chat=False, steps=8).token_ids
        )
    finally:
        REGISTRY.pop(cfg.model_type, None)


def test_chat_command_endpoint_connects_to_the_server(server, monkeypatch, tmp_path):
    import localdiff.tui as tui
    from localdiff.cli import main as cli_main

    import io
    import sys

    class Tty(io.StringIO):
        def isatty(self):
            return True

    (tmp_path / "none.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setattr(sys, "stdin", Tty())
    monkeypatch.setattr(sys, "stdout", Tty())
    got = {}

    def fake_run_chat(**kw):
        got.update(kw)
        return 0

    monkeypatch.setattr(tui, "run_chat", fake_run_chat)
    assert cli_main(["chat", "--endpoint", server.url, "-m", "tiny"]) == 0
    model = got["loader"]("tiny")
    assert isinstance(model, RemoteModel) and model.canvas_events and model.name == "tiny"
    assert cli_main(["chat", "--endpoint", "ftp://nowhere"]) == 2
