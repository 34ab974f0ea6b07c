"""``localdiff serve``'s hot path (``localdiff/serve/asgi.py``, the worker's hand-offs): chunk templates equal the
dict chunks, one hand-off per burst, the prompt counted once per request (a stop string included), a client that
leaves while queued cancels its job before it starts, chunked uploads over the limit are a 413. 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest
from servehelpers import Running

from localdiff.serve.openai_api import Shape, dumps
from localdiff.serve.options import GenRequest
from localdiff.serve.worker import Job

LONG = {"max_denoising_steps": 20000, "confidence_threshold": 1e-12}  # a canvas that runs all its 20000 steps
ASK = [{"role": "user", "content": "What is 27 + 58?"}]


@pytest.fixture(scope="module")
def server():
    s = Running(max_batch=1)  # the one-at-a-time path and queue (DiffusionGemma batches by default)
    yield s
    s.stop()


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", ["27 + 58 = 85.", "", 'q"uo\\te\n\t\x00\x1b[31m\u2028é中', "\x00text\x00"])
def test_text_line_template_is_the_dict_chunk(chat, text):
    shape = Shape("tiny" + text, chat)  # odd model names too
    assert shape.text_line(text) == "data: " + dumps(shape.chunk(text)) + "\n\n"
    assert shape.role_line() == "data: " + dumps(shape.chunk(first=True)) + "\n\n"
    for reason in ("stop", "length"):
        assert shape.finish_line(reason) == "data: " + dumps(shape.chunk(finish_reason=reason)) + "\n\n"
    payload = {"type": "step", "text": text, "confidence": [0.5, 1e-7]}
    assert shape.event_line(payload) == "data: " + dumps(shape.event(payload)) + "\n\n"
    again = Shape("tiny" + text, chat)  # the next response: its own id, same template
    assert again.id != shape.id and again.text_line(text) == "data: " + dumps(again.chunk(text)) + "\n\n"


class _Loop:
    """Records call_soon_threadsafe calls (the worker's wake-ups of the event loop)."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn):
        self.calls.append(fn)


def test_one_hand_off_per_burst():
    loop = _Loop()
    job = Job(GenRequest(model="", prompt="x"), loop, events=asyncio.Queue())
    job.post(("start", None, None), wake=False)
    job.post(("delta", "a", None), wake=False)
    assert loop.calls == [] and job.events.empty()  # nothing handed over yet
    job.wake()
    job.post(("done", None, {}))  # joins the scheduled hand-off
    job.wake()
    assert len(loop.calls) == 1
    loop.calls.pop()()  # the loop runs the hand-off: all three, in order
    assert [job.events.get_nowait()[0] for _ in range(3)] == ["start", "delta", "done"]
    job.wake()  # nothing pending: no wake-up
    assert loop.calls == []
    job.post(("start", None, None), wake=False, lead=True)  # the stream's start waits for what follows it
    job.wake()
    assert loop.calls == []
    job.post(("step", {}))  # ... and rides with it
    assert len(loop.calls) == 1
    loop.calls.pop()()
    assert [job.events.get_nowait()[0] for _ in range(2)] == ["start", "step"]
    job.post(("start", None, None), wake=False, lead=True)
    job.wake(leads=True)  # after START_WAIT it goes alone
    assert len(loop.calls) == 1


def test_prompt_rendered_once_per_request_even_with_a_stop_string(server):
    tok = server.worker.model.tokenizer
    calls = []
    real = tok.apply_chat_template

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    tok.apply_chat_template = counting
    try:
        full = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "seed": 0}, timeout=60).json()
        assert len(calls) == 1
        cut = httpx.post(
            server.url + "/v1/chat/completions", json={"messages": ASK, "seed": 0, "stop": ["58"]}, timeout=60
        ).json()
        assert len(calls) == 2  # once more for the second request, not twice
    finally:
        del tok.apply_chat_template
    assert cut["choices"][0]["message"]["content"] == "27 + " and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] > 0


