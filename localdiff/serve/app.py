"""The Starlette application of ``localdiff serve``: routes, API key check, body limits, error bodies.

Routes: ``GET /health``; OpenAI ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
Ollama ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``, ``GET /api/ps``. All model work happens in
the :class:`~localdiff.serve.worker.ModelWorker` thread; handlers only parse, enqueue and relay.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from localdiff.serve import ollama_api, openai_api
from localdiff.serve.errors import ApiError, bad_request
from localdiff.serve.jobs import collect, pieces, raise_unavailable, start_job
from localdiff.serve.worker import ModelWorker

log = logging.getLogger("localdiff.serve")
DEFAULT_MAX_BODY = 1 << 20   # 1 MiB of JSON per request


@dataclass
class ServerSettings:
    """What the app enforces. ``api_key``: None = no key asked; ``max_body``: request bytes at most."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY


class _ClientGone(Exception):
    pass


def _ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    body = err.ollama_body() if _ollama(request) else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _check_key(request: Request, settings: ServerSettings) -> None:
    if settings.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not given or not hmac.compare_digest(given.encode(), settings.api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       type="authentication_error", code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object, at most ``limit`` bytes. Raises ApiError 413 / 400."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("empty request body: send a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


async def _unless_gone(request: Request, awaitable):
    """Await ``awaitable`` while watching for the client to disconnect (then cancel it and raise _ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def build_app(worker: ModelWorker, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app around ``worker`` (already started or not; the caller owns its lifecycle)."""
    settings = settings or ServerSettings()

    def endpoint(fn, gen: bool = False, public: bool = False):
        async def handler(request: Request):
            try:
                if not public:
                    _check_key(request, settings)
                if gen:
                    body = await _read_json(request, settings.max_body)
                    return await fn(request, body)
                return await fn(request)
            except ApiError as err:
                return _error_response(request, err)
            except _ClientGone:
                return PlainTextResponse("", status_code=499)
            except Exception as exc:  # noqa: BLE001 — one log line and a JSON 500, never a traceback
                log.error("internal error on %s %s: %s: %s", request.method, request.url.path,
                          type(exc).__name__, exc)
                return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}",
                                                         type="server_error"))
        return handler

    async def health(request: Request):
        raise_unavailable(worker)
        model = worker.model
        return JSONResponse({"status": "ok", "model": None if model is None else model.name,
                             "queued": worker.queued, "busy": worker.current is not None})

    async def root(request: Request):
        return PlainTextResponse("localdiff is running")

    def _names() -> list[str]:
        from localdiff.engine import installed_models

        names = [] if worker.model is None else [worker.model.name]
        for m in installed_models():
            n = str(m.get("name") or "")
            if n and n not in names:
                names.append(n)
        return names

    async def v1_models(request: Request):
        return JSONResponse(openai_api.models_list(await asyncio.to_thread(_names)))

    async def openai_gen(request: Request, req, chat: bool):
        job = await _unless_gone(request, start_job(worker, req))
        shape = openai_api.Shape(job.model.name, chat)
        if not req.stream:
            return JSONResponse(shape.full(await _unless_gone(request, collect(job))))

        async def events():
            role = chat                       # the role chunk goes out with the first parts (one write)
            try:
                async for batch in pieces(job):
                    parts = [_sse(shape.chunk(first=True))] if role else []
                    role = False
                    for kind, value in batch:
                        if kind == "text":
                            parts.append(_sse(shape.chunk(value)))
                        elif kind == "event":
                            parts.append(_sse(shape.event(value)))
                        else:
                            parts.append(_sse(shape.chunk(finish_reason=value.finish_reason)))
                            if req.include_usage:
                                parts.append(_sse(shape.usage_chunk(value)))
                            parts.append("data: [DONE]\n\n")
                    yield "".join(parts)
            except ApiError as err:
                yield _sse(err.openai_body()) + "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def chat_completions(request: Request, body: dict):
        return await openai_gen(request, openai_api.parse_chat(body), chat=True)

    async def completions(request: Request, body: dict):
        return await openai_gen(request, openai_api.parse_completion(body), chat=False)

    async def ollama_gen(request: Request, req, chat: bool):
        job = await _unless_gone(request, start_job(worker, req))
        shape = ollama_api.Shape(job.model.name, chat)
        if not req.stream:
            return JSONResponse(shape.final(await _unless_gone(request, collect(job)), streamed=False))

        async def lines():
            try:
                async for batch in pieces(job):
                    parts = []
                    for kind, value in batch:
                        if kind == "text":
                            parts.append(shape.piece(value))
                        elif kind == "event":
                            parts.append(shape.event(value))
                        else:
                            parts.append(shape.final(value, streamed=True))
                    yield "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in parts)
            except ApiError as err:
                yield json.dumps(err.ollama_body()) + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def api_chat(request: Request, body: dict):
        return await ollama_gen(request, ollama_api.parse_chat(body), chat=True)

    async def api_generate(request: Request, body: dict):
        return await ollama_gen(request, ollama_api.parse_generate(body), chat=False)

    async def api_tags(request: Request):
        from localdiff.engine import installed_models

        return JSONResponse(ollama_api.tags(await asyncio.to_thread(installed_models)))

    async def api_ps(request: Request):
        return JSONResponse(ollama_api.ps(worker.model))

    routes = [
        Route("/", endpoint(root, public=True), methods=["GET", "HEAD"]),
        Route("/health", endpoint(health, public=True), methods=["GET"]),
        Route("/v1/models", endpoint(v1_models), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions, gen=True), methods=["POST"]),
        Route("/v1/completions", endpoint(completions, gen=True), methods=["POST"]),
        Route("/api/chat", endpoint(api_chat, gen=True), methods=["POST"]),
        Route("/api/generate", endpoint(api_generate, gen=True), methods=["POST"]),
        Route("/api/tags", endpoint(api_tags), methods=["GET"]),
        Route("/api/ps", endpoint(api_ps), methods=["GET"]),
    ]

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                 f"{exc.detail}", type=kind))

    async def server_error(request: Request, exc: Exception):
        log.error("internal error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
