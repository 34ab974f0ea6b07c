"""``localdiff serve``'s response shape is made while the job waits (``localdiff/serve/asgi.py``: ``_shape``, from the
resident model) and remade when the job ran on another model: the answer names the model that made it. No socket:
the ASGI app is driven with a stand-in worker."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from localdiff.serve.app import ServerSettings
from localdiff.serve.asgi import GenerationRoutes
from localdiff.serve.names import ModelNames


class _Stats:
    def as_dict(self):
        return {"prompt_tokens": 3, "forwards": 2}


class _Worker:
    """Runs every job at once on the loop on ``runs`` (a model named so), while ``model`` is the resident one."""

    def __init__(self, resident: str | None, runs: str) -> None:
        self.model = None if resident is None else SimpleNamespace(name=resident)
        self.runs = runs

    def submit(self, job) -> None:
        job.model, job.seed = SimpleNamespace(name=self.runs), 0
        if job.req.stream:
            job.events.put_nowait(("start", job.model, None))
        job.events.put_nowait(("delta", "85", None))
        done = SimpleNamespace(text="85", finish_reason="eos", token_ids=[1, 2], stats=_Stats())
        job.events.put_nowait(("done", done, {"seed": 0, "sampler": {}}))


def _call(app, path: str, body: dict) -> tuple[int, bytes]:
    raw = json.dumps(body).encode()
    sent = []
    msgs = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop(0)
        await asyncio.sleep(3600)

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-length", str(len(raw)).encode())],
        "query_string": b"",
        "client": ("127.0.0.1", 1),
        "http_version": "1.1",
    }

    async def main():
        await app(scope, receive, send)

    asyncio.run(main())
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("resident", [None, "old", "new"])
@pytest.mark.parametrize(
    "path,stream",
    [("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/api/chat", False), ("/api/chat", True)],
)
def test_the_answer_names_the_model_that_ran_it(resident, path, stream):
    app = GenerationRoutes(
        _Worker(resident, "new"),
        ServerSettings(),
        fallback=None,
        names=ModelNames(["new", "old"], installed=lambda: []),
    )
    status, body = _call(app, path, {"model": "new", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    assert status == 200
    text = body.decode()
    lines = [ln.removeprefix("data: ") for ln in text.splitlines() if ln.strip() and ln != "data: [DONE]"]
    models = {json.loads(ln)["model"] for ln in lines}
    assert models == {"new"}, text
    if not stream and path.startswith("/v1/"):
        assert json.loads(lines[0])["choices"][0]["message"]["content"] == "85"
