"""The serve bench's HTTP client (``localdiff bench --only serve``): a minimal HTTP/1.1 client on one kept-alive
socket, run as a separate process like any real client of ``localdiff serve`` (an editor, an agent).

Standard library only, so that the client process starts without torch: ``python serve_client.py PORT`` reads one
JSON request per stdin line (``{"path": "/v1/chat/completions", "body": "<JSON text>"}``) and answers each with one
JSON line ``{"first": s | null, "total": s, "n": completion tokens, "cpu_ms": this process's CPU ms, "t0": the start
(``time.perf_counter()``, the machine's monotonic clock, comparable with the server process's stamps)}``: seconds from
just before the request is written to the arrival of the first content delta and of the end of the stream: the
time the ``recv()`` that delivered those bytes returned. The client's own parse of them (JSON) comes after that stamp,
as the in-process side's consumer does nothing with its text either; it is counted in ``cpu_ms``.
The bench also imports :class:`Client` and :func:`timed_post` directly (tests).
"""

from __future__ import annotations

import json
import socket
import sys
import time


class Client:
    """A minimal HTTP/1.1 client on one kept-alive socket (TCP_NODELAY): sends a prepared POST and reads the chunked
    SSE answer as it arrives (roughly what a compiled client costs; ``http.client`` cost ~0.7 ms CPU per request
    here, this one ~0.2 ms)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = None

    def _connect(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=300)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        """Close the connection."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def post_sse(self, path: str, body: bytes, t0: float) -> tuple[float | None, float, int]:
        """POST ``body`` and read the stream: (seconds from ``t0`` (``time.perf_counter``) to the arrival of the
        first content delta, or None; seconds to the arrival of the chunked body's terminator;
        ``usage.completion_tokens``). Arrival = the return of the ``recv()`` that completed those bytes. Raises
        RuntimeError on a non-200 answer or a closed connection."""
        if self.sock is None:
            self._connect()
        self.sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body
        )
        buf, head = b"", None
        while head is None:
            data = self.sock.recv(65536)
            arrived = time.perf_counter()
            if not data:
                raise RuntimeError("the server closed the connection")
            buf += data
            if b"\r\n\r\n" in buf:
                head, buf = buf.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"server answered {head[:200]!r}")
        first, n, sse, done = None, 0, b"", False
        while not done:
            while True:  # whole chunks in buf → sse
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end], 16)
                if size == 0:
                    done = True
                    break
                if len(buf) < end + 2 + size + 2:
                    break
                sse += buf[end + 2 : end + 2 + size]
                buf = buf[end + 2 + size + 2 :]
            *events, sse = sse.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                chunk = json.loads(ev[6:])
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    first = arrived - t0
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
            if not done:
                data = self.sock.recv(65536)
                arrived = time.perf_counter()
                if not data:
                    raise RuntimeError("the server closed the connection mid-answer")
                buf += data
        return first, arrived - t0, n


def timed_post(client: Client, path: str, body: bytes) -> dict:
    """One request: {"first": s to the arrival of the first content delta or None, "total": s to the arrival of the
    stream's end, "n": completion tokens, "cpu_ms": CPU ms this thread spent on it, the parse included, "t0": its
    start on ``time.perf_counter()``'s clock (``docs/tools/serve_timeline.py`` lines it up with the server's stamps)}."""
    c0 = time.thread_time()
    t0 = time.perf_counter()
    first, total, n = client.post_sse(path, body, t0)
    return {"first": first, "total": total, "n": n, "cpu_ms": (time.thread_time() - c0) * 1000, "t0": t0}


def main(argv: list[str]) -> int:
    """``serve_client.py PORT``: one request per stdin line, one result line each (see the module docstring)."""
    client = Client(int(argv[1]))
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            try:
                out = timed_post(client, req["path"], req["body"].encode())
            except (OSError, RuntimeError, ValueError) as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
