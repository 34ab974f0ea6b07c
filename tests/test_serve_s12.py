"""Left-overs of the serve issue fixed in round 2 session 12 (each test fails on the code before it).

* An option of another family's decoder named itself twice ("top_k: 'top_k' is an option of ...") and, over HTTP,
  not as the client sent it: now "options.top_k: an option of ..." (Ollama) / "localdiff.top_k: ..." (OpenAI),
  the ``param`` too; the engine's own errors for a request's temperature name it as sent as well.
* A range error of ``temperature`` printed the value as a Python float ("(got -1.0)"): now as sent ("(got -1)").
* A masked model's ``prompt_eval_duration`` (Ollama) and ``prefill_seconds`` (stats) were 0: each block's first
  forward (over the prompt and the blocks before it) is now counted as prefill.
"""
from __future__ import annotations

import httpx
import pytest
from servehelpers import Running

import localdiff
from localdiff.decoding.schema import unknown_option
from localdiff.decoding.schema import POLICIES


@pytest.fixture(scope="module")
def server():
    s = Running()
    yield s
    s.stop()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_another_decoders_option_is_named_once_and_as_sent(server):
    r = _post(server, "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": {"top_k": 5}})
    assert r.status_code == 400
    msg = r.json()["error"]
    assert msg.startswith("options.top_k: an option of the ") and "'top_k'" not in msg, msg
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "localdiff": {"top_k": 5}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "localdiff.top_k"
    assert err["message"].startswith("localdiff.top_k: an option of the ") and "'top_k'" not in err["message"]
    assert "Traceback" not in server.logs.text()


def test_engine_errors_of_the_temperature_name_it_as_sent(server):
    r = _post(server, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                    "stream": False, "options": {"temperature": 0}})
    assert r.status_code == 400
    assert r.json()["error"].startswith("options.temperature: "), r.json()
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["message"].startswith("temperature: ")


@pytest.mark.parametrize("path,body,where", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": {"temperature": -1}},
     "options.temperature"),
])
def test_temperature_range_errors_show_the_value_as_sent(server, path, body, where):
    r = _post(server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    msg = err if isinstance(err, str) else err["message"]
    assert msg.startswith(f"{where}: ") and msg.endswith("(got -1)"), msg


def test_masked_model_counts_its_prefill(server):
    g = localdiff.load("tiny-mdm").generate("1 2 3 4", chat=False, max_new_tokens=8, seed=0)
    assert g.stats.prefill_seconds > 0 and g.stats.prefill_seconds < g.stats.seconds
    r = _post(server, "/api/generate", {"model": "tiny-mdm", "prompt": "1 2 3", "raw": True, "stream": False,
                                        "options": {"num_predict": 8}}).json()
    assert r["prompt_eval_duration"] > 0
    assert r["total_duration"] >= r["prompt_eval_duration"] + r["eval_duration"] - 1


def test_unknown_option_names_what_was_typed_once():
    cls = POLICIES["llada"]
    assert str(unknown_option("alg", "alg", cls)).startswith("alg: an option of the dream decoder")
    assert str(unknown_option("alg", "--alg", cls)).startswith("--alg: 'alg' is an option of the dream decoder")
