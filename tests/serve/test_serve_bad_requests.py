"""A corpus of bad requests to ``localdiff serve``: each is a 4xx with a JSON error body, never a 500, and the
server log holds no traceback and no error line."""

from __future__ import annotations

import httpx
import pytest
from servehelpers import Running

OK = [{"role": "user", "content": "What is 1 + 2?"}]
CHAT, COMP, OCHAT, OGEN = "/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"

# (path, body: dict = JSON / bytes = raw, expected status)
CORPUS = [
    (CHAT, b"{not json", 400),
    (CHAT, b"", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, b"\xff\xfe\x00", 400),
    (CHAT, b"[" * 20000 + b"]" * 20000, 400),  # deep nesting (within the limit)
    (CHAT, {"model": "tiny"}, 400),  # missing messages
    (CHAT, {"model": "tiny", "messages": []}, 400),
    (CHAT, {"model": "tiny", "messages": "hi"}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "   "}]}, 400),  # empty prompt
    (CHAT, {"model": 7, "messages": OK}, 400),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "2 \\ud800 + 58?"}]}', 400),  # lone surrogate
    (CHAT, b'{"model": "tiny\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x", "bogus": 1}]}, 400),
    (OCHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400),
    (CHAT, {"model": "no-such-model", "messages": OK}, 404),
    (CHAT, {"model": "nobody/nothing", "messages": OK}, 404),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": -5}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": 0}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": "10"}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": 1.5}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": True}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": 10**7}, 400),  # over the model's context
    (CHAT, {"model": "tiny", "messages": OK, "max_tokens": 1e30}, 400),  # a float with no exact integer
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": Infinity}', 400),
    (OGEN, {"model": "tiny", "prompt": "x", "options": {"num_predict": 1e30}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "temperature": 1e308}, 400),  # gave an empty answer
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "1 + 2 " * 600}]}, 400),  # prompt too long
    (CHAT, {"model": "tiny", "messages": OK, "temperature": 0}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "temperature": "hot"}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "seed": -1}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "seed": 2**70}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "n": 2}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "stream": "yes"}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "stop": 5}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "stop": ["a", "b", "c", "d", "e"]}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "top_p": 0.5}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "tools": [{"type": "function"}]}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "frobnicate": 1}, 400),  # unknown field
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"warp_speed": 9}}, 400),  # unknown option
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"max_denoising_steps": "many"}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"threshold": "x"}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"threshold": 2.0}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"t_min": 0.9, "t_max": 0.1}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": [1]}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "stream_options": {"include_usage": 1}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "localdiff": {"events": "everything"}}, 400),
    (CHAT, {"model": "tiny", "messages": OK, "stream": True, "localdiff": {"events": ["steps"]}}, 400),
    (COMP, {"model": "tiny"}, 400),
    (COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400),
    (COMP, {"model": "tiny", "prompt": "x", "suffix": "y"}, 400),
    (COMP, {"model": "tiny", "prompt": "x", "echo": True}, 400),
    (OCHAT, {"model": "nope"}, 404),  # a load request (no messages)
    (OCHAT, {"model": "tiny", "messages": OK, "options": {"num_predict": -7}}, 400),
    (OCHAT, {"model": "tiny", "messages": OK, "options": {"mirostat": 2}}, 400),
    (OCHAT, {"model": "tiny", "messages": OK, "options": "fast"}, 400),
    (OCHAT, {"model": "tiny", "messages": OK, "format": "json"}, 400),
    (OCHAT, {"model": "nope", "messages": OK}, 404),
    (OCHAT, {"model": "tiny", "messages": OK, "localdiff": {"events": 1}}, 400),
    (OCHAT, {"model": "tiny", "messages": OK, "localdiff": {"max_denoising_steps": 4}}, 400),
    (OGEN, {"model": "nope", "prompt": ""}, 404),  # a load request
    (OGEN, {"model": "tiny", "options": {"mirostat": 2}}, 400),  # checked as any other request
    (OGEN, {"model": "tiny", "prompt": 3}, 400),
    (OGEN, {"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, 400),
    ("/v1/nothing", {"model": "tiny"}, 404),
]


@pytest.fixture(scope="module")
def server():
    s = Running(api_key="k3y", max_body=64 * 1024)
    yield s
    s.stop()


def _post(server, path, body, headers=None):
    h = {"Authorization": "Bearer k3y", **(headers or {})}
    if isinstance(body, bytes):
        return httpx.post(
            server.url + path, content=body, headers={**h, "Content-Type": "application/json"}, timeout=60
        )
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def _is_json_error(r) -> bool:
    body = r.json()
    err = body.get("error")
    return isinstance(err, str) and err or isinstance(err, dict) and isinstance(err.get("message"), str)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path,body,status", CORPUS, ids=[f"{i}" for i in range(len(CORPUS))])
def test_bad_request_is_a_json_4xx(server, path, body, status):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert _is_json_error(r) and "Traceback" not in r.text


@pytest.mark.parametrize(
    "body,says",
    [
        (b'{"model": "tiny", "prompt": "caf\xe9"}', "request body is not UTF-8 (byte 0xe9 at offset 32)"),
        (b"{not json", "request body is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
        (b"[" * 20000 + b"]" * 20000, "request body is not valid JSON: nested too deeply"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "request body has a number too"),
    ],
    ids=["not UTF-8", "not JSON", "too deep", "5001-digit number"],
)
@pytest.mark.parametrize("path", [COMP, OGEN])
def test_an_unreadable_body_is_said_in_words(server, path, body, says):
    """(newcomer check, session 8: "request body is not valid JSON (UnicodeDecodeError: 'utf-8' codec can't ...")"""
    r = _post(server, path, body)
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    assert r.status_code == 400 and message.startswith(says), message
    assert "Error" not in message and "codec" not in message


@pytest.mark.parametrize(
    "path,body,key",
    [
        (
            CHAT,
            b'{"model": "tiny", "max_tokens": 1, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}',
            "max_tokens",
        ),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "content": "y"}]}', "content"),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "localdiff": {"threshold": 0.5, '
            b'"threshold": 0.9}}',
            "threshold",
        ),
        (OGEN, b'{"model": "tiny", "prompt": "x", "options": {"seed": 1, "seed": 2}}', "seed"),
        (OGEN, rb'{"model": "tiny", "prompt": "x", "\ud800": 1, "\ud800": 2}', "\\ud800"),
    ],
    ids=["top level", "in a message", "decoder option", "ollama option", "lone surrogate key"],
)
def test_a_key_given_twice_is_a_400_naming_it(server, path, body, key):
    """(JSON parsers keep the last value: `"max_tokens": 1, "max_tokens": 2` ran with 2, the 1 dropped unsaid;
    README: a setting given twice is a 400 naming the field)"""
    r = _post(server, path, body)
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    assert r.status_code == 400, r.text
    assert message == f'"{key}" appears twice in one object of the request body: send it once', message


def test_auth_size_and_method_errors(server):
    body = {"model": "tiny", "messages": OK, "max_tokens": 4}
    assert httpx.post(server.url + CHAT, json=body).status_code == 401  # no key
    r = httpx.post(server.url + CHAT, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + OCHAT, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)  # Ollama's shape
    assert httpx.get(server.url + "/v1/models").status_code == 401
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]}
    r = _post(server, CHAT, huge)
    assert r.status_code == 413 and _is_json_error(r)
    r = httpx.get(server.url + CHAT, headers={"Authorization": "Bearer k3y"})
    assert r.status_code == 405 and _is_json_error(r)
    assert _post(server, CHAT, body).status_code == 200  # the server still serves
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_the_log_has_no_traceback_and_no_500(server):
    for path, body, _ in CORPUS:
        _post(server, path, body)
    log = server.logs.text()
    assert "Traceback" not in log and " 500 " not in log and "internal error" not in log
    assert not [r for r in server.logs.records if r.levelname in ("ERROR", "CRITICAL")]
