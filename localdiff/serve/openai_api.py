"""OpenAI-shaped endpoints: request parsing and response bodies for ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models`` (field names and chunk shapes as in OpenAI's API reference).

Supported request fields: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (or ``max_completion_tokens``),
``temperature`` (≥ 0, constant over the denoising steps), ``seed``, ``stop``, ``stream``, ``stream_options``,
``n`` (1 only), ``user`` (ignored), and ``localdiff`` (an object of localdiff sampler options, plus ``events``:
"canvases" / "steps" for localdiff's canvas events in a stream, ``localdiff.wire``). Fields that would
change the answer in ways localdiff cannot honour (``top_p`` ≠ 1, penalties, ``logprobs``, ``tools``, ...) are a
400 naming the field, never silently ignored.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import uuid

from localdiff.safetext import json_escape
from localdiff.serve.errors import bad_request, json_repr
from localdiff.serve.jobs import Result
from localdiff.serve.options import GenRequest, check_bool, check_str, split_extension, to_engine_options

ROLES = ("system", "user", "assistant")
_COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "localdiff",
}
# accepted when they ask for the default behaviour only
_NEUTRAL = {
    "top_p": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "echo": False,
    "parallel_tool_calls": None,
    "tool_choice": "none",
    "response_format": {"type": "text"},
}


_MARK = "\x00text\x00"  # stands for the text in a chunk template (no model text is this exact JSON string)
_ID, _CREATED, _REASON = "\x00id\x00", "\x00created\x00", "\x00reason\x00"  # and the other per-request values
_RUN = uuid.uuid4().hex[:12]  # response ids: a random prefix per server process + a per-response counter
_SEQ = itertools.count()


def dumps(obj) -> str:
    """Compact JSON text (UTF-8 kept as is, no spaces after separators): what the server sends (one encoder made
    once: ``json.dumps`` with these arguments builds a new one per call). DEL, C1 and bidi controls are escaped
    (``\\u009b``; JSON escapes C0 itself): the same JSON value, but a client that prints the body raw (curl in a
    terminal) shows no control sequence from a model's text or a client's echoed input
    (:func:`localdiff.safetext.json_escape`)."""
    return json_escape(_encode(obj))


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


_QMARK, _QID, _QCREATED, _QREASON = (dumps(m) for m in (_MARK, _ID, _CREATED, _REASON))  # as they appear in JSON


def _check_fields(body: dict, allowed: set) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _NEUTRAL and (value is None or value == _NEUTRAL[key]):
            continue
        if key in _NEUTRAL:
            raise bad_request(f"'{key}' = {json.dumps(value)} is not supported by localdiff", param=key)
        raise bad_request(f"unknown or unsupported field '{key}'", param=key)


def _common(body: dict, prompt, chat: bool) -> GenRequest:
    model = body.get("model", "")
    check_str(model, "model")
    if body.get("n") is not None and body["n"] != 1:
        raise bad_request("'n' must be 1: localdiff generates one choice per request", param="n")
    stream = check_bool(body.get("stream", False) if body.get("stream") is not None else False, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise bad_request("'stream_options' must be an object with 'include_usage' only", param="stream_options")
        include_usage = check_bool(so.get("include_usage", False), "stream_options.include_usage")
        if not stream:  # as OpenAI: 400 (it shapes a stream's chunks; without a stream it was silently dropped)
            raise bad_request("'stream_options' is only allowed with \"stream\": true", param="stream_options")
    if body.get("user") is not None:
        check_str(body["user"], "user")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_name != "max_tokens" and body.get("max_tokens") not in (None, body[max_name]):
        raise bad_request("'max_tokens' and 'max_completion_tokens' differ: send one", param="max_completion_tokens")
    sampler, events = split_extension(body.get("localdiff"))
    if events != "none" and not stream:
        raise bad_request(
            "'localdiff.events' needs \"stream\": true (canvas events ride on a stream)", param="localdiff.events"
        )
    opts = to_engine_options(
        {
            "max_tokens": body.get(max_name),
            "names": {"max_tokens": max_name},
            "temperature": body.get("temperature"),
            "seed": body.get("seed"),
            "stop": body.get("stop"),
            "sampler": sampler,
        }
    )
    return GenRequest(
        model=model,
        prompt=prompt,
        chat=chat,
        max_new_tokens=opts["max_new_tokens"],
        seed=opts["seed"],
        sampler=opts["sampler"],
        shown=opts["shown"],
        stop=opts["stop"],
        stream=stream,
        include_usage=include_usage,
        events=events,
    )


def parse_messages(messages, param: str = "messages") -> list[dict]:
    """Chat messages → [{"role", "content": str}]; content may be a string or a list of text parts.

    Raises ApiError(400): missing / empty list, unknown role, non-text content, a field other than role and content
    (Ollama's ``images``, ``name``, ``tool_calls``: never dropped silently), a last message that is not the user's
    (or a tool result).
    """
    if messages is None:
        raise bad_request(f"'{param}' is required", param=param)
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"'{param}' must be a non-empty list of messages", param=param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", param=where)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            what = (
                "images are not supported"
                if "images" in extra
                else "fields other than 'role' and 'content' are not supported"
            )
            raise bad_request(f"'{where}.{extra[0]}': {what}", param=f"{where}.{extra[0]}")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)} (got {json_repr(role)})", param=where)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad_request(
                        f"'{where}.content' parts must be text parts (images are not supported)", param=where
                    )
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string", param=where)
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise bad_request(f"'{param}' hold no text (every content is empty)", param=param)
    if out[-1]["role"] != "user":
        raise bad_request(f"the last message must be the user's (got {json_repr(out[-1]['role'])})", param=param)
    return out


def parse_chat(body: dict) -> GenRequest:
    """Body of ``POST /v1/chat/completions`` → GenRequest (chat template on). Raises ApiError(400)."""
    _check_fields(body, _COMMON | {"messages"})
    return _common(body, parse_messages(body.get("messages")), chat=True)


def parse_completion(body: dict) -> GenRequest:
    """Body of ``POST /v1/completions`` → GenRequest (raw text, no chat template). Raises ApiError(400)."""
    _check_fields(body, _COMMON | {"prompt", "suffix"})
    if body.get("suffix") not in (None, ""):
        raise bad_request("'suffix' (infilling) is not supported", param="suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or a list of one string)", param="prompt")
    return _common(body, prompt, chat=False)


@functools.lru_cache(maxsize=16)
def _templates(model: str, chat: bool) -> tuple[str, ...]:
    """The SSE lines of a text chunk, the role chunk, a finish chunk and a canvas-event chunk of ``model`` as JSON
    text with marks for the text / event, id, creation time and finish reason (made once per model and shape; each
    response fills them in)."""
    shape = Shape.__new__(Shape)
    shape.model, shape.chat, shape.id, shape.created = model, chat, _ID, _CREATED
    return tuple(
        "data: " + dumps(c) + "\n\n"
        for c in (shape.chunk(_MARK), shape.chunk(first=True), shape.chunk(finish_reason=_REASON), shape.event(_MARK))
    )


class Shape:
    """Response bodies of one request (one id and creation time for all its chunks).

    Streamed lines come from per-model templates (:func:`_templates`) with this response's id and time filled in:
    per chunk only the text (or finish reason) is encoded; they equal ``"data: " + dumps(self.chunk(...))``.
    """

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + _RUN + f"{next(_SEQ):012x}"
        self.created = int(time.time())
        qid, created = dumps(self.id), str(self.created)
        text, role, finish, event = (t.replace(_QID, qid).replace(_QCREATED, created) for t in _templates(model, chat))
        self._text, self._role, self._finish = text.split(_QMARK), role, finish.split(_QREASON)
        self._event = event.split(_QMARK)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(r: Result) -> dict:
        """OpenAI ``usage`` from a Result (``prompt_tokens_details.cached_tokens``: the prompt's tokens served from
        the conversation cache kept across requests)."""
        return {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        }

    def full(self, r: Result) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": None,
                "finish_reason": r.finish_reason,
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=self.usage(r), localdiff=r.extension())
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed chunk: the role (first), a text delta, or the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        return body

    def text_line(self, text: str) -> str:
        """The SSE line of a text chunk (``data: {...}`` and the blank line): ``dumps(self.chunk(text))`` from the
        template, so only the text is encoded per chunk."""
        return self._text[0] + dumps(text) + self._text[1]

    def role_line(self) -> str:
        """The SSE line of the first chunk of a chat stream (``self.chunk(first=True)``)."""
        return self._role

    def finish_line(self, reason: str) -> str:
        """The SSE line of the chunk with the finish reason (``self.chunk(finish_reason=reason)``)."""
        return self._finish[0] + dumps(reason) + self._finish[1]

    def event_line(self, payload: dict) -> str:
        """The SSE line of a canvas-event chunk (``dumps(self.event(payload))``): only the payload is encoded."""
        return self._event[0] + dumps(payload) + self._event[1]

    def event(self, payload: dict) -> dict:
        """A chunk carrying one of localdiff's canvas events (``localdiff.wire``) under the ``localdiff`` key, with
        an empty answer part (``delta: {}`` / ``text: ""``) that clients without the extension skip."""
        body = self.chunk(None) if self.chat else self.chunk("")
        body["localdiff"] = payload
        return body

    def usage_chunk(self, r: Result) -> dict:
        """The last chunk with ``stream_options.include_usage``: empty choices, usage and localdiff's numbers."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.usage(r), localdiff=r.extension())
        return body


def models_list(names: list[str]) -> dict:
    """``GET /v1/models`` body."""
    now = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "localdiff"} for n in names],
    }
