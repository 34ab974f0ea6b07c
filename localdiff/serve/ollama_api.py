"""Ollama-shaped endpoints: ``/api/chat``, ``/api/generate`` (NDJSON streaming by default), ``/api/tags``,
``/api/ps`` (field names as in Ollama's API docs, docs/api.md).

``options`` honoured: ``num_predict`` (> 0; -1 / -2 = the model's default), ``temperature`` (≥ 0; 0 where the
decoder has it), ``seed``, ``stop``, and localdiff's sampler options by name. Any other option is a 400 naming it.
``keep_alive`` is checked (a duration or a number of seconds, :func:`check_keep_alive`) and not applied per
request (the server's ``--keep-alive`` decides when the model unloads). A top-level ``localdiff: {"events":
"canvases" | "steps"}`` adds localdiff's canvas events to the stream (``localdiff.wire``).
"""

from __future__ import annotations

import math
import os
import re
from datetime import datetime, timezone

from localdiff.decoding.options import resolve_key
from localdiff.serve.errors import bad_request, json_repr
from localdiff.serve.jobs import Result
from localdiff.serve.openai_api import parse_messages
from localdiff.serve.options import GenRequest, check_bool, check_str, option_specs, split_extension, to_engine_options

_TOP = {"model", "stream", "options", "keep_alive", "format", "localdiff"}


def _now(t: float | None = None) -> str:
    """``t`` (``time.time()`` seconds; None = now) in Ollama's time format (UTC, ISO 8601, "Z")."""
    when = datetime.now(timezone.utc) if t is None else datetime.fromtimestamp(t, timezone.utc)
    return when.isoformat().replace("+00:00", "Z")


_NUM, _UNIT = r"(?:\d+(?:\.\d*)?|\.\d+)", r"(?:ns|us|µs|ms|s|m|h)"
_DURATION = re.compile(rf"-?{_NUM}{_UNIT}?(?:{_NUM}{_UNIT})*")  # Go's time.ParseDuration, or bare seconds


_NAMES = {
    "max_tokens": "options.num_predict",
    "seed": "options.seed",
    "temperature": "options.temperature",
    "stop": "options.stop",
    "sampler": "options",
}  # how Ollama's request names the neutral fields


