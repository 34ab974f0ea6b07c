"""HTTP errors of ``localdiff serve``: one exception type and its JSON body.

Every error the server returns is JSON in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``);
Ollama clients read ``error`` too (Ollama sends ``{"error": "message"}``), so Ollama routes get that flat shape.
No error body ever carries a traceback.
"""

from __future__ import annotations

import json
import math
import re

from localdiff.errors import LocaldiffError, ModelNotFoundError, UsageError


class ApiError(Exception):
    """An HTTP error with a one-line message.

    Args:
        status: HTTP status (4xx for the client's mistakes, 503 when busy or loading, 500 for our bugs).
        message: one line for the client.
        type: OpenAI error type ("invalid_request_error", "authentication_error", "not_found_error", ...).
        param: the request field at fault, or None.
        code: a short machine-readable code ("context_length_exceeded", "queue_full", ...), or None.
        headers: extra response headers (Retry-After on 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            " ".join(message.split()),
            type,
            param,
            code,
        )
        self.headers = dict(headers or {})

    def openai_body(self) -> dict:
        """``{"error": {...}}`` as the OpenAI API sends it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self, ollama: bool) -> dict:
        """:meth:`ollama_body` for Ollama's routes, else :meth:`openai_body`."""
        return self.ollama_body() if ollama else self.openai_body()

    def ollama_body(self) -> dict:
        """``{"error": "message"}`` as Ollama sends it."""
        return {"error": self.message}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def json_repr(value, limit: int = 60) -> str:
    """``value`` as the client wrote it, for an error message: its JSON text (``true``, ``null``, ``"hot"``, not
    Python's ``True`` / ``None`` / ``'hot'``; control characters escaped), cut to ``limit`` characters with "…"."""
    if isinstance(value, float) and math.isinf(value):
        return "a number too large"  # a literal such as 1e400, which Python reads as infinity
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shutting_down() -> ApiError:
    """The 503 of an answer the server's shutdown (Ctrl-C) stopped."""
    return ApiError(503, "the server is shutting down", type="server_busy", code="shutting_down")


_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*): ")


def from_engine(exc: BaseException, shown: dict | None = None) -> ApiError:
    """Map an exception raised by the engine while preparing or running a generation to an ApiError.

    UsageError (bad option, empty prompt, prompt over the context) → 400; ModelNotFoundError → 404; any other
    LocaldiffError (checkpoint, tokenizer) → 422 with its message; anything else → 500 with the exception's type
    only (the server log gets one line, never a traceback in the body). ``shown``: decoder option name → how the
    client named it (``options.top_k``, ``localdiff.steps``): an option's error then names it as sent, message
    and ``param`` both (``GenRequest.shown``).
    """
    if isinstance(exc, ApiError):
        return exc
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, msg, type="not_found_error", param="model", code="model_not_found")
    if isinstance(exc, UsageError):
        code = "context_length_exceeded" if "context" in msg else None
        field = _NAMED.match(msg)  # an option's error names it first ("temperature: ..."): the param
        param = field.group(1) if field else None
        if param is not None and shown and param in shown:  # as the client named it
            param, msg = shown[param], shown[param] + msg[field.end(1) :]
        return ApiError(400, msg, param=param, code=code)
    if isinstance(exc, LocaldiffError):
        return ApiError(422, msg, type="unprocessable_error")
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")


def cancelled_error(job, what: str) -> ApiError:
    """The error a cancelled job ends with: 503 when the server is shutting down (``job.stopping``), else 499
    (client gone / stop string)."""
    if job.stopping:
        return shutting_down()
    return ApiError(499, what, code="cancelled")
