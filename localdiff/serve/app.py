"""The application of ``localdiff serve``: routes, API key check, error bodies.

Routes: ``GET /health``; OpenAI ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``;
Ollama ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``, ``GET /api/ps``. The four generation POSTs
are plain ASGI (:class:`localdiff.serve.asgi.GenerationRoutes`, the hot path); the rest is a Starlette app behind
it. All model work happens in the :class:`~localdiff.serve.worker.ModelWorker` thread; handlers only parse, enqueue
and relay.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from localdiff.serve import ollama_api, openai_api
from localdiff.serve.asgi import GenerationRoutes, check_key
from localdiff.serve.errors import ApiError
from localdiff.serve.jobs import raise_unavailable
from localdiff.serve.names import ModelNames
from localdiff.serve.worker import ModelWorker

log = logging.getLogger("localdiff.serve")
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB of JSON per request


@dataclass
class ServerSettings:
    """What the app enforces. ``api_key``: None = no key asked; ``max_body``: request bytes at most."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY


class SafeJSONResponse(JSONResponse):
    """Starlette's JSONResponse written with the server's encoder (:func:`localdiff.serve.openai_api.dumps`:
    compact, control characters escaped) like the generation routes' bodies."""

    def render(self, content) -> bytes:
        return openai_api.dumps(content).encode("utf-8")


def _ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _error_response(request: Request, err: ApiError) -> SafeJSONResponse:
    body = err.body(_ollama(request))
    return SafeJSONResponse(body, status_code=err.status, headers=err.headers)


def _check_key(request: Request, settings: ServerSettings) -> None:
    check_key(settings.api_key, request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))


def build_app(
    worker: ModelWorker, settings: ServerSettings | None = None, names: ModelNames | None = None
) -> GenerationRoutes:
    """The ASGI app around ``worker`` (already started or not; the caller owns its lifecycle). ``names``: the models
    it answers for (:class:`~localdiff.serve.names.ModelNames`; default: the installed ones and the worker's default
    model); any other name in a request is one 404."""
    settings = settings or ServerSettings()
    names = names or ModelNames(default=worker.default_model)

    def endpoint(fn, public: bool = False):
        async def handler(request: Request):
            try:
                if not public:
                    _check_key(request, settings)
                return await fn(request)
            except ApiError as err:
                return _error_response(request, err)
            except Exception as exc:  # noqa: BLE001 — one log line and a JSON 500, never a traceback
                log.error("internal error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
                return _error_response(
                    request, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
                )

        return handler

    async def health(request: Request):
        raise_unavailable(worker)
        model = worker.model
        return SafeJSONResponse(
            {
                "status": "ok",
                "model": None if model is None else model.name,
                "queued": worker.queued,
                "busy": worker.current is not None,
            }
        )

    async def root(request: Request):
        return PlainTextResponse("localdiff is running")

    def _names() -> list[str]:  # the resident model first, then the offered ones (no DFlash draft)
        out = [] if worker.model is None else [worker.model.name]
        return out + [n for n in names.names() if n not in out]

    async def v1_models(request: Request):
        return SafeJSONResponse(openai_api.models_list(await asyncio.to_thread(_names)))

    async def api_tags(request: Request):
        return SafeJSONResponse(ollama_api.tags(await asyncio.to_thread(names.rows)))

    async def served_in_front(request: Request):
        raise ApiError(500, "generation routes are served by GenerationRoutes", type="server_error")

    async def api_ps(request: Request):
        return SafeJSONResponse(ollama_api.ps(worker.model, worker.expires_at(), worker.batch_info()))

    routes = [
        Route("/", endpoint(root, public=True), methods=["GET", "HEAD"]),
        Route("/health", endpoint(health, public=True), methods=["GET"]),
        Route("/v1/models", endpoint(v1_models), methods=["GET"]),
        Route("/api/tags", endpoint(api_tags), methods=["GET"]),
        Route("/api/ps", endpoint(api_ps), methods=["GET"]),
    ]
    # the generation paths are listed so that other methods on them get Starlette's 405 (a POST never gets here)
    routes += [Route(path, endpoint(served_in_front), methods=["POST"]) for path in GenerationRoutes.ROUTES]

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(
            request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
        )

    async def server_error(request: Request, exc: Exception):
        log.error("internal error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    rest = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    return GenerationRoutes(worker, settings, rest, names)
