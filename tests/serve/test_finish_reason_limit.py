"""``finish_reason`` is "length" only when the token limit cut the answer: an answer of 0 new tokens under a limit
of 256 (the raw prompt "hi" on tiny: its first canvas is all pad) said "length" in ``gen --json`` and in
``/v1/completions``."""

from __future__ import annotations

import json

import httpx
import pytest
from cli_fixtures import isolated_config  # noqa: F401  (fixture)
from servehelpers import Running

from localdiff.cli import main as cli_main


@pytest.fixture(scope="module")
def server():
    s = Running()
    yield s
    s.stop()


def test_gen_json_empty_answer_under_the_limit_is_not_length(isolated_config, capsys):  # noqa: F811
    assert cli_main(["gen", "--raw", "-p", "hi", "--json", "--seed", "0", "-q"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["usage"]["completion_tokens"] == 0 and d["finish_reason"] == "eos"


def test_gen_json_an_answer_cut_by_the_limit_is_length(isolated_config, capsys):  # noqa: F811
    assert cli_main(["gen", "-p", "hi", "--json", "--seed", "0", "-q", "--max-new-tokens", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["usage"]["completion_tokens"] == 2 and d["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_empty_answer_under_the_limit_says_stop(server, stream):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 256, "seed": 0, "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]
        text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    else:
        finish, text = r.json()["choices"][0]["finish_reason"], r.json()["choices"][0]["text"]
    assert text == "" and finish == "stop"


def test_completions_cut_by_max_tokens_says_length(server):
    body = {"model": "tiny", "prompt": "What is 41 + 93?", "max_tokens": 2, "seed": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
