"""``localdiff serve`` on the embedded model: the official openai client, Ollama NDJSON, concurrency and
cancellation, ``gen`` / ``chat --endpoint``. Everything on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from cli_fixtures import isolated_config  # noqa: F401  (fixture)
from servehelpers import Running, wait_healthy

from localdiff.cli import main as cli_main

PROMPTS = [
    "What is 27 + 58?",
    "Reverse the letters: s t o n e",
    "Sort these words: elk cat gnu",
    "What is 41 + 93?",
    "Convert 17 h to min.",
    "Reverse the letters: d r a g o n",
    "What is 12 + 34?",
    "Sort these words: yak ant dog",
]
LONG = {"max_denoising_steps": 20000, "confidence_threshold": 1e-12}  # a canvas that runs all its 20000 steps


@pytest.fixture(scope="module")
def server():
    s = Running(max_batch=1)  # the one-at-a-time queue (the embedded DiffusionGemma batches by default)
    yield s
    s.stop()


def gen_text(capsys, prompt, seed, *extra) -> str:
    capsys.readouterr()
    assert cli_main(["gen", "-q", "-p", prompt, "--seed", str(seed), *extra]) == 0
    return capsys.readouterr().out


def test_openai_client_chat_stream_and_models(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert "tiny" in [m.id for m in client.models.list()]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], seed=0)
    assert r.choices[0].message.content == "27 + 58 = 85."
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    ext = r.model_extra["localdiff"]
    assert ext["seed"] == 0 and ext["canvases"] >= 1 and ext["tokens_per_forward"] > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPTS[0]}],
            seed=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model="tiny", prompt="What is", max_tokens=8, seed=1)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens <= 8


def test_same_seed_same_text_as_gen_and_stop_strings(server, capsys, isolated_config):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    want = gen_text(capsys, PROMPTS[1], 3).rstrip("\n")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], seed=3)
    assert r.choices[0].message.content == want
    raw = client.completions.create(model="tiny", prompt="What is 27 + 58?", max_tokens=16, seed=2)
    assert raw.choices[0].text == gen_text(capsys, "What is 27 + 58?", 2, "--raw", "-n", "16").rstrip("\n")
    cut = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], seed=0, stop=["58"]
    )
    assert cut.choices[0].message.content == "27 + " and cut.choices[0].finish_reason == "stop"


def test_ollama_ndjson_streams(server):
    with httpx.stream(
        "POST",
        server.url + "/api/chat",
        json={"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "options": {"seed": 0}},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    assert "".join(x["message"]["content"] for x in lines) == "27 + 58 = 85."
    assert lines[-1]["eval_count"] > 0 and lines[-1]["prompt_eval_count"] > 0
    with httpx.stream(
        "POST",
        server.url + "/api/generate",
        json={"model": "tiny", "prompt": PROMPTS[0], "options": {"seed": 0, "num_predict": 64}},
    ) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(x["response"] for x in lines) == "27 + 58 = 85." and lines[-1]["done"]
    once = httpx.post(
        server.url + "/api/generate",
        json={"model": "tiny", "prompt": PROMPTS[0], "stream": False, "options": {"seed": 0}},
    ).json()
    assert once["response"] == "27 + 58 = 85." and once["done"]
    assert "tiny" in [m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]]
    assert httpx.get(server.url + "/api/ps").json()["models"][0]["name"] == "tiny"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def _stream_text(url, prompt, seed) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], seed=seed, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def test_eight_concurrent_streams_one_killed_mid_stream(server, capsys, isolated_config):
    """A long generation is killed by its client after the first chunk while 8 clients stream: the 8 get the
    answers `localdiff gen` gives with their seeds; the killed generation stops within a step or so."""
    want = [gen_text(capsys, p, 10 + i).rstrip("\n") for i, p in enumerate(PROMPTS)]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "stream": True,
        "seed": 1,
        "max_tokens": 32,
        "localdiff": LONG,
    }
    killed = httpx.Client(timeout=60)
    resp = killed.send(killed.build_request("POST", server.url + "/v1/chat/completions", json=body), stream=True)
    assert resp.status_code == 200  # headers go out once the engine accepted the request: it runs
    job = server.worker.current
    assert job is not None and job.req.sampler["max_denoising_steps"] == 20000
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i):
        try:
            results[i] = _stream_text(server.url, PROMPTS[i], 10 + i)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while server.worker.queued < 8 and time.monotonic() - t0 < 60:  # the 8 queue behind the long generation
        time.sleep(0.02)
    steps_at_kill = job.steps
    assert not job.finished.is_set() and server.worker.queued == 8
    resp.close()
    killed.close()
    t0 = time.monotonic()
    while not job.cancel.is_set() and time.monotonic() - t0 < 30:  # the server noticed the client is gone
        time.sleep(0.001)
    steps_at_cancel = job.steps
    assert job.finished.wait(30), "the killed client's generation did not stop"
    assert job.steps < 20000 and job.steps - steps_at_kill < 2000, (steps_at_kill, job.steps)
    assert job.steps - steps_at_cancel <= 1, (steps_at_cancel, job.steps)  # the engine stops within one step
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [results[i] for i in range(8)] == want
    assert httpx.get(server.url + "/health").json()["busy"] is False


def test_full_queue_is_503_with_retry_after():
    s = Running(max_queue=1, max_batch=1)
    try:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "What is 1 + 2?"}],
            "stream": True,
            "max_tokens": 32,
            "localdiff": LONG,
        }
        c = httpx.Client(timeout=60)
        first = c.send(c.build_request("POST", s.url + "/v1/chat/completions", json=body), stream=True)
        assert first.status_code == 200 and s.worker.current is not None  # the long generation runs
        short = {"model": "tiny", "messages": [{"role": "user", "content": "What is 1 + 2?"}], "max_tokens": 8}
        answers = []
        waiting = threading.Thread(
            target=lambda: answers.append(
                httpx.post(s.url + "/v1/chat/completions", json=short, timeout=60).status_code
            )
        )
        waiting.start()
        t0 = time.monotonic()
        while s.worker.queued < 1 and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
        first.close()
        c.close()
        waiting.join(60)
        assert answers == [200]  # the queued request is served once the first one is gone
    finally:
        s.stop()


def test_gen_endpoint_against_a_served_model(server, capsys, isolated_config):
    want = gen_text(capsys, PROMPTS[2], 5)
    capsys.readouterr()
    assert cli_main(["gen", "--endpoint", server.url, "-p", PROMPTS[2], "--seed", "5"]) == 0
    assert capsys.readouterr().out == want
    assert cli_main(["gen", "--endpoint", server.url + "/v1", "--json", "-p", PROMPTS[2], "--seed", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == want.rstrip("\n") and out["usage"]["completion_tokens"] > 0
    assert cli_main(["gen", "--endpoint", server.url, "-m", "no-such-model", "-p", "hi"]) == 1
    assert "404" in capsys.readouterr().err
    assert cli_main(["gen", "--endpoint", "ftp://x", "-p", "hi"]) == 2
    # the server refuses an option (this decoder's range; the client checks the union of decoders'): a usage error
    assert cli_main(["gen", "--endpoint", server.url, "--steps", "100001", "-p", "hi"]) == 2
    assert capsys.readouterr().err.endswith(  # (the option as the request named it, under the extension key)
        "answered 400: localdiff.steps: must be an integer in [1, 100000] (got 100001)\n"
    )


def test_chat_endpoint_in_the_tui(server, tmp_path):
    from localdiff.cli.remote import remote_loader
    from localdiff.tui.app import ChatApp
    from localdiff.tui.settings import ChatSettings
    from localdiff.tui.store import ChatStore

    async def go():
        app = ChatApp(
            "",
            store=ChatStore(tmp_path / "h.sqlite3"),
            loader=remote_loader(server.url, None),
            settings=ChatSettings(seed=0),
        )
        async with app.run_test(size=(80, 24)) as pilot:
            t0 = time.monotonic()
            while app.model is None or app.generating:
                assert time.monotonic() - t0 < 60 and app.load_error is None, app.load_error
                await pilot.pause(0.05)
            assert app.model_name == "tiny"
            await pilot.press(*PROMPTS[0])
            await pilot.press("enter")
            while app.finished_count < 1:
                assert time.monotonic() - t0 < 60
                await pilot.pause(0.05)
            fin = app.last_finish
            assert fin.error is None and fin.text == "27 + 58 = 85." and fin.finish_reason == "eos"
            assert [m.role for m in app.transcript.messages] == ["user", "assistant"]
            assert app.transcript.messages[1].text == "27 + 58 = 85."

    asyncio.run(go())


def test_serve_command_binds_locally_and_refuses_open_hosts_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALDIFF_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    (tmp_path / "none.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env["LOCALDIFF_CONFIG"] = str(tmp_path / "none.toml")
    cmd = [sys.executable, "-m", "localdiff", "serve"]
    r = subprocess.run(cmd + ["--host", "0.0.0.0"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--api-key" in r.stderr and "Traceback" not in r.stderr
    port = Running.free_port()
    p = subprocess.Popen(
        cmd + ["--port", str(port), "-m", "tiny", "--api-key", "s3cret"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, p, 60)
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "seed": 0}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret").chat.completions.create(**body)
        assert ok.choices[0].message.content == "27 + 58 = 85."
    finally:
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert "Uvicorn running on http://127.0.0.1:" in out and "Traceback" not in out


def test_health_is_503_while_loading_and_an_idle_model_unloads(tiny):
    from starlette.testclient import TestClient

    from localdiff.serve.app import build_app
    from localdiff.serve.worker import ModelWorker

    gate = threading.Event()

    def slow_loader(name):
        assert gate.wait(30)
        return tiny

    worker = ModelWorker(slow_loader, "tiny", keep_alive=0.2)
    worker.start(preload="tiny")
    try:
        with TestClient(build_app(worker)) as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
            gate.set()
            t0 = time.monotonic()
            while c.get("/health").status_code != 200:
                assert time.monotonic() - t0 < 30
                time.sleep(0.02)
            assert [m["name"] for m in c.get("/api/ps").json()["models"]] == [tiny.name]
            while c.get("/api/ps").json()["models"]:  # keep-alive 0.2 s: unloaded when idle
                assert time.monotonic() - t0 < 30
                time.sleep(0.05)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[0]}], "seed": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "27 + 58 = 85."
            assert [m["name"] for m in c.get("/api/ps").json()["models"]] == [tiny.name]  # loaded again
    finally:
        worker.stop()
