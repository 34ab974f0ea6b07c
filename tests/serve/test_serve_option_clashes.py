"""How ``localdiff serve`` names and settles a request's options, and what it reports about prefill and loading.

* An option of another family's decoder is named once and as the client sent it: "options.top_k: an option of ..."
  (Ollama) / "localdiff.top_k: ..." (OpenAI, the ``param`` too); the engine's own errors for a request's temperature
  and its range errors name it and show the value as sent ("(got -1)", never a Python float).
* One setting given twice (``temperature`` beside ``localdiff.t_max``, ``steps`` beside ``max_denoising_steps``,
  ``max_tokens`` beside ``max_completion_tokens``) or unusable (``events`` without streaming) is a 400 naming both;
  the same setting given once runs. An option whose range depends on the model is checked against its decoder.
* Control characters in JSON bodies are escaped and shown visibly in the log; requests the HTTP parser refuses get a
  JSON 400; the queue-full message counts in words.
* ``gen --endpoint`` maps ``--temperature`` as a local run does, refuses ``--dtype`` and reports stats with ``-v``.
* Prefill is counted: a masked model's ``prompt_eval_duration`` (Ollama) / ``prefill_seconds`` (each block's first
  forward, over the prompt and the blocks before it), the worker's own accounting (only the first step where
  canvases are not fused), and Ollama's ``load_duration`` of a model a request named.
"""

from __future__ import annotations

import json
import socket
import time

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
    r = _post(
        server,
        "/api/chat",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": False,
            "options": {"temperature": 0},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"].startswith("options.temperature: "), r.json()
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["message"].startswith("temperature: ")


@pytest.mark.parametrize(
    "path,body,where",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "hi", "stream": False, "options": {"temperature": -1}},
            "options.temperature",
        ),
    ],
)
def test_temperature_range_errors_show_the_value_as_sent(server, path, body, where):
    r = _post(server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    msg = err if isinstance(err, str) else err["message"]
    assert msg.startswith(f"{where}: ") and msg.endswith("(got -1)"), msg


def test_masked_model_counts_its_prefill(server):
    g = localdiff.load("tiny-mdm").generate("1 2 3 4", chat=False, max_new_tokens=8, seed=0)
    assert g.stats.prefill_seconds > 0 and g.stats.prefill_seconds < g.stats.seconds
    r = _post(
        server,
        "/api/generate",
        {"model": "tiny-mdm", "prompt": "1 2 3", "raw": True, "stream": False, "options": {"num_predict": 8}},
    ).json()
    assert r["prompt_eval_duration"] > 0
    assert r["total_duration"] >= r["prompt_eval_duration"] + r["eval_duration"] - 1


def test_unknown_option_names_what_was_typed_once():
    cls = POLICIES["llada"]
    assert str(unknown_option("alg", "alg", cls)).startswith("alg: an option of the dream decoder")
    assert str(unknown_option("alg", "--alg", cls)).startswith("--alg: 'alg' is an option of the dream decoder")


# ---- a setting given twice or unusable, escaping, the HTTP parser's refusals, --endpoint, accounting --------------
M = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body,named",
    [
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": M, "temperature": 0.5, "localdiff": {"t_max": 0.7}},
            ("'localdiff.t_max'", "'temperature'"),
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": M, "localdiff": {"steps": 8, "max_denoising_steps": 4}},
            ("'localdiff.steps'", "'localdiff.max_denoising_steps'"),
        ),
        (
            "/api/chat",
            {"model": "tiny", "messages": M, "stream": False, "options": {"steps": 8, "max_denoising_steps": 4}},
            ("'options.steps'", "'options.max_denoising_steps'"),
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny-mdm", "messages": M, "temperature": 0.5, "localdiff": {"temperature": 0.7}},
            ("'temperature'", "'localdiff.temperature'"),
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": M, "max_tokens": 5, "max_completion_tokens": 6},
            ("'max_tokens'", "'max_completion_tokens'"),
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": M, "localdiff": {"events": "steps"}},
            ("'localdiff.events'", '"stream": true'),
        ),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "hi", "stream": False, "localdiff": {"events": "canvases"}},
            ("'localdiff.events'", '"stream": true'),
        ),
    ],
)
def test_one_setting_given_twice_or_unusable_is_a_400_not_silently_settled(server, path, body, named):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    msg = err if isinstance(err, str) else err["message"]
    assert all(n in msg for n in named), msg


@pytest.mark.parametrize(
    "path,body",
    [
        ("/api/chat", {"model": "tiny", "messages": M, "stream": False, "options": {"temperature": 0.5, "seed": 1}}),
        ("/v1/chat/completions", {"model": "tiny", "messages": M, "max_tokens": 6, "max_completion_tokens": 6}),
        ("/v1/chat/completions", {"model": "tiny", "messages": M, "temperature": 0.5, "localdiff": {"t_min": 0.2}}),
    ],
)
def test_the_same_setting_once_still_runs(server, path, body):
    assert _post(server, path, body).status_code == 200


