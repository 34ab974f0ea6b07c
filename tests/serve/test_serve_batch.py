"""``localdiff serve --max-batch``: concurrent requests through the official openai client share each step and get
the answers they get alone (block and masked models, greedy and seeded sampling, one client leaving mid-way);
``/api/ps`` and the usage extension show the batch; ``--kv-budget`` holds a request back until it fits."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servehelpers import Running

import localdiff

ASKS = [
    ("What is 41 + 93?", 24, 0.0, 1, {}),
    ("Tell me a story about a cat that", 16, 0.8, 2, {}),
    ("hi", 9, 0.0, 3, {}),
    ("Count: 1 2 3 4 5 6 7", 20, 1.0, 4, {}),
]
MASKED = {"kv_cache": "dual", "block_length": 8, "steps": 8}


def _held(server, n: int):
    """Hold the model thread (a queued ``call``) until ``n`` requests wait behind it; returns the release."""
    gate = threading.Event()
    threading.Thread(target=server.worker.call, args=(gate.wait,), daemon=True).start()

    def release():
        t0 = time.monotonic()
        while server.worker.queued < n and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        gate.set()

    return release


def _ask(url, prompt, max_tokens, temperature, seed, extra, stream=False, leave_after=None):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw = dict(
        model=extra.get("model"),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        extra_body={"localdiff": {k: v for k, v in extra.items() if k != "model"}} if len(extra) > 1 else None,
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, (r.model_extra or {}).get("localdiff", {})
    text, ext = "", {}
    s = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    for i, chunk in enumerate(s):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        ext = (chunk.model_extra or {}).get("localdiff") or ext
        if leave_after is not None and i >= leave_after:
            s.close()
            return None, {}
    return text, ext


@pytest.mark.parametrize("name", ["tiny-bd", "tiny-mdm"])
def test_concurrent_requests_through_serve_get_their_own_answers(name):
    extra = dict(MASKED, model=name) if name == "tiny-mdm" else {"model": name}
    m = localdiff.load(name)
    opts = MASKED if name == "tiny-mdm" else {}
    want = [m.generate(p, max_new_tokens=n, seed=s, temperature=t, **opts).text for p, n, t, s, _ in ASKS]
    server = Running(name, max_batch=8)
    try:
        release = _held(server, len(ASKS))
        with ThreadPoolExecutor(len(ASKS)) as pool:
            futs = [
                pool.submit(_ask, server.url, p, n, t, s, extra, stream=i % 2 == 1)
                for i, (p, n, t, s, _) in enumerate(ASKS)
            ]
            release()
            got = [f.result(timeout=120) for f in futs]
        assert [g[0] for g in got] == want
        assert max(g[1]["batch"]["requests_max"] for g in got) >= 3  # they ran together
        ps = httpx.get(server.url + "/api/ps").json()["models"][0]["localdiff"]["batch"]
        assert ps["max_batch"] == 8 and ps["active"] == 0 and ps["steps"] > 0
    finally:
        server.stop()
    assert "Traceback" not in server.logs.text()


def test_a_client_leaving_mid_way_does_not_disturb_the_batch():
    m = localdiff.load("tiny-bd")
    asks = [("What is 41 + 93?", 32, 0.0, 1), ("Count: 1 2 3 4 5 6 7", 32, 0.0, 2), ("hi there", 32, 0.7, 3)]
    want = [m.generate(p, max_new_tokens=n, seed=s, temperature=t).text for p, n, t, s in asks]
    server = Running("tiny-bd", max_batch=8)
    try:
        release = _held(server, 3)
        with ThreadPoolExecutor(3) as pool:
            futs = [
                pool.submit(
                    _ask, server.url, p, n, t, s, {"model": "tiny-bd"}, stream=True, leave_after=1 if i == 1 else None
                )
                for i, (p, n, t, s) in enumerate(asks)
            ]
            release()
            got = [f.result(timeout=120)[0] for f in futs]
        assert got[0] == want[0] and got[1] is None and got[2] == want[2]
        t0 = time.monotonic()
        while server.worker.running and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert not server.worker.running
    finally:
        server.stop()


def test_kv_budget_holds_a_request_back_until_the_batch_has_room():
    m = localdiff.load("tiny-bd")
    asks = [("What is 41 + 93?", 24, 0.0, 1), ("Count: 1 2 3 4 5 6 7", 24, 0.0, 2)]
    want = [m.generate(p, max_new_tokens=n, seed=s, temperature=t).text for p, n, t, s in asks]
    from localdiff.serve.batching import kv_bytes

    one = kv_bytes(m, len(m.encode_prompt(asks[1][0])[0]), 24)
    server = Running("tiny-bd", max_batch=8, kv_budget=one + 16)  # room for one request's cache at a time
    try:
        release = _held(server, 2)
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(_ask, server.url, p, n, t, s, {"model": "tiny-bd"}) for p, n, t, s in asks]
            release()
            got = [f.result(timeout=120) for f in futs]
        assert [g[0] for g in got] == want
        assert all(g[1]["batch"]["requests_max"] == 1 for g in got)  # one after the other
    finally:
        server.stop()
