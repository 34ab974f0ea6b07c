"""The generation routes of ``localdiff serve`` as one plain ASGI callable (no Starlette on the hot path).

``POST /v1/chat/completions``, ``/v1/completions``, ``/api/chat`` and ``/api/generate`` are served here, straight
on uvicorn's ``receive`` / ``send``; every other request (``/health``, the model lists, 404 / 405, lifespan) goes to
the Starlette app of :mod:`localdiff.serve.app`. Why: on the embedded model's ~20 ms answers, Starlette's
``StreamingResponse`` (an anyio task group per response, its middleware stack and exception wrappers) cost more
event-loop CPU per request than parsing and writing the response itself (profiled with ``cProfile`` on the loop
thread's CPU clock, ``localdiff bench --only serve``); the behaviour seen by clients is the same.

One request: check the API key, read at most ``max_body`` bytes of JSON, parse it (``openai_api`` /
``ollama_api``), submit a :class:`~localdiff.serve.worker.Job`, then relay its parts (one ``send`` per hand-off from
the model thread, :func:`localdiff.serve.jobs.pieces`). The client's disconnect (seen by the connection's protocol,
:func:`localdiff.serve.transport.on_disconnect`; under another server, by a task waiting on ``receive()``) sets the
job's cancel flag at once (the engine stops before its next denoising step) and wakes the
handler, whether the job is still queued or streaming. Every request, Starlette's included, gets one access-log
line once its response is complete (:func:`log_access`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging

from localdiff.safetext import has_controls, visible
from localdiff.serve import ollama_api, openai_api
from localdiff.serve.errors import ApiError, bad_request, shutting_down
from localdiff.serve.jobs import ClientGone, collect, pieces
from localdiff.serve.names import ModelNames
from localdiff.serve.openai_api import dumps
from localdiff.serve.transport import flush_now, on_disconnect
from localdiff.serve.worker import Job

log = logging.getLogger("localdiff.serve")
access = logging.getLogger("localdiff.serve.access")


class VisibleControls(logging.Filter):
    """Shows the control characters of a log message visibly (:func:`localdiff.safetext.visible`): what a client
    sent (a percent-encoded ESC in a request path, a model name quoted in an error) reaches the operator's terminal
    through the server's log, and must not run there as a control sequence."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()  # formatted once: the handler then finds it done
        record.msg, record.args = (visible(msg) if has_controls(msg) else msg), None
        return True


for _logger in (log, access):
    _logger.addFilter(VisibleControls())

ACCESS_LOG_DELAY = 0.002  # s: a response's access line waits this long (see log_access)
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_NDJSON = [(b"content-type", b"application/x-ndjson")]


def check_key(api_key: str | None, authorization: str, x_api_key: str) -> None:
    """Accept ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) equal to ``api_key`` (constant-time compare);
    no check when ``api_key`` is None. Raises ApiError(401)."""
    if api_key is None:
        return
    given = authorization[7:].strip() if authorization.lower().startswith("bearer ") else x_api_key
    if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(
            401,
            "missing or wrong API key (send 'Authorization: Bearer KEY')",
            type="authentication_error",
            code="invalid_api_key",
        )


def _no_constant(name: str):
    """``json.loads``' hook for ``NaN`` / ``Infinity`` / ``-Infinity``, which Python reads but JSON has not."""
    raise bad_request(f"request body is not valid JSON: {name} is not a JSON number")


