"""``localdiff serve --draft NAME|auto``: DFlash drafts run per request, losslessly (greedy: the target's own tokens,
checked against the engine without a draft), τ in the responses' ``localdiff`` extension (OpenAI and Ollama routes),
and the conversation so far kept across requests (``usage.prompt_tokens_details.cached_tokens``; the same tokens and
acceptance lengths as a run without it). Bad ``--draft`` values are one line and exit 2 before the server starts.
The shipped trained pair: tiny-qwen3 + tiny-dflash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from cli_fixtures import isolated_config  # noqa: F401  (fixture)
from servehelpers import Running, wait_healthy

import localdiff
from localdiff.serve.drafts import Drafts

QUESTIONS = ["What is 41 + 93?", "Reverse the letters: d r a g o n", "Sort these words: elk cat gnu"]


@pytest.fixture(scope="module")
def alone():
    return localdiff.load("tiny-qwen3", device="cpu")


@pytest.fixture(scope="module")
def spec():
    return localdiff.load("tiny-qwen3", device="cpu", draft="auto")


@pytest.fixture(scope="module")
def server():
    drafts = Drafts("auto")
    s = Running(
        model="tiny-qwen3", loader=lambda name: localdiff.load(name, device="cpu", draft=drafts.for_model(name))
    )
    yield s
    s.stop()


def test_openai_chat_with_a_draft_equals_the_target_alone_turn_after_turn(server, alone, spec):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs: list[dict] = []
    for turn, q in enumerate(QUESTIONS):
        msgs.append({"role": "user", "content": q})
        r = client.chat.completions.create(model="tiny-qwen3", messages=msgs, temperature=0, max_tokens=24)
        want = alone.generate(msgs, max_new_tokens=24, temperature=0)
        drafted = spec.generate(msgs, max_new_tokens=24, temperature=0)  # no cache: a fresh run
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.token_ids)
        ext = r.model_extra["localdiff"]
        assert ext["acceptance_lengths"] == drafted.stats.acceptance_lengths and ext["draft_forwards"] > 0
        assert ext["acceptance_length"] == pytest.approx(drafted.stats.acceptance_length)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (turn > 0) and cached < r.usage.prompt_tokens
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})


def test_streamed_and_completion_routes_report_tau(server, alone):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    chunks = list(
        client.chat.completions.create(
            model="tiny-qwen3",
            messages=msgs,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone.generate(msgs, max_new_tokens=20, temperature=0).text
    assert chunks[-1].model_extra["localdiff"]["acceptance_length"] >= 1.0
    c = client.completions.create(model="tiny-qwen3", prompt="41 + 93 =", max_tokens=16, temperature=0)
    want = alone.generate("41 + 93 =", max_new_tokens=16, temperature=0, chat=False)
    assert c.choices[0].text == want.text and c.model_extra["localdiff"]["acceptance_lengths"]


def test_ollama_routes_equal_the_target_alone_and_report_tau(server, alone):
    msgs = [{"role": "user", "content": QUESTIONS[1]}]
    body = {"model": "tiny-qwen3", "messages": msgs, "stream": False, "options": {"temperature": 0, "num_predict": 20}}
    out = httpx.post(server.url + "/api/chat", json=body, timeout=60).json()
    assert out["message"]["content"] == alone.generate(msgs, max_new_tokens=20, temperature=0).text
    assert out["localdiff"]["acceptance_length"] >= 1.0 and out["localdiff"]["acceptance_lengths"]
    body = {
        "model": "tiny-qwen3",
        "prompt": QUESTIONS[2],
        "stream": False,
        "options": {"temperature": 0, "num_predict": 20},
    }
    out = httpx.post(server.url + "/api/generate", json=body, timeout=60).json()
    assert out["response"] == alone.generate(QUESTIONS[2], max_new_tokens=20, temperature=0).text
    assert out["localdiff"]["draft_forwards"] > 0


def test_drafts_go_with_causal_models_only():
    assert Drafts("auto").for_model("tiny-qwen3") == "auto" and Drafts("auto").for_model("tiny") is None
    assert Drafts("tiny-dflash").for_model("tiny-qwen3") == "tiny-dflash"
    assert Drafts("tiny-dflash").for_model("tiny-bd") is None and Drafts(None).for_model("tiny-qwen3") is None


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALDIFF_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    (tmp_path / "none.toml").touch()
    env["LOCALDIFF_CONFIG"] = str(tmp_path / "none.toml")
    return env


@pytest.mark.parametrize(
    "args,words",
    [
        (["-m", "tiny-qwen3", "--draft", "tiny-qwen3"], "not a DFlash draft"),
        (["-m", "tiny", "--draft", "tiny-dflash"], "pair with causal targets"),
        (["-m", "tiny", "--draft", "auto"], "pairs no draft with tiny"),
        (["-m", "tiny-qwen3", "--draft", "no-such-draft"], "no-such-draft"),
    ],
)
def test_bad_drafts_are_one_line_before_the_server_starts(args, words, capsys, isolated_config):
    from localdiff.cli import main

    port = str(Running.free_port())
    assert main(["serve", "--port", port, *args]) in (1, 2)  # (checked before the port is bound)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_serve_draft_auto_from_the_command_line(tmp_path, alone):
    port = Running.free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "serve", "--port", str(port), "-m", "tiny-qwen3", "--draft", "auto"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, p, 120)
        msgs = [{"role": "user", "content": QUESTIONS[0]}]
        r = openai.OpenAI(base_url=url + "/v1", api_key="x").chat.completions.create(
            model="tiny-qwen3", messages=msgs, temperature=0, max_tokens=20
        )
        assert r.choices[0].message.content == alone.generate(msgs, max_new_tokens=20, temperature=0).text
        assert r.model_extra["localdiff"]["acceptance_length"] > 1.0
    finally:
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert "Traceback" not in out