def _raw_post(port: int, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    return s


def test_client_gone_while_queued_cancels_before_start(server):
    w = server.worker
    long_body = dumps({"messages": ASK, "stream": True, "max_tokens": 32, "localdiff": LONG}).encode()
    first = _raw_post(server.port, long_body)
    t0 = time.monotonic()
    while w.current is None or w.current.req.sampler.get("max_denoising_steps") != 20000:  # (not the last job)
        assert time.monotonic() - t0 < 30
        time.sleep(0.01)
    running = w.current
    submitted = []
    w.submit = lambda job: (submitted.append(job), type(w).submit(w, job))[1]
    try:
        queued = _raw_post(server.port, dumps({"messages": ASK, "seed": 0}).encode())
        while w.queued < 1:
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
    finally:
        del w.submit
    waiting = submitted[-1]
    assert waiting.req.seed == 0 and not waiting.req.stream
    queued.close()  # leaves while queued
    while not waiting.cancel.is_set():
        assert time.monotonic() - t0 < 30, "the server did not notice the queued client leave"
        time.sleep(0.01)
    assert not running.cancel.is_set()  # the running generation is not disturbed
    first.close()
    assert running.finished.wait(30) and waiting.finished.wait(30)
    assert waiting.steps == 0  # never ran a denoising step
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "seed": 0}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "27 + 58 = 85."