def _no_repeats(pairs: list) -> dict:
    """``json.loads``' hook for each object: a key given twice is a 400 naming it (JSON parsers keep the last value
    and drop the first without a word: ``{"max_tokens": 1, "max_tokens": 2}`` ran with 2)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        shown = json.dumps(key if len(key) <= 60 else key[:60] + "…")  # ASCII: a key may hold a lone surrogate
        raise bad_request(f"{shown} appears twice in one object of the request body: send it once", param=shown[1:-1])
    return out


def parse_json(raw: bytes) -> dict:
    """A request body → a JSON object. Raises ApiError(400) with a plain message (no Python exception names): empty,
    not UTF-8, not JSON (or nested past the parser's depth; ``NaN`` / ``Infinity``), not an object, a key given
    twice in one object, or a string with an unpaired surrogate escape such as ``"\\ud800"`` (JSON allows it, but it
    is no Unicode text: the tokenizer and the log cannot encode it)."""
    if not raw.strip():
        raise bad_request("empty request body: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"request body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): send JSON encoded as UTF-8"
        ) from None
    try:
        body = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        msg = e.msg[:80].removesuffix(" at")  # ("Invalid control character at" ends with it)
        raise bad_request(f"request body is not valid JSON ({msg} at {where})") from None
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except ValueError:  # int(): a number of more than sys.get_int_max_str_digits() (4300) digits
        raise bad_request("request body has a number too long to read (over 4300 digits)") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if b"\\ud" in raw or b"\\uD" in raw:  # only an escape can carry a lone surrogate (raw is UTF-8)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                "request body has an unpaired UTF-16 surrogate escape (e.g. \\ud800): not Unicode text"
            ) from None
    return body


def too_large(limit: int) -> ApiError:
    """The 413 for a body over ``limit`` bytes."""
    return ApiError(413, f"request body over {limit} bytes", code="request_too_large")


async def _read_body(receive, declared: str, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (ApiError 413; checked on Content-Length first).
    Raises ClientGone when the client disconnects while sending it."""
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _gone(job: Job) -> None:
    """The client went away: cancel ``job`` and wake its handler (a ``("gone",)`` event)."""
    job.cancel.set()
    job.events.put_nowait(("gone",))


def _stream_error(err: ApiError, ollama: bool) -> bytes:
    """``err`` as a stream's last part: an NDJSON line (Ollama) or an SSE error event and ``data: [DONE]``."""
    body = dumps(err.body(ollama))
    return (body + "\n" if ollama else "data: " + body + "\n\ndata: [DONE]\n\n").encode()


def _stopping(job: Job) -> None:
    """The server is shutting down: the engine stops ``job`` before its next step; the worker then reports a 503
    (the stream's last part, or the JSON error of a response not begun)."""
    job.stopping = True
    job.cancel.set()


async def _watch(receive, job: Job) -> None:
    """Wait for the client to go away, then :func:`_gone` (where the server gives no disconnect hook:
    :func:`localdiff.serve.transport.on_disconnect`)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return _gone(job)


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> int:
    data = dumps(body).encode()
    hdrs = [_JSON, (b"content-length", str(len(data)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})
    flush_now(send)
    return status


def log_access(scope, status: int | None) -> None:
    """The access-log line of one request (``localdiff.serve.access``, INFO; uvicorn's own line is off, see
    :func:`localdiff.serve.uvicorn_config`), written once the response is complete, from a loop timer
    ``ACCESS_LOG_DELAY`` after the response's last write, with the status actually sent (None: nothing was sent).
    Not on the answer's path: a queued callback would run before the loop next waits, and a client on the server's
    own CPU (woken by that write) would wait for the line's ~0.1 ms of logging before it could read the answer; the
    timer lets the loop wait first. A stream its client left mid-answer is logged 499 (nginx's "client closed
    request"), though its head said 200."""
    if access.isEnabledFor(logging.INFO):
        client = scope.get("client")
        path = scope.get("path", "") + (
            "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""
        )
        access.info(
            '%s - "%s %s HTTP/%s" %s',
            f"{client[0]}:{client[1]}" if client else "-",
            scope.get("method"),
            path,
            scope.get("http_version"),
            "-" if status is None else status,
        )


def _openai_lines(shape: openai_api.Shape, req, batch: list, role: bool) -> str:
    parts = [shape.role_line()] if role else []
    for kind, value in batch:
        if kind == "text":
            parts.append(shape.text_line(value))
        elif kind == "event":
            parts.append(shape.event_line(value))
        else:
            parts.append(shape.finish_line(value.finish_reason))
            if req.include_usage:
                parts.append(shape.usage_chunk(value))
    out = "".join(p if isinstance(p, str) else "data: " + dumps(p) + "\n\n" for p in parts)
    return out + "data: [DONE]\n\n" if batch and batch[-1][0] == "end" else out


def _ollama_lines(shape: ollama_api.Shape, batch: list) -> str:
    parts = []
    for kind, value in batch:
        if kind == "text":
            parts.append(shape.piece(value))
        elif kind == "event":
            parts.append(shape.event(value))
        else:
            parts.append(shape.final(value, streamed=True))
    return "".join(dumps(p) + "\n" for p in parts)


def _shape(model, chat: bool, ollama: bool):
    """The response shape (its id and creation time) for an answer of ``model`` (a Model, or None: not known yet).
    Made right after the job is queued, from the resident model, so that the answer's first write need not wait
    for it; remade when the job ran on another model (``job.model``: a request that named another one)."""
    if model is None:
        return None
    return ollama_api.Shape(model.name, chat) if ollama else openai_api.Shape(model.name, chat)


class GenerationRoutes:
    """The ASGI app of ``localdiff serve``: the four generation routes here, the rest to ``fallback``.

    Args:
        worker: the :class:`~localdiff.serve.worker.ModelWorker` that runs every generation.
        settings: ``api_key`` / ``max_body`` (``localdiff.serve.app.ServerSettings``).
        fallback: the ASGI app for every other request (Starlette).
        names: the models it answers for (:class:`~localdiff.serve.names.ModelNames`; None: the installed ones and
            the worker's default model). A request's ``model`` is looked up there before anything is queued or
            loaded: any other name is one 404 that reads nothing from the disk.
    """

    ROUTES = {
        "/v1/chat/completions": (openai_api.parse_chat, True, False),
        "/v1/completions": (openai_api.parse_completion, False, False),
        "/api/chat": (ollama_api.parse_chat, True, True),
        "/api/generate": (ollama_api.parse_generate, False, True),
    }  # path → (parser, chat, ollama shape)

    def __init__(self, worker, settings, fallback, names: ModelNames | None = None) -> None:
        self.worker, self.settings, self.fallback = worker, settings, fallback
        self.names = names or ModelNames(default=getattr(worker, "default_model", ""))

    async def __call__(self, scope, receive, send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            return await self.fallback(scope, receive, send)
        if scope["method"] == "POST":
            route = self.ROUTES.get(scope["path"])
            if route is not None:
                return await self._serve(route, scope, receive, send)
        sent = [None]

        async def send_logged(msg):
            if msg["type"] == "http.response.start":
                sent[0] = msg["status"]
            await send(msg)

        try:
            await self.fallback(scope, receive, send_logged)
        finally:
            asyncio.get_running_loop().call_later(ACCESS_LOG_DELAY, log_access, scope, sent[0])

    async def _serve(self, route, scope, receive, send) -> None:
        parse, chat, ollama = route
        job = watcher = status = None
        hooked = False
        started = False
        try:
            headers = {k: v for k, v in scope["headers"] if k in (b"authorization", b"x-api-key", b"content-length")}
            check_key(
                self.settings.api_key,
                headers.get(b"authorization", b"").decode("latin-1"),
                headers.get(b"x-api-key", b"").decode("latin-1"),
            )
            raw = await _read_body(
                receive, headers.get(b"content-length", b"").decode("latin-1"), self.settings.max_body
            )
            req = parse(parse_json(raw))
            model_name = self.names.lookup(req.model)  # never a path from the request (localdiff.serve.names)
            req.model = model_name if model_name is not None else await asyncio.to_thread(self.names.resolve, req.model)
            if req.load_only:  # Ollama's load request: the model thread loads, in queue order
                model = await asyncio.to_thread(self.worker.load, req.model)
                status = await _send_json(send, 200, ollama_api.loaded(model.name, chat))
                return
            job = Job(req, asyncio.get_running_loop())
            hooked = on_disconnect(send, functools.partial(_gone, job), functools.partial(_stopping, job))
            watcher = None if hooked else asyncio.ensure_future(_watch(receive, job))
            shape = _shape(self.worker.model, chat, ollama)  # built before the job runs (off the answer's path)
            self.worker.submit(job)  # last before the wait: the woken model thread finds the interpreter lock free
            first = await job.batch()
            if first[0][0] == "gone":
                raise ClientGone()
            if first[0][0] == "error":
                raise first[0][1]
            job.held = first  # read again by pieces()
            if shape is None or shape.model != job.model.name:  # no resident model yet, or the job loaded another
                shape = _shape(job.model, chat, ollama)
            if not req.stream:
                result = await collect(job)
                body = shape.final(result, streamed=False) if ollama else shape.full(result)
                status = await _send_json(send, 200, body)
                return
            await send({"type": "http.response.start", "status": 200, "headers": _NDJSON if ollama else _SSE})
            started, status = True, 200
            role = chat and not ollama  # the role chunk goes out with the first parts (one write)
            end = False
            try:
                # run to its end (no return / break inside): an abandoned async generator is closed by a task that
                # asyncio's finalizer hook schedules through call_soon_threadsafe, a wake-up of the loop per request
                async for batch in pieces(job):
                    text = _ollama_lines(shape, batch) if ollama else _openai_lines(shape, req, batch, role)
                    role = False
                    end = batch[-1][0] == "end"  # the last part and the end of the chunked body: one write
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": not end})
                    if end:
                        flush_now(send)  # the answer's last byte goes now, the clean-up after it
            except ApiError as err:  # failed mid-stream: the error as the stream's last part
                await send({"type": "http.response.body", "body": _stream_error(err, ollama), "more_body": True})
            if not end:
                await send({"type": "http.response.body", "body": b""})
        except ClientGone:
            if not started:
                status = await _send_json(send, 499, {"error": "client closed the request"})
            else:  # the access line says so, as nginx's does for a client gone mid-answer
                status = 499
        except asyncio.CancelledError:  # uvicorn's shutdown gave up waiting (a step longer than its grace period,
            log.info("POST %s cancelled by the server's shutdown", scope["path"])  # or a second Ctrl-C): one line
            if job is not None:
                _stopping(job)
            try:  # and the 503 still goes out (JSON, or the stream's last part and its end)
                if not started:
                    err = shutting_down()
                    status = await _send_json(send, 503, err.body(ollama))
                else:
                    await send({"type": "http.response.body", "body": _stream_error(shutting_down(), ollama)})
                    flush_now(send)
            except Exception:  # noqa: BLE001 — the connection is already gone
                pass
        except ApiError as err:
            status = await _send_json(send, err.status, err.body(ollama), err.headers)
        except Exception as exc:  # noqa: BLE001 — one log line and a JSON 500, never a traceback
            log.error("internal error on POST %s: %s: %s", scope["path"], type(exc).__name__, exc)
            if not started:
                err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
                status = await _send_json(send, 500, err.body(ollama))
        finally:
            if hooked:
                on_disconnect(send, None)
            if watcher is not None:
                watcher.cancel()
            if job is not None:
                job.cancel.set()  # no-op after the end; stops the engine when the response is abandoned
            asyncio.get_running_loop().call_later(ACCESS_LOG_DELAY, log_access, scope, status)  # after the write
