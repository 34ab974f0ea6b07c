"""Session 6 newcomer findings on ``localdiff serve``. An answer cut by a stop string reports real numbers (its
``localdiff`` extension had null forwards / canvases / seconds and an empty sampler, Ollama's durations were 0): from
the engine's Done when the generation ended first, else from the worker's own accounting of the steps it ran before
the cancel. Ollama's load request (an empty prompt) loads the model and generates nothing."""

from __future__ import annotations

import httpx
import pytest
from servehelpers import Running

from localdiff.serve.worker import Spent

# raw completion of the embedded model: two canvases at seed 2 (the first holds "4 5 6"), so a stop string "5"
# cuts in the first canvas while the engine may still be running the second
CUT = {"prompt": "1 2 3 4 5 6 7", "seed": 2, "max_tokens": 128}


@pytest.fixture(scope="module")
def server():
    s = Running()
    yield s
    s.stop()


def test_openai_cut_answer_has_stats(server):
    full = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **CUT}, timeout=60).json()
    assert "5" in full["choices"][0]["text"]
    for stream in (False, True):
        body = {"model": "tiny", **CUT, "stop": ["5"], "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                chunks = [__import__("json").loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            last = chunks[-1]
        else:
            last = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            text = last["choices"][0]["text"]
        assert text == full["choices"][0]["text"].split("5")[0]
        ext, usage = last["localdiff"], last["usage"]
        assert usage["completion_tokens"] == len(server.worker.model.tokenizer.encode(text)) > 0
        assert ext["forwards"] >= 1 and ext["steps"] == ext["forwards"] and ext["canvases"] >= 1, ext
        assert ext["seconds"] > 0 and ext["tokens_per_second"] > 0
        assert ext["tokens_per_forward"] == pytest.approx(usage["completion_tokens"] / ext["forwards"])
        assert (
            ext["seed"] == 2
            and ext["sampler"]["max_denoising_steps"] == full["localdiff"]["sampler"]["max_denoising_steps"]
            and ext["sampler"] == full["localdiff"]["sampler"]
        )


def test_ollama_cut_answer_has_durations(server):
    r = httpx.post(
        server.url + "/api/generate",
        json={
            "model": "tiny",
            "prompt": CUT["prompt"],
            "raw": True,
            "stream": False,
            "options": {"seed": 2, "num_predict": 128, "stop": ["5"]},
        },
        timeout=60,
    ).json()
    assert r["done"] and r["done_reason"] == "stop" and r["eval_count"] > 0
    assert r["total_duration"] > 0 and r["prompt_eval_duration"] > 0
    assert r["total_duration"] >= r["prompt_eval_duration"] + r["eval_duration"] - 1


def test_worker_accounting_of_a_cancelled_run():
    """Polls before each step at t = 0, 1, 3 (a canvas ends after the second step), 4, then the cancel at 6: four
    steps; the two that opened a canvas (0→1 and 3→4) are the prefill's; 6 s in all."""
    s = Spent(0.0)
    s.poll(0.0, stops=False)
    s.poll(1.0, stops=False)
    s.canvas_done()
    s.poll(3.0, stops=False)
    s.poll(4.0, stops=False)
    s.poll(6.0, stops=True)
    s.end(6.0)
    st = s.stats(prompt_tokens=5, new_tokens=8)
    assert (st["forwards"], st["canvases"], st["seconds"], st["prefill_seconds"]) == (4, 1, 6.0, 2.0)
    assert st["tokens_per_forward"] == 2.0 and st["tokens_per_second"] == pytest.approx(8 / 6)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/api/generate", {"prompt": ""}),
        ("/api/generate", {}),
        ("/api/generate", {"prompt": "", "stream": False, "raw": True}),
        ("/api/chat", {"messages": []}),
        ("/api/chat", {}),
    ],
)
def test_ollama_load_request(server, path, body):
    """An empty or absent prompt / messages loads the model and answers ``done_reason: "load"``, as Ollama does
    (its documented way to preload a model); it generated an answer to an empty prompt (or was a 400)."""
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    got = r.json()
    content = got["message"] if path == "/api/chat" else got["response"]
    assert got["done"] is True and got["done_reason"] == "load" and got["model"] == "tiny"
    assert content == ({"role": "assistant", "content": ""} if path == "/api/chat" else "")


def test_huge_float_max_tokens_names_the_field(server):
    """(``max_tokens: 1e30`` was a 400 about max_new_tokens 1000000000000000019884624838656 over the context)"""
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e30},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "'max_tokens' must be an integer (got 1e+30)",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
