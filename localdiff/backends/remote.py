"""A small client for OpenAI-compatible servers (``localdiff serve``, vLLM, SGLang, ...), over httpx.

:class:`RemoteClient` streams ``/v1/chat/completions`` (or ``/v1/completions`` for raw prompts) as Server-Sent
Events and yields text pieces; :class:`RemoteModel` wraps it in the part of the ``Model`` interface the chat uses
(``stream`` yielding ``CanvasDone`` pieces and a final ``Done``), so ``localdiff chat --endpoint`` works unchanged.
Closing a stream early closes the HTTP response; ``localdiff serve`` then stops that generation within one step.
"""
from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

from localdiff.errors import LocaldiffError, UsageError
from localdiff.events import CanvasDone, Done, GenerationStats


class RemoteError(LocaldiffError):
    """The endpoint could not be reached or refused the request (one line, the server's own message)."""


def base_url(url: str) -> str:
    """Normalise an endpoint: ``http://host:port`` → ``http://host:port/v1``; a URL with a path is kept as is
    (without the trailing slash). Raises UsageError for a non-http(s) URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--endpoint must be an http(s) URL such as http://127.0.0.1:11436/v1 (got {url!r})")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


def request_fields(max_new_tokens=None, seed=None, sampler: dict | None = None) -> dict:
    """localdiff's generation settings → OpenAI request fields.

    ``max_new_tokens`` → ``max_tokens``; a constant temperature (``t_max == t_min``) → ``temperature``; every other
    sampler option goes under the ``localdiff`` extension key (only localdiff servers read it, so it is sent only
    when such options are set).
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
    if ext:
        out["localdiff"] = ext
    return out


class RemoteClient:
    """OpenAI-compatible HTTP client.

    Args:
        url: endpoint, e.g. ``http://127.0.0.1:11436/v1`` (``/v1`` is added when the URL has no path).
        api_key: sent as ``Authorization: Bearer``; None = no header.
        timeout: seconds to wait for the connection and between streamed bytes.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self._httpx = httpx

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _fail(self, exc) -> RemoteError:
        return RemoteError(f"cannot reach {self.url}: {exc}")

    def _check(self, response) -> None:
        if response.status_code < 400:
            return
        try:
            response.read()
            body = response.json()
            err = body.get("error", body)
            msg = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            msg = response.text[:200]
        if response.status_code == 401:
            raise RemoteError(f"{self.url} refused the API key: {msg}")
        raise RemoteError(f"{self.url} answered {response.status_code}: {msg}")

    def models(self) -> list[str]:
        """Model ids from ``GET /models``."""
        try:
            r = self._http.get("/models")
        except self._httpx.HTTPError as e:
            raise self._fail(e) from None
        self._check(r)
        return [str(m.get("id")) for m in r.json().get("data", [])]

    def stream(self, prompt, model: str, chat: bool = True, fields: dict | None = None):
        """Stream one answer: yields ``("text", str)`` pieces, then ``("end", info)`` where info has
        ``finish_reason``, ``usage`` and ``localdiff`` (when the server sent them).

        Args:
            prompt: chat messages (chat=True) or a string (raw, ``/completions``).
            fields: extra request fields (see :func:`request_fields`).
        Raises:
            RemoteError: unreachable, refused, or an error sent mid-stream.
        """
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **(fields or {})}
        body["messages" if chat else "prompt"] = prompt
        path = "/chat/completions" if chat else "/completions"
        info: dict = {"finish_reason": None, "usage": None, "localdiff": None}
        try:
            with self._http.stream("POST", path, json=body) as r:
                self._check(r)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        raise RemoteError(f"{self.url} sent a malformed event: {data[:80]}") from None
                    if "error" in chunk:
                        err = chunk["error"]
                        raise RemoteError(f"{self.url}: {err.get('message') if isinstance(err, dict) else err}")
                    for ch in chunk.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if text:
                            yield ("text", text)
                        if ch.get("finish_reason"):
                            info["finish_reason"] = ch["finish_reason"]
                    if chunk.get("usage"):
                        info["usage"] = chunk["usage"]
                    if chunk.get("localdiff"):
                        info["localdiff"] = chunk["localdiff"]
        except self._httpx.HTTPError as e:
            raise self._fail(e) from None
        yield ("end", info)


class RemoteModel:
    """The slice of :class:`localdiff.engine.Model` that the chat uses, backed by a :class:`RemoteClient`.

    ``stream`` yields one ``CanvasDone`` per text piece the server sends (``token_ids`` None: there is no canvas
    to draw) and a final ``Done`` whose stats carry the server's usage. No KV cache lives here (``new_cache`` →
    None); sampler options are checked by the server.
    """

    tokenizer = None
    quant = "remote"

    def __init__(self, client: RemoteClient, name: str | None = None) -> None:
        self.client = client
        if not name:
            names = client.models()
            if not names:
                raise RemoteError(f"{client.url} lists no models")
            name = names[0]
        self.name, self.device, self.dtype = name, urlsplit(client.url).netloc, None

    def new_cache(self, device_budget_bytes=None):
        """No local cache for a remote model."""
        return None

    def sampler_options(self, **overrides) -> dict:
        """The options set here (the server fills in and checks the rest)."""
        return {k: v for k, v in overrides.items() if v is not None}

    def stream(self, prompt, max_new_tokens=None, seed=None, chat=True, system=None, cache=None, **sampler):
        """Yield CanvasDone per streamed piece, then Done (finish_reason "eos" | "length"). Raises RemoteError."""
        sampler.pop("emit_steps", None)
        if chat:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            prompt = ([{"role": "system", "content": system}] if system else []) + msgs
        t0 = time.perf_counter()
        parts, i = [], 0
        for kind, value in self.client.stream(prompt, self.name, chat, request_fields(max_new_tokens, seed, sampler)):
            if kind == "text":
                parts.append(value)
                yield CanvasDone(i, None, value, 0, None)
                i += 1
            else:
                usage = value.get("usage") or {}
                ext = value.get("localdiff") or {}
                secs = time.perf_counter() - t0
                n = int(usage.get("completion_tokens") or 0)
                stats = GenerationStats(forwards=int(ext.get("forwards") or 0), new_tokens=n,
                                        tokens_per_forward=float(ext.get("tokens_per_forward") or 0.0), seconds=secs,
                                        prompt_tokens=int(usage.get("prompt_tokens") or 0), canvases=i,
                                        tokens_per_second=n / secs if secs > 0 else 0.0)
                reason = "length" if value.get("finish_reason") == "length" else "eos"
                yield Done("".join(parts), [], stats, reason)
