"""One socket write per event-loop callback for ``localdiff serve``'s HTTP connections.

uvicorn writes a streamed response's head, each body chunk and (with h11) the chunked terminator with separate
``transport.write`` calls, and asyncio's and uvloop's transports send each at once: a short streamed answer took
2 (uvloop + httptools) or 3 (asyncio + h11) ``send`` system calls, and on loopback the client is woken for each
(``strace -f`` on ``localdiff bench --only serve``). :class:`CorkedTransport` holds the writes made while one
callback of the loop runs (one step of the response's task) and hands them to the transport as one write from a
callback queued behind it (``loop.call_soon``): the same bytes in the same order, one ``send``, no added wait (the
loop runs that callback before it next polls the sockets). Everything else goes to the real transport; ``close``
and ``write_eof`` send what is held first.

:func:`protocol_class` is the uvicorn HTTP protocol (h11 or httptools, chosen as uvicorn's ``"auto"`` chooses) with
this transport, as :func:`localdiff.serve.uvicorn_config` passes it to uvicorn; its ``connection_lost`` and
``shutdown`` also call the hooks that :func:`on_disconnect` set (a client gone mid-answer cancels its job without a
watcher task; a server shutting down ends the running answers at their next step, with an error as the stream's
last part).
"""

from __future__ import annotations

import asyncio


class CorkedTransport:
    """An ``asyncio.Transport`` stand-in: ``write`` calls made within one loop callback go out as one write.

    Args:
        transport: the connection's transport (asyncio's or uvloop's).
        loop: the event loop it runs on.
    """

    __slots__ = ("_transport", "_loop", "_held", "on_lost", "on_shutdown")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._held = transport, loop, []
        self.on_lost = None  # called (no arguments, on the loop) when the connection is lost,
        self.on_shutdown = None  # and when the server shuts down mid-response: :func:`on_disconnect`

    def write(self, data) -> None:
        """Hold ``data`` (bytes-like) until the current callback ends."""
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, lines) -> None:
        """``write`` each of ``lines``."""
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the transport as one write (dropped once the transport is closing, as asyncio's
        own transports drop writes after ``close``)."""
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        """Send what is held, then close (the transport sends its own buffer before closing)."""
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Send what is held, then half-close."""
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        """Bytes held here and in the transport's buffer."""
        return sum(len(d) for d in self._held) + self._transport.get_write_buffer_size()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def flush_now(send) -> None:
    """Send what the connection of ``send`` (uvicorn's ``send`` callable, a method of its request-response cycle)
    holds now, instead of at the end of the loop callback: for the last write of a response, so that the client
    need not wait for the handler's clean-up. Nothing happens when ``send`` writes through no
    :class:`CorkedTransport` (another server, a test's fake)."""
    transport = _corked(send)
    if transport is not None:
        transport.flush()


def _corked(send) -> CorkedTransport | None:
    """The CorkedTransport that uvicorn's ``send`` (a method of its request-response cycle) writes through, or None."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    return transport if isinstance(transport, CorkedTransport) else None


def on_disconnect(send, hook, shutdown=None) -> bool:
    """Have ``hook()`` called on the loop when the client of ``send``'s connection goes away, and ``shutdown()``
    when the server starts shutting down while this response runs (uvicorn's graceful shutdown, e.g. Ctrl-C), instead
    of a task waiting on ``receive()`` for ``http.disconnect`` (a task per request, its first step and its
    cancellation: ~8 % of the event loop's busy time per short answer, ``py-spy``). ``hook`` None clears both. Called
    at once when the connection is already gone. Returns False when ``send`` writes through no
    :class:`CorkedTransport` (another server, a test's fake): the caller then watches ``receive()`` itself."""
    transport = _corked(send)
    if transport is None:
        return False
    transport.on_lost, transport.on_shutdown = hook, shutdown if hook is not None else None
    if hook is not None and (getattr(send.__self__, "disconnected", False) or transport.is_closing()):
        transport.on_lost = transport.on_shutdown = None
        hook()
    return True


def protocol_class(http: str = "auto") -> type:
    """uvicorn's HTTP protocol class for ``http`` ("auto": httptools when installed, else h11 — uvicorn's own
    choice; "h11"; "httptools") with its connections' writes going through :class:`CorkedTransport`.

    Raises:
        ValueError: another name; ImportError: the chosen parser is not installed.
    """
    if http == "auto":
        from importlib.util import find_spec

        http = "httptools" if find_spec("httptools") else "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"unknown HTTP implementation {http!r} (auto, h11 or httptools)")
    if base not in _CORKED:

        class Corked(base):
            __doc__ = f"uvicorn's {base.__name__}; its connections write through :class:`CorkedTransport`."

            def connection_made(self, transport) -> None:
                super().connection_made(CorkedTransport(transport, self.loop))

            def connection_lost(self, exc) -> None:
                hook, self.transport.on_lost, self.transport.on_shutdown = self.transport.on_lost, None, None
                super().connection_lost(exc)
                if hook is not None:
                    hook()

            def shutdown(self) -> None:
                hook, self.transport.on_shutdown = self.transport.on_shutdown, None
                super().shutdown()
                if hook is not None:
                    hook()

            def send_400_response(self, msg: str) -> None:
                self.transport.write(
                    bad_request_bytes(
                        msg, self.server_state.default_headers, getattr(self, "url", b"").startswith(b"/api/")
                    )
                )
                self.transport.close()

        Corked.__name__ = Corked.__qualname__ = f"Corked{base.__name__}"
        _CORKED[base] = Corked
    return _CORKED[base]


def bad_request_bytes(msg: str, default_headers=(), ollama: bool = False) -> bytes:
    """A whole HTTP/1.1 400 response with a JSON error body (Ollama's ``{"error": msg}`` or OpenAI's ``{"error":
    {...}}``) and ``connection: close``: what the server sends for a request its HTTP parser refused (a bad
    ``Content-Length``, a control character in a header), where uvicorn would send ``text/plain``."""
    import json

    from localdiff.serve.errors import ApiError

    body = json.dumps(ApiError(400, msg).body(ollama), separators=(",", ":")).encode()
    head = [
        b"HTTP/1.1 400 Bad Request\r\n",
        *(k + b": " + v + b"\r\n" for k, v in default_headers),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


_CORKED: dict = {}  # uvicorn protocol class → its corked subclass (made once)
