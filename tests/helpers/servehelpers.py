"""A ``localdiff serve`` app running in a background thread on 127.0.0.1 (an OS-chosen port), for the tests."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import uvicorn

import localdiff
from localdiff.serve import uvicorn_config
from localdiff.serve.app import ServerSettings, build_app
from localdiff.serve.worker import ModelWorker


def wait_healthy(url: str, proc, timeout: float) -> None:
    """Wait until the server at ``url`` answers ``GET /health`` with 200; fails if ``proc`` (its subprocess.Popen)
    exits first or ``timeout`` seconds pass."""
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() - t0 < timeout and proc.poll() is None, "the server did not start"
        time.sleep(0.1)


class LogTrap(logging.Handler):
    """Keeps every log record of the server (ours and uvicorn's) to check for tracebacks and errors."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        out = []
        for r in self.records:
            out.append(r.getMessage())
            if r.exc_info or r.exc_text:
                out.append("Traceback (exc_info attached)")
        return "\n".join(out)


class Running:
    """A started server: ``url`` (http://127.0.0.1:PORT), ``worker``, ``logs``; ``stop()`` ends it."""

    def __init__(
        self,
        model="tiny",
        api_key=None,
        max_queue=32,
        max_body=None,
        keep_alive=300.0,
        defaults=None,
        names=None,
        loader=None,
        max_batch=8,
        kv_budget=None,
    ):
        """``names``: the server's ModelNames (default: the installed models and "tiny"); ``loader``: the worker's
        ``loader(name)`` (default: ``localdiff.load`` on the CPU); ``max_batch`` / ``kv_budget``: serve's
        ``--max-batch`` / ``--kv-budget``."""
        self.logs = LogTrap()
        self.worker = ModelWorker(
            loader or (lambda name: localdiff.load(name, device="cpu")),
            "tiny",
            defaults,
            max_queue=max_queue,
            keep_alive=keep_alive,
            max_batch=max_batch,
            kv_budget=kv_budget,
        )
        settings = ServerSettings(api_key=api_key, **({"max_body": max_body} if max_body else {}))
        self.app = build_app(self.worker, settings, names) if names is not None else build_app(self.worker, settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # (asyncio sets TCP_NODELAY)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, "info", timeout_graceful_shutdown=1))  # serve's own
        for name in ("localdiff.serve", "uvicorn.error"):  # after uvicorn's logging setup (its access log is off)
            logging.getLogger(name).addHandler(self.logs)
        self.log_level = logging.getLogger("localdiff.serve").level
        logging.getLogger("localdiff.serve").setLevel(logging.INFO)  # as `localdiff serve` logs
        self.worker.start(preload=model)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started or (model and self.worker.model is None):
            if time.monotonic() - t0 > 60:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    @staticmethod
    def free_port() -> int:
        """A port free on 127.0.0.1 right now."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.stop()
        self.sock.close()
        for name in ("localdiff.serve", "uvicorn.error"):
            logging.getLogger(name).removeHandler(self.logs)
        logging.getLogger("localdiff.serve").setLevel(self.log_level)
