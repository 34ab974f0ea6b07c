"""The ``localdiff bench --only serve`` harness: ``localdiff serve``'s app in this process with its threads pinned,
the client process, and the thread CPU clocks (:mod:`localdiff.bench.serve` measures through it).

Layouts (:func:`layouts`): the model thread on the CPUs this process was started on, the event loop and the client
on the same or the other CPUs; stacks (:func:`stacks`): asyncio + h11, and uvloop + httptools where installed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time


class Clocks:
    """CPU seconds of named threads (Linux/macOS ``pthread_getcpuclockid``)."""

    def __init__(self, threads: dict) -> None:
        self.ids = {k: time.pthread_getcpuclockid(t.ident) for k, t in threads.items()}

    def read(self) -> dict:
        return {k: time.clock_gettime(c) for k, c in self.ids.items()}


def stacks() -> list[tuple[str, str]]:
    """The (event loop, HTTP parser) pairs to measure: asyncio + h11 always (where uvloop does not install), and
    uvloop + httptools when installed (base dependencies where they install; what uvicorn's "auto" then picks)."""
    from importlib.util import find_spec

    out = [("asyncio", "h11")]
    if find_spec("uvloop") and find_spec("httptools"):
        out.append(("uvloop", "httptools"))
    return out


def layouts() -> list[dict]:
    """Where the threads run. The model thread always runs on the CPUs this process was given (``taskset``), the
    in-process runs in that same thread. The client is another process (as a real client is), on the machine's
    other CPUs when there are any. "server on one core": the event loop shares the model's CPUs (a server with one
    core; its CPU comes straight out of the model's). "event loop on another core": the event loop runs on the
    other CPUs, as on a user's machine whose other cores are free. "client on the same core": all three on the
    model's CPUs, the client's CPU and its context switches counted as overhead too (the least favourable layout,
    and the one that other jobs on the other CPUs do not disturb)."""
    own = sorted(os.sched_getaffinity(0))
    others = [c for c in range(os.cpu_count() or 1) if c not in own and allowed(own, c)]
    if not others:  # (started without taskset, or one CPU): nothing to separate
        return [{"name": "all on the same CPUs", "model": own, "loop": own, "client": own}]
    return [
        {"name": "server on one core", "model": own, "loop": own, "client": others},
        {"name": "event loop on another core", "model": own, "loop": others, "client": others},
        {"name": "client on the same core", "model": own, "loop": own, "client": own},
    ]


def allowed(own: list[int], cpu: int) -> bool:
    """Whether this thread may run on ``cpu`` (a cpuset may forbid CPUs that ``os.cpu_count`` counts)."""
    try:
        os.sched_setaffinity(0, {*own, cpu})
        ok = cpu in os.sched_getaffinity(0)  # (Linux drops CPUs it cannot use without an error)
    except OSError:
        return False
    os.sched_setaffinity(0, set(own))
    return ok


def pin(tid: int, cpus: list[int]) -> None:
    os.sched_setaffinity(tid, set(cpus))


class Server:
    """``localdiff serve``'s app and uvicorn config (:func:`localdiff.serve.uvicorn_config`, log level "info")
    in this process on 127.0.0.1, its model worker around ``model``, the threads pinned as ``layout`` says, and a
    client process (``serve_client.py``). The server's log lines (uvicorn's, and localdiff's at INFO in
    ``localdiff serve``'s format, the access line of every request included) go to /dev/null: their formatting
    and write still happen."""

    def __init__(self, model, stack: tuple[str, str], layout: dict) -> None:
        import logging

        import uvicorn

        from localdiff.serve import LOG_FORMAT, uvicorn_config
        from localdiff.serve.app import build_app
        from localdiff.serve.worker import ModelWorker

        self.worker = ModelWorker(lambda name: model, model.name, max_queue=4, keep_alive=None)
        self.worker.model = model
        # proto given explicitly: asyncio sets TCP_NODELAY only on IPPROTO_TCP sockets (else +40 ms per response
        # on a kept-alive connection: Nagle against delayed ACKs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn_config(build_app(self.worker), loop=stack[0], http=stack[1], timeout_keep_alive=600)
        self.devnull = open(os.devnull, "w")
        for name in ("uvicorn", "uvicorn.access"):  # (uvicorn configured its logging just now)
            for h in logging.getLogger(name).handlers:
                if isinstance(h, logging.StreamHandler):
                    h.setStream(self.devnull)
        self.log = logging.getLogger("localdiff.serve")
        self.log_level, self.handler = (self.log.level, self.log.propagate), logging.StreamHandler(self.devnull)
        self.handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self.log.addHandler(self.handler)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False  # (not into the bench's own log)
        self.server = uvicorn.Server(config)
        self.worker.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        pin(self.worker._thread.native_id, layout["model"])
        pin(self.thread.native_id, layout["loop"])
        client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_client.py")
        self.client = subprocess.Popen(
            [sys.executable, client, str(self.sock.getsockname()[1])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        pin(self.client.pid, layout["client"])
        self.clocks = Clocks({"loop": self.thread, "model": self.worker._thread})

    def post(self, body: dict) -> dict:
        """One streamed request through the client process (its result line, see ``serve_client.py``)."""
        self.client.stdin.write(json.dumps({"path": "/v1/chat/completions", "body": json.dumps(body)}) + "\n")
        line = self.client.stdin.flush() or self.client.stdout.readline()
        out = json.loads(line) if line else {"error": "the client process ended"}
        if "error" in out:
            raise RuntimeError(f"serve bench client: {out['error']}")
        return out

    def close(self) -> None:
        """Stop the client, the server and the worker."""
        import logging

        if self.client.poll() is None:
            self.client.stdin.close()
            self.client.wait(10)
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.stop()
        self.sock.close()
        for name in ("uvicorn", "uvicorn.access"):
            for h in logging.getLogger(name).handlers:
                if isinstance(h, logging.StreamHandler) and h.stream is self.devnull:
                    h.setStream(sys.stderr)
        self.log.removeHandler(self.handler)
        self.log.setLevel(self.log_level[0])
        self.log.propagate = self.log_level[1]
        self.devnull.close()