def test_c1_controls_in_json_bodies_are_escaped_and_the_log_shows_controls(server):
    # (an unknown field: its name is echoed; an unknown model's 404 echoes nothing, test_serve_model_names.py)
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": M, "frob\u009b31m": 1})
    assert r.status_code == 400 and b"\\u009b" in r.content and "\u009b".encode() not in r.content
    assert "\u009b" in r.json()["error"]["message"]  # the same JSON value
    assert httpx.get(server.url + "/v1/%1b%5b2Jx", timeout=10).status_code == 404
    time.sleep(0.05)  # (the access line is written 2 ms after)
    lines = [rec.getMessage() for rec in server.logs.records]
    assert any("/v1/\u241b[2Jx" in m for m in lines) and not any("\x1b" in m for m in lines)


@pytest.mark.parametrize(
    "raw,ollama",
    [
        (b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", True),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", False),
    ],
)
def test_requests_the_http_parser_refuses_get_a_json_400(server, raw, ollama):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
        c.sendall(raw)
        got = b""
        while chunk := c.recv(4096):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
    err = json.loads(body)["error"]
    assert (err if ollama else err["message"]) == "Invalid HTTP request received."


def test_queue_full_message_counts_in_words():
    from localdiff.serve.errors import ApiError
    from localdiff.serve.worker import ModelWorker

    w = ModelWorker(lambda name: None, "tiny", max_queue=1)
    w.submit(object())
    with pytest.raises(ApiError) as e:
        w.submit(object())
    assert "1 request already queued" in e.value.message


def test_endpoint_temperature_flags_map_as_locally(server, capsys, tmp_path, monkeypatch):
    from localdiff.backends.remote import request_fields
    from localdiff.cli import main

    assert request_fields(None, None, {"temperature": 0.0}) == {"temperature": 0.0}
    assert request_fields(None, None, {"t_max": 0.9, "t_min": 0.1}) == {"localdiff": {"t_max": 0.9, "t_min": 0.1}}
    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    assert (
        main(["gen", "--endpoint", server.url, "-m", "tiny", "-p", "hi", "--temperature", "0.9:0.1", "--seed", "1"])
        == 0
    )
    assert (
        main(
            ["gen", "--endpoint", server.url, "-m", "tiny-mdm", "-p", "1 2 3", "--raw", "--temperature", "0", "-n", "8"]
        )
        == 0
    )
    assert "error" not in capsys.readouterr().err


def test_ollama_reports_the_load_of_the_model_a_request_named():
    s = Running(model="tiny")
    try:
        r = _post(
            s,
            "/api/generate",
            {"model": "tiny-bd", "prompt": "1 2 3", "raw": True, "stream": False, "options": {"num_predict": 8}},
        ).json()
        again = _post(
            s,
            "/api/generate",
            {"model": "tiny-bd", "prompt": "1 2 3", "raw": True, "stream": False, "options": {"num_predict": 8}},
        ).json()
    finally:
        s.stop()
    assert r["load_duration"] > 1_000_000 > again["load_duration"]  # > 1 ms loading; resident: ~µs
    assert r["total_duration"] >= r["load_duration"] + r["eval_duration"]


def test_endpoint_refuses_dtype_and_reports_stats_with_v(server, capsys, tmp_path, monkeypatch):
    from localdiff.cli import main

    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    assert main(["gen", "--endpoint", server.url, "--dtype", "float32", "-p", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "error: --dtype applies to local models, not to --endpoint"
    assert main(["gen", "--endpoint", server.url, "-m", "tiny", "-p", "hi", "--seed", "4", "-v"]) == 0
    err = capsys.readouterr().err
    assert "stats: " in err and " forwards" in err and "seed 4" in err and "model tiny" in err


@pytest.mark.parametrize(
    "model,ext,status,said",
    [
        ("tiny", {"steps": 0}, 400, "localdiff.steps: must be an integer in [1, 100000] (got 0)"),
        ("tiny", {"steps": 500000}, 400, "localdiff.steps: must be an integer in [1, 100000] (got 500000)"),
        ("tiny", {"steps": "8"}, 400, "'localdiff.steps' must be an integer (got \"8\")"),
        ("tiny-bd", {"remasking": "low_confidence_dynamic"}, 200, None),  # SDAR's choices (LLaDA's were checked)
        ("tiny-mdm", {"remasking": "random"}, 200, None),
        ("tiny-bd", {"remasking": "random"}, 400, "localdiff.remasking: must be one of low_confidence_dynamic"),
    ],
)
def test_an_option_whose_range_depends_on_the_model_is_checked_against_its_decoder(server, model, ext, status, said):
    r = _post(server, "/v1/completions", {"model": model, "prompt": "1 2 3", "max_tokens": 4, "localdiff": ext})
    assert r.status_code == status, r.text
    if said:
        assert r.json()["error"]["message"].startswith(said), r.json()


def test_worker_accounting_counts_only_the_first_step_as_prefill_where_canvases_are_not_fused():
    from localdiff.serve.worker import Spent

    for fused, want in ((True, 6.0), (False, 1.0)):  # steps 0→1, 1→3, 3→6, a canvas ending after each: all of
        # them prefill where the next step is fused with it; else only the first (the prompt)
        s = Spent(0.0)
        for t in (0.0, 1.0, 3.0):
            s.poll(t, stops=False)
            s.canvas_done(fused)
        s.poll(6.0, stops=True)
        s.end(6.0)
        assert s.stats(prompt_tokens=3, new_tokens=3)["prefill_seconds"] == want
