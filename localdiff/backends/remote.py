"""A small client for OpenAI-compatible servers (``localdiff serve``, vLLM, SGLang, ...), over httpx.

:class:`RemoteClient` streams ``/v1/chat/completions`` (or ``/v1/completions`` for raw prompts) as Server-Sent
Events and yields text pieces; :class:`RemoteModel` wraps it in the part of the ``Model`` interface the chat uses
(``stream`` yielding ``CanvasDone`` pieces and a final ``Done``), so ``localdiff chat --endpoint`` works unchanged.
Closing a stream early closes the HTTP response; ``localdiff serve`` then stops that generation within one step.

When the server is a ``localdiff serve`` (its ``/models`` entries are ``owned_by: "localdiff"``), ``RemoteModel``
asks for localdiff's canvas events (``{"localdiff": {"events": "steps"}}``, :mod:`localdiff.wire`) and yields them
as ``StepEvent`` / ``CanvasDone`` with tensors, so the chat draws the canvas as for a local model; other servers
get plain OpenAI requests and give text only.
"""

from __future__ import annotations

import json
import re
import time
from urllib.parse import urlsplit

from localdiff.errors import LocaldiffError, UsageError
from localdiff.events import CanvasDone, Done, GenerationStats
from localdiff.wire import PieceTable, canvas_done, step_event


#: seconds ``gen`` / ``chat --endpoint`` wait for the server's first byte and between streamed bytes (``--timeout``,
#: ``LOCALDIFF_TIMEOUT``): the OpenAI Python client's default read timeout; a ``localdiff serve`` answers only after
#: loading the model, the requests queued before and the first canvas.
DEFAULT_TIMEOUT_S = 600.0
#: seconds to open the TCP (and TLS) connection (capped by the timeout above)
CONNECT_TIMEOUT_S = 10.0