def test_chunked_upload_over_the_limit_is_413():
    s = Running(model=None, max_body=4096)
    try:

        def parts():  # no Content-Length: the limit is counted as it comes
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 1024
            yield b'"}]}'

        r = httpx.post(s.url + "/v1/chat/completions", content=parts(), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(s.url + "/api/chat", content=parts(), timeout=30)
        assert r.status_code == 413 and isinstance(r.json()["error"], str)  # Ollama's shape
        assert s.worker.model is None  # nothing was loaded for them
    finally:
        s.stop()


def test_bench_client_reads_the_stream(server):
    """The serve bench's client: first content seen before the end, the token count from ``usage``, on one
    kept-alive connection; and as the separate process the bench runs (one JSON line per request)."""
    import json
    import subprocess
    import sys

    from localdiff.bench import serve_client
    from localdiff.bench.serve import _body

    want = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "seed": 0}, timeout=60).json()
    n_want = want["usage"]["completion_tokens"]
    client = serve_client.Client(server.port)
    try:
        for events in ("none", "none", "steps"):  # the kept-alive connection serves the next request
            body = json.dumps(_body(ASK[0]["content"], 0, None, {}, events, "tiny")).encode()
            out = serve_client.timed_post(client, "/v1/chat/completions", body)
            assert 0 < out["first"] <= out["total"] and out["n"] == n_want > 0 and out["cpu_ms"] > 0
    finally:
        client.close()
    line = json.dumps(
        {"path": "/v1/chat/completions", "body": json.dumps(_body(ASK[0]["content"], 0, None, {}, "none", "tiny"))}
    )
    proc = subprocess.run(
        [sys.executable, serve_client.__file__, str(server.port)],
        input=line + "\n" + line + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    outs = [json.loads(x) for x in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(outs) == 2 and all(o["n"] == n_want for o in outs)


def test_prompt_over_the_context_is_a_400_naming_it(server):
    long = [{"role": "user", "content": "1 + 2 " * 600}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": long}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "context" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/api/chat", json={"messages": long, "stream": True}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]  # a stream is refused before it starts


def test_access_line_per_request_after_its_response(server):
    """uvicorn's access log is off (it writes before the first byte); the app writes the same line once the response
    is complete, with the status sent: generation routes, the Starlette routes, errors."""

    def lines():
        return [r.getMessage() for r in server.logs.records if r.name == "localdiff.serve.access"]

    before = len(lines())
    assert (
        httpx.post(
            server.url + "/v1/chat/completions", json={"messages": ASK, "seed": 0, "stream": True}, timeout=60
        ).status_code
        == 200
    )
    assert (
        httpx.post(
            server.url + "/api/chat", json={"messages": ASK, "stream": False, "options": {"seed": 0}}, timeout=60
        ).status_code
        == 200
    )
    assert httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=60).status_code == 400
    assert httpx.get(server.url + "/health?x=1", timeout=60).status_code == 200
    assert httpx.get(server.url + "/nowhere", timeout=60).status_code == 404
    want = [
        '"POST /v1/chat/completions HTTP/1.1" 200',
        '"POST /api/chat HTTP/1.1" 200',
        '"POST /v1/chat/completions HTTP/1.1" 400',
        '"GET /health?x=1 HTTP/1.1" 200',
        '"GET /nowhere HTTP/1.1" 404',
    ]
    t0 = time.monotonic()  # (a line comes just after its response: wait a bit;
    while True:  # an earlier test's last line may come in between)
        got = [line for line in lines()[before:] if any(line.endswith(w) for w in want)]
        if len(got) >= len(want) or time.monotonic() - t0 > 10:
            break
        time.sleep(0.02)
    assert len(got) == len(want), got
    for line, tail in zip(got, want):
        assert line.startswith("127.0.0.1:") and line.endswith(tail), (line, tail)
    assert not logging.getLogger("uvicorn.access").hasHandlers()  # uvicorn's own line is off (not twice)


def test_serve_bench_layouts_and_report(server, monkeypatch):
    """The serve bench: where each thread runs (the model on the bench's CPUs, the client and the second layout's
    loop on the others), and one tiny measured pass on this process's CPUs rendered as a row per workload."""
    import os

    from localdiff.bench import serve as bench

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(bench.serve_harness, "allowed", lambda own, cpu: cpu != 2)  # CPU 2: not in this cpuset
    one, other, same = bench.serve_harness.layouts()
    assert (one["model"], one["loop"], one["client"]) == ([1], [1], [0])
    assert (other["model"], other["loop"], other["client"]) == ([1], [0], [0])
    assert (same["model"], same["loop"], same["client"]) == ([1], [1], [1])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert [(x["loop"], x["client"]) for x in bench.serve_harness.layouts()] == [([0], [0])]  # one CPU: all on it
    monkeypatch.undo()
    own = sorted(os.sched_getaffinity(0))
    sec = bench.measure(
        server.worker.model,
        ASK[0]["content"],
        seeds=(0,),
        reps=2,
        warmup=0,
        log=lambda *a: None,
        stacks=[("asyncio", "h11")],
        layouts=[{"name": "here", "model": own, "loop": own, "client": own}],
    )
    rows = sec["runs"][0]["rows"]
    assert [r["workload"] for r in rows] == list(bench.WORKLOADS) and all(r["same_tokens"] for r in rows)
    for r in rows:
        for k in ("ttfb", "tokens_per_s"):
            p = r["pairs"][k]
            assert p["min"] <= p["q1"] <= p["median"] <= p["q3"] <= p["max"]
            assert p["min"] <= p["ci"][0] <= p["median"] <= p["ci"][1] <= p["max"]
        assert r["served"]["cpu_ms"]["client"] > 0 and r["in_process"]["cpu_ms"]["client"] == 0
    md = bench.render_md(sec)
    assert sum(line.startswith("| asyncio + h11 | here") for line in md) == len(bench.WORKLOADS)


def test_serve_bench_median_ci_and_reps():
    """The serve bench's 95 % CI of a median (sign-test order statistics: for n = 100 the 40th and 61st values,
    their range below 6 values, covering the true median about 95 % of the time) and its runs per seed (more for a
    short workload, capped at 20 × reps; none added without a time budget)."""
    import random

    from localdiff.bench.serve import _reps_for, median_ci

    assert median_ci(list(range(1, 101))) == (40, 61)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    rng = random.Random(7)
    hits = sum(
        lo <= 0 <= hi for lo, hi in (median_ci([rng.expovariate(1) - 0.6931 for _ in range(80)]) for _ in range(1000))
    )
    assert 920 <= hits <= 985
    assert _reps_for(10, 0.0, 0.03, 3) == 10
    assert _reps_for(10, 12.0, 1.2, 3) == 10  # a long workload keeps the base count
    assert _reps_for(10, 12.0, 0.06, 3) == 67  # ~30 ms answers: ~200 pairs in ~12 s
    assert _reps_for(10, 12.0, 0.001, 3) == 200  # capped


def test_job_flag_set_wait_across_threads():
    """The jobs' cancel / finished flag: is_set after set, wait returns at once when up, times out when not, and a
    waiter in another thread is woken by set (also when set races with the waiter's first wait)."""
    import threading
    import time

    from localdiff.serve.worker import Flag

    f = Flag()
    assert not f.is_set() and f.wait(0.01) is False
    f.set()
    assert f.is_set() and f.wait(0) is True
    for delay in (0.0, 0.0, 0.02):
        g, got = Flag(), []
        waiters = [threading.Thread(target=lambda: got.append(g.wait(10))) for _ in range(3)]
        for w in waiters:
            w.start()
        time.sleep(delay)
        g.set()
        for w in waiters:
            w.join(10)
        assert got == [True, True, True]
