"""Edge cases of requests to ``localdiff serve`` and of ``gen --endpoint``.

* ``temperature: 0`` reaches the model's decoder: the masked, block and causal decoders take it (their greedy
  default; an LLaDA-style masked model gives the same text as in-process greedy decoding), DiffusionGemma's canvas
  sampler refuses it with one clear 400 that names the field as sent and its ``param``.
* Type errors show the JSON the client sent (``true``, ``null``, ``[1]``, ``"banana"``), never Python values or type
  names; ``NaN`` / ``Infinity`` (not JSON) are a 400; ``1e400`` says "a number too large"; a raw control character
  says where it is. Ollama's ``keep_alive`` takes a duration or seconds (else a 400), and Ollama's options are named
  with ``options.``.
* A stream its client left mid-answer is logged 499, as nginx logs it.
* ``gen --endpoint --json`` without ``--seed`` reports the seed the server used.
* Ollama's ``/api/ps`` and ``/api/tags`` report real sizes, expiry and modification times.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from servehelpers import Running

import localdiff
from localdiff.cli import main as cli_main

LONG = {"max_denoising_steps": 20000, "confidence_threshold": 1e-12}  # a canvas that runs all its steps


@pytest.fixture(scope="module")
def server():
    s = Running(max_batch=1)  # one at a time: tests read worker.current (DiffusionGemma batches by default)
    yield s
    s.stop()


def test_temperature_zero_is_greedy_where_the_decoder_has_it(server):
    want = localdiff.load("tiny-mdm").generate("1 2 3 4", chat=False, max_new_tokens=12, temperature=0, seed=0).text
    other = localdiff.load("tiny-mdm").generate("1 2 3 4", chat=False, max_new_tokens=12, temperature=0, seed=7).text
    assert other == want  # greedy: the seed does not matter
    for seed in (0, 7):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny-mdm", "prompt": "1 2 3 4", "seed": seed, "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    r = httpx.post(
        server.url + "/api/generate",
        json={
            "model": "tiny-mdm",
            "prompt": "1 2 3 4",
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 12},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["response"] == want


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
        (
            "/api/chat",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": False,
                "options": {"temperature": 0},
            },
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0},
        ),
    ],
)
def test_temperature_zero_on_the_canvas_sampler_is_one_clear_400(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    msg = err if isinstance(err, str) else err["message"]
    named = "options.temperature: " if path.startswith("/api/") else "temperature: "  # as sent
    assert msg.startswith(named) and "> 0" in msg and "no greedy mode" in msg, msg


@pytest.mark.parametrize(
    "raw,shown",
    [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "(got true)"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', '(got "hot")'),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": null, "seed": [1]}',
            "(got [1])",
        ),
        (b'{"model": "tiny", "messages": [{"role": null, "content": "x"}]}', "(got null)"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN is not"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": -Infinity}', "-Infinity is not"),
    ],
)
def test_errors_show_the_json_the_client_sent(server, raw, shown):
    r = httpx.post(
        server.url + "/v1/chat/completions", content=raw, timeout=60, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert shown in msg and "True" not in msg and "None" not in msg, msg


def test_a_stream_left_mid_answer_is_logged_499(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 32,
        "localdiff": LONG,
    }
    c = httpx.Client(timeout=60)
    resp = c.send(c.build_request("POST", server.url + "/v1/chat/completions", json=body), stream=True)
    assert resp.status_code == 200
    job = server.worker.current
    assert job is not None
    resp.close()
    c.close()
    assert job.finished.wait(30)
    t0 = time.monotonic()
    lines = []
    while time.monotonic() - t0 < 10:
        lines = [
            r.getMessage()
            for r in server.logs.records
            if r.name == "localdiff.serve.access" and "/v1/chat/completions" in r.getMessage()
        ]
        if lines and lines[-1].endswith(" 499"):
            break
        time.sleep(0.02)
    assert lines and lines[-1].endswith(" 499"), lines[-3:]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "localdiff": {}})
    assert r.status_code == 200  # and a complete answer is still 200
    time.sleep(0.1)
    done = [r.getMessage() for r in server.logs.records if r.name == "localdiff.serve.access"]
    assert done[-1].endswith(" 200"), done[-1]


def test_gen_endpoint_json_reports_the_seed_the_server_used(server, capsys, tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("LOCALDIFF_")]:
        monkeypatch.delenv(k)
    (tmp_path / "none.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "none.toml"))
    capsys.readouterr()
    assert cli_main(["gen", "--endpoint", server.url, "--json", "-p", "What is 1 + 2?"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["seed"], int) and out["seed"] == out["localdiff"]["seed"]
    assert cli_main(["gen", "--endpoint", server.url, "--json", "-p", "What is 1 + 2?", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 3 == out["localdiff"]["seed"]


@pytest.mark.parametrize(
    "path,body,status,shown",
    [
        ("/api/generate", {"model": "tiny", "prompt": "", "keep_alive": [1]}, 400, "(got [1])"),
        ("/api/generate", {"model": "tiny", "prompt": "", "keep_alive": "banana"}, 400, '(got "banana")'),
        ("/api/chat", {"model": "tiny", "keep_alive": True}, 400, "(got true)"),
        ("/api/generate", {"model": "tiny", "prompt": "", "keep_alive": "1h30m"}, 200, None),
        ("/api/generate", {"model": "tiny", "prompt": "", "keep_alive": -1}, 200, None),
        ("/api/generate", {"model": "tiny", "prompt": "", "keep_alive": "0"}, 200, None),
        ("/v1/chat/completions", {"model": True, "messages": [{"role": "user", "content": "x"}]}, 400, "(got true)"),
        ("/api/generate", {"model": "tiny", "prompt": True}, 400, "(got true)"),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "options": {"seed": [1]}},
            400,
            "'options.seed' must be an integer (got [1])",
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}},
            400,
            "'options.temperature' must be a number",
        ),
    ],
)
def test_ollama_keep_alive_and_field_names(server, path, body, status, shown):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    if shown:
        err = r.json()["error"]
        msg = err if isinstance(err, str) else err["message"]
        assert shown in msg and "bool" not in msg, msg


def test_overflowing_number_and_control_character_messages(server):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}'
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "(got a number too large)" in r.json()["error"]["message"]
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\x01b"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "at at" not in msg and "control character at line 1" in msg, msg


def test_ollama_ps_and_tags_report_real_numbers(server):
    import datetime

    httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": ""}, timeout=60)  # tiny resident
    m = httpx.get(server.url + "/api/ps").json()["models"][0]
    net = server.worker.model.net
    assert m["size"] == sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers())) > 1_000_000
    assert m["size_vram"] == 0  # CPU
    left = datetime.datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")).timestamp() - time.time()
    assert 250 < left <= 301  # the test server's keep-alive: 300 s
    tag = next(t for t in httpx.get(server.url + "/api/tags").json()["models"] if t["name"] == "tiny")
    stamp = datetime.datetime.fromisoformat(tag["modified_at"].replace("Z", "+00:00")).timestamp()
    assert abs(stamp - os.stat(localdiff.load("tiny").path).st_mtime) < 1


def test_an_option_error_from_the_engine_names_its_param(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