class RemoteError(LocaldiffError):
    """The endpoint could not be reached or refused the request (one line, the server's own message).

    ``status`` is the HTTP status the server answered with (None: no answer — unreachable or timed out). A 400 (the
    server refused the request's options or prompt, e.g. ``--steps 100001``) is a usage error, exit code 2, as the
    same options are with a local model; every other failure is exit code 1."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        if status == 400:
            self.exit_code = 2


def base_url(url: str) -> str:
    """Normalise an endpoint: ``http://host:port`` → ``http://host:port/v1``; a URL with a path is kept as is
    (without the trailing slash). Raises UsageError for a non-http(s) URL, one without a host, a bad port, or
    spaces / control characters."""
    bad = UsageError(f"--endpoint must be an http(s) URL such as http://127.0.0.1:11436/v1 (got {url!r})")
    if any(not c.isprintable() or c.isspace() for c in url.strip()):
        raise bad  # control characters, spaces: httpx refuses them mid-request
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 — raises ValueError for ":abc" or ":99999"
    except ValueError:  # "http://[::1" (an unclosed IPv6 bracket), a bad port
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


def request_fields(max_new_tokens=None, seed=None, sampler: dict | None = None) -> dict:
    """localdiff's generation settings → OpenAI request fields.

    ``max_new_tokens`` → ``max_tokens``; a constant temperature (``t_max == t_min``, or the masked / block / causal
    decoders' ``temperature``) → ``temperature``; every other sampler option goes under the ``localdiff`` extension
    key (only localdiff servers read it, so it is sent only when such options are set).
    """
    out: dict = {}
    if max_new_tokens is not None:
        out["max_tokens"] = int(max_new_tokens)
    if seed is not None:
        out["seed"] = int(seed)
    ext = {k: v for k, v in (sampler or {}).items() if v is not None}
    if "t_max" in ext and ext.get("t_min", ext["t_max"]) == ext["t_max"]:
        out["temperature"] = ext.pop("t_max")
        ext.pop("t_min", None)
    elif "temperature" in ext and "t_max" not in ext:
        out["temperature"] = ext.pop("temperature")
    if ext:
        out["localdiff"] = ext
    return out


class RemoteClient:
    """OpenAI-compatible HTTP client.

    Args:
        url: endpoint, e.g. ``http://127.0.0.1:11436/v1`` (``/v1`` is added when the URL has no path).
        api_key: sent as ``Authorization: Bearer``; None = no header.
        timeout: seconds to wait for the server's first byte and between streamed bytes (default
            :data:`DEFAULT_TIMEOUT_S`); the connection itself gets at most :data:`CONNECT_TIMEOUT_S`.
        on_wait: ``on_wait(seconds)`` is called once from a timer thread when a request has had no answer (no
            response headers) for ``wait_note_s`` seconds — ``gen`` writes a note on stderr; None = silent.
    """

    wait_note_s = 5.0

    def __init__(self, url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, on_wait=None) -> None:
        import httpx

        self.url = base_url(url)
        self.timeout, self.connect_timeout = float(timeout), min(CONNECT_TIMEOUT_S, float(timeout))
        self.on_wait = on_wait
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout)
        )
        self._httpx = httpx
        self.owners: dict[str, str] = {}  # model id → owned_by, from the last models() call

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _fail(self, exc, answered: bool | str = False) -> RemoteError:
        """An httpx error as one line naming the URL; timeouts say which wait ran out and how to lengthen it
        (``answered``: False, True (the response began) or "text" (some of the answer came))."""
        h = self._httpx
        if isinstance(exc, h.ConnectTimeout):
            return RemoteError(f"cannot reach {self.url}: no connection within {self.connect_timeout:g} s")
        if isinstance(exc, h.TimeoutException):
            what = (
                "did not answer within"
                if not answered
                else "stopped sending mid-answer: nothing for"
                if answered == "text"
                else "started an answer but sent no text within"
            )
            return RemoteError(
                f"{self.url} {what} {self.timeout:g} s (wait longer with --timeout SECONDS or LOCALDIFF_TIMEOUT)"
            )
        why = re.sub(r"\[Errno -?\d+\]\s*", "", str(exc)).strip() or type(exc).__name__  # no "[Errno 111]"
        return RemoteError(f"cannot reach {self.url}: {why[:1].lower()}{why[1:]}")

    def _waiting(self):
        """A started timer that calls ``on_wait`` once if the answer takes ``wait_note_s`` (None without on_wait)."""
        if self.on_wait is None:
            return None
        import threading

        timer = threading.Timer(self.wait_note_s, self.on_wait, (self.wait_note_s,))
        timer.daemon = True
        timer.start()
        return timer

    def _check(self, response) -> None:
        if response.status_code < 400:
            return
        try:
            response.read()
            body = response.json()
            err = body.get("error", body)
            msg = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):  # not a JSON error: a web server's page, a proxy's text
            text = response.text.strip()
            html = "html" in response.headers.get("content-type", "") or text.startswith("<")
            msg = response.reason_phrase if html or not text else text.splitlines()[0][:200]
            if response.status_code in (404, 405, 501):
                msg += " (is this an OpenAI-compatible API?)"
        if response.status_code == 401:
            raise RemoteError(f"{self.url} refused the API key: {msg}", 401)
        raise RemoteError(f"{self.url} answered {response.status_code}: {msg}", response.status_code)

    def models(self) -> list[str]:
        """Model ids from ``GET /models``."""
        timer = self._waiting()
        try:
            r = self._http.get("/models")
        except self._httpx.HTTPError as e:
            raise self._fail(e) from None
        finally:
            if timer is not None:
                timer.cancel()
        self._check(r)
        try:
            data = [m for m in r.json().get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            raise RemoteError(f"{self.url}/models did not answer with a model list") from None
        self.owners = {str(m.get("id")): str(m.get("owned_by") or "") for m in data}
        return [str(m.get("id")) for m in data]

    def stream(self, prompt, model: str, chat: bool = True, fields: dict | None = None):
        """Stream one answer: yields ``("text", str)`` pieces, ``("event", dict)`` for localdiff's canvas events
        (when asked for and sent, :mod:`localdiff.wire`), then ``("end", info)`` where info has ``finish_reason``,
        ``usage`` and ``localdiff`` (the server's generation numbers, when it sent them).

        Args:
            prompt: chat messages (chat=True) or a string (raw, ``/completions``).
            fields: extra request fields (see :func:`request_fields`).
        Raises:
            RemoteError: unreachable, refused, an error sent mid-stream, or a stream that ends without
                ``data: [DONE]`` (after the pieces it did send).
        """
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **(fields or {})}
        body["messages" if chat else "prompt"] = prompt
        path = "/chat/completions" if chat else "/completions"
        info: dict = {"finish_reason": None, "usage": None, "localdiff": None}
        timer, answered, events, done = self._waiting(), False, 0, False
        try:
            with self._http.stream("POST", path, json=body) as r:
                answered = True
                if timer is not None:
                    timer.cancel()
                self._check(r)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events += 1
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        out = _event_parts(json.loads(data), chat, info)
                    except (json.JSONDecodeError, AttributeError, TypeError):  # not JSON, or not a chunk's shape
                        raise RemoteError(f"{self.url} sent a malformed event: {data[:80]}") from None
                    if isinstance(out, str):
                        raise RemoteError(f"{self.url}: {out}")
                    yield from out
                if not events:  # a 200 that is no event stream (a web page): not an empty answer
                    raise RemoteError(
                        f"{self.url}{path} answered without server-sent events (content-type "
                        f"{r.headers.get('content-type') or 'none'}): not an OpenAI-compatible API?"
                    )
                if not done:  # a dropped connection, a killed server: the answer is cut short, not finished
                    raise RemoteError(
                        f"{self.url}: the server closed the stream before it finished (no [DONE]); "
                        "the text above is incomplete"
                    )
        except self._httpx.HTTPError as e:
            raise self._fail(e, "text" if answered and events else answered) from None
        finally:
            if timer is not None:
                timer.cancel()
        yield ("end", info)


class RemoteModel:
    """The slice of :class:`localdiff.engine.Model` that the chat uses, backed by a :class:`RemoteClient`.

    ``stream`` yields, against a ``localdiff serve``, the server's ``StepEvent`` / ``CanvasDone`` rebuilt from its
    canvas events (``tokenizer`` is then a :class:`localdiff.wire.PieceTable` of the pieces it sent,
    ``mask_token_id`` / ``eos_token_ids`` come from its ``begin`` event), plus one ``CanvasDone`` without ids per
    text piece; against another server only the text pieces. Then a final ``Done`` whose stats carry the server's
    usage. No KV cache lives here (``new_cache`` → None); sampler options are checked by the server.
    """

    quant = "remote"

    def __init__(self, client: RemoteClient, name: str | None = None) -> None:
        self.client = client
        try:
            names = client.models()
        except RemoteError as e:
            if not name or e.status not in (404, 405, 501):
                raise  # unreachable, timed out, a refused key: fail now, not at the first message
            names = []  # a server without /models: text only
        if not name:
            if not names:
                raise RemoteError(f"{client.url} lists no models")
            name = names[0]
        self.name, self.device, self.dtype = name, urlsplit(client.url).netloc, None
        self.canvas_events = client.owners.get(name) == "localdiff" or (
            name not in client.owners and "localdiff" in client.owners.values()
        )
        self.tokenizer = PieceTable() if self.canvas_events else None
        self.eos_token_ids: list[int] = []
        self.mask_token_id = None

    def new_cache(self, device_budget_bytes=None):
        """No local cache for a remote model."""
        return None

    def sampler_options(self, **overrides) -> dict:
        """The options set here (the server fills in and checks the rest)."""
        return {k: v for k, v in overrides.items() if v is not None}

    def _event(self, ev: dict):
        """A canvas event → StepEvent / CanvasDone (or None for ``begin``). Raises ValueError when malformed."""
        kind = ev.get("event")
        if kind == "begin":
            eos = ev.get("eos_token_ids") or []
            if not isinstance(eos, list) or not all(isinstance(e, int) for e in eos):
                raise ValueError("eos_token_ids must be a list of ints")
            self.eos_token_ids[:] = eos
            self.tokenizer.eos_token_ids[:] = eos
            mask = ev.get("mask_token_id")
            self.mask_token_id = mask if isinstance(mask, int) and not isinstance(mask, bool) else None
            return None
        if kind not in ("step", "canvas"):
            return None  # a newer server's event kind: skipped
        self.tokenizer.update(ev.get("pieces") or {})
        return step_event(ev) if kind == "step" else canvas_done(ev)

    def stream(self, prompt, max_new_tokens=None, seed=None, chat=True, system=None, cache=None, **sampler):
        """Yield the events described in the class docstring, then Done (finish_reason "eos" | "length").
        Raises RemoteError (also for a malformed canvas event)."""
        sampler.pop("emit_steps", None)
        if chat:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            prompt = ([{"role": "system", "content": system}] if system else []) + msgs
        fields = request_fields(max_new_tokens, seed, sampler)
        if self.canvas_events:
            fields["localdiff"] = {**fields.get("localdiff", {}), "events": "steps"}
        t0 = time.perf_counter()
        parts, i, canvas = [], 0, -1
        for kind, value in self.client.stream(prompt, self.name, chat, fields):
            if kind == "event":
                try:
                    ev = self._event(value)
                except (ValueError, TypeError, AttributeError) as e:
                    raise RemoteError(f"{self.client.url} sent a malformed canvas event: {e}") from None
                if isinstance(ev, CanvasDone):
                    canvas = ev.canvas_index
                if ev is not None:
                    yield ev
            elif kind == "text":
                parts.append(value)
                yield CanvasDone(canvas if canvas >= 0 else i, None, value, 0, None)
                i += 1
            else:
                usage = value.get("usage") or {}
                ext = value.get("localdiff") or {}
                secs = time.perf_counter() - t0
                n = int(usage.get("completion_tokens") or 0)
                stats = GenerationStats(
                    forwards=int(ext.get("forwards") or 0),
                    new_tokens=n,
                    tokens_per_forward=float(ext.get("tokens_per_forward") or 0.0),
                    seconds=secs,
                    prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    canvases=max(canvas + 1, i) if canvas >= 0 else i,
                    tokens_per_second=n / secs if secs > 0 else 0.0,
                )
                reason = "length" if value.get("finish_reason") == "length" else "eos"
                yield Done("".join(parts), [], stats, reason)


def _event_parts(chunk: dict, chat: bool, info: dict) -> list | str:
    """One streamed chunk (OpenAI ``chat.completion.chunk`` / ``text_completion``) → the ``("text", str)`` /
    ``("event", dict)`` items it carries, with its finish_reason / usage / localdiff fields noted in ``info``; or the
    server's error message (a str) for an ``{"error": ...}`` event. Raises AttributeError / TypeError on another
    shape (``{"choices": "x"}``)."""
    if "error" in chunk:
        err = chunk["error"]
        return str(err.get("message") if isinstance(err, dict) else err)
    out = []
    for ch in chunk.get("choices") or []:
        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        if text:
            out.append(("text", str(text)))
        if ch.get("finish_reason"):
            info["finish_reason"] = ch["finish_reason"]
    if chunk.get("usage"):
        info["usage"] = chunk["usage"]
    ext = chunk.get("localdiff")
    if isinstance(ext, dict) and "event" in ext:
        out.append(("event", ext))
    elif ext:
        info["localdiff"] = ext
    return out