def check_keep_alive(value) -> None:
    """Ollama's ``keep_alive``: null, a number of seconds or a Go duration string ("5m", "1h30m", "-1"); else a
    400. Checked, not applied: the server's ``--keep-alive`` decides when the resident model unloads."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        return
    if isinstance(value, str) and (not value.strip() or _DURATION.fullmatch(value.strip())):
        return
    raise bad_request(
        f"'keep_alive' must be a duration such as \"5m\" or a number of seconds (got {json_repr(value, 40)})",
        param="keep_alive",
    )


def _parse(body: dict, allowed: set, prompt, chat: bool) -> GenRequest:
    for key in body:
        if key not in allowed:
            raise bad_request(f"unknown or unsupported field '{key}'", param=key)
    model = check_str(body.get("model", ""), "model")
    check_keep_alive(body.get("keep_alive"))
    stream = True if body.get("stream") is None else check_bool(body["stream"], "stream")
    if body.get("format") not in (None, ""):
        raise bad_request("'format' (structured output) is not supported", param="format")
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'options' must be an object", param="options")
    sampler, known = {}, option_specs()
    for key in opts:
        if resolve_key(str(key)) in known:
            sampler[key] = opts[key]
        elif key not in ("num_predict", "temperature", "seed", "stop"):
            raise bad_request(f"unsupported option 'options.{key}'", param=f"options.{key}")
    n = opts.get("num_predict")
    if n in (-1, -2):
        n = None
    fields = {
        "max_tokens": n,
        "temperature": opts.get("temperature"),
        "seed": opts.get("seed"),
        "stop": opts.get("stop"),
        "sampler": sampler,
        "names": _NAMES,
    }
    eo = to_engine_options(fields)
    rest, events = split_extension(body.get("localdiff"))
    if rest:
        raise bad_request("'localdiff' takes 'events' only here; decoder options go under 'options'", param="localdiff")
    if events != "none" and not stream:
        raise bad_request(
            "'localdiff.events' needs \"stream\": true (canvas events ride on a stream)", param="localdiff.events"
        )
    return GenRequest(
        model=model,
        prompt=prompt,
        chat=chat,
        max_new_tokens=eo["max_new_tokens"],
        seed=eo["seed"],
        sampler=eo["sampler"],
        shown=eo["shown"],
        stop=eo["stop"],
        stream=stream,
        events=events,
    )


def parse_chat(body: dict) -> GenRequest:
    """Body of ``POST /api/chat`` → GenRequest; no messages (absent or ``[]``) is Ollama's load request
    (``load_only``). Raises ApiError(400)."""
    if body.get("messages") in (None, []):
        return _load_only(_parse(body, _TOP | {"messages"}, [], chat=True))
    return _parse(body, _TOP | {"messages"}, parse_messages(body.get("messages")), chat=True)


def parse_generate(body: dict) -> GenRequest:
    """Body of ``POST /api/generate`` → GenRequest: ``prompt`` with the chat template (optional ``system``), or
    as is with ``raw: true``; an empty or absent prompt is Ollama's load request (``load_only``: the model is
    loaded, nothing generated). Raises ApiError(400)."""
    prompt = body.get("prompt")
    prompt = "" if prompt is None else check_str(prompt, "prompt")
    raw = check_bool(body.get("raw", False), "raw")
    system = body.get("system")
    if system is not None:
        check_str(system, "system")
    if raw:
        if system:
            raise bad_request("'system' cannot be combined with 'raw': true", param="system")
        req = _parse(body, _TOP | {"prompt", "raw", "system"}, prompt, chat=False)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        req = _parse(body, _TOP | {"prompt", "raw", "system"}, msgs, chat=True)
    return _load_only(req) if prompt == "" else req


def _load_only(req: GenRequest) -> GenRequest:
    """As Ollama: a request with nothing to answer loads the model and ends ``done_reason: "load"`` (one JSON
    object, streamed or not)."""
    req.load_only = True
    return req


def loaded(model: str, chat: bool) -> dict:
    """The answer to a load request: ``done: true``, ``done_reason: "load"``, empty content."""
    body = Shape(model, chat).piece("")
    body.update(done=True, done_reason="load")
    return body


class Shape:
    """NDJSON lines of one Ollama request."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat

    def piece(self, text: str) -> dict:
        """A streamed piece of the answer."""
        body = {"model": self.model, "created_at": _now(), "done": False}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["response"] = text
        return body

    def event(self, payload: dict) -> dict:
        """A line carrying one of localdiff's canvas events (``localdiff.wire``) under ``localdiff``, with empty
        content (``done: false``)."""
        body = self.piece("")
        body["localdiff"] = payload
        return body

    def final(self, r: Result, streamed: bool) -> dict:
        """The last line (``done: true``) with counts and durations in nanoseconds; the whole answer when not
        streamed; with a DFlash draft, localdiff's numbers (τ included) under ``localdiff``."""
        body = self.piece("" if streamed else r.text)
        s = r.stats
        secs = float(s.get("seconds") or 0.0)
        pre, load = float(s.get("prefill_seconds") or 0.0), float(s.get("load_seconds") or 0.0)
        body.update(
            done=True,
            done_reason=r.finish_reason,
            total_duration=int((secs + load) * 1e9),
            load_duration=int(load * 1e9),
            prompt_eval_count=r.prompt_tokens,
            prompt_eval_duration=int(pre * 1e9),
            eval_count=r.completion_tokens,
            eval_duration=int(max(secs - pre, 0.0) * 1e9),
        )
        if s.get("acceptance_lengths"):  # a DFlash draft ran: its τ, as the OpenAI routes' extension has it
            body["localdiff"] = r.extension()
        return body


def tags(models: list[dict]) -> dict:
    """``GET /api/tags`` body from ``installed_models()`` rows."""
    out = []
    for m in models:
        name = str(m.get("name") or m.get("alias") or m.get("repo") or "")
        if not name:
            continue
        out.append(
            {
                "name": name,
                "model": name,
                "modified_at": _mtime(m.get("path")),
                "size": int(m.get("size_bytes") or 0),
                "digest": str(m.get("revision") or ""),
                "details": {"family": str(m.get("model_type") or ""), "format": "safetensors"},
            }
        )
    return {"models": out}


def _mtime(path) -> str:
    """A model folder's modification time (UTC, Ollama's format); now when it cannot be read."""
    try:
        return _now(os.stat(path).st_mtime)
    except (OSError, TypeError, ValueError):
        return _now()


def _resident_bytes(model) -> int:
    """Bytes of a loaded model's tensors (parameters and buffers: int8 weights and their scales too); 0 for a
    backend without a torch module (GGUF)."""
    net = getattr(model, "net", None)
    if net is None or not hasattr(net, "parameters"):
        return 0
    return sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))


def ps(model, expires: float | None = None, batch: dict | None = None) -> dict:
    """``GET /api/ps`` body: the resident model, if any: its tensors' bytes (``size``; ``size_vram`` the same on a
    GPU, else 0) and ``expires_at`` (``expires``: a ``time.time()`` when an idle model unloads, None = never: "");
    ``batch`` (``ModelWorker.batch_info``): the running batch, under the entry's ``localdiff`` key."""
    if model is None:
        return {"models": []}
    size = _resident_bytes(model)
    on_gpu = str(getattr(model, "device", "cpu")).startswith("cuda")
    return {
        "models": [
            {
                "name": model.name,
                "model": model.name,
                "size": size,
                "digest": "",
                "details": {"format": "safetensors"},
                "expires_at": "" if expires is None else _now(expires),
                "size_vram": size if on_gpu else 0,
                **({"localdiff": {"batch": batch}} if batch is not None else {}),
            }
        ]
    }
