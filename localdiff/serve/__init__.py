"""``localdiff serve``: an OpenAI- and Ollama-compatible HTTP API on this machine (uvicorn; the generation routes as
plain ASGI, the rest Starlette).

:func:`serve` runs the server until interrupted; :func:`check_binding` is the refusal to listen beyond this
machine without an API key. The app itself is :func:`localdiff.serve.app.build_app`.
"""
from __future__ import annotations

import logging

from localdiff.errors import LocaldiffError, UsageError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 11436
LOG_FORMAT = "%(levelname)s:     %(message)s"   # localdiff's server log lines (access lines included)


def check_port(host: str, port: int) -> None:
    """Bind ``host``:``port`` once and let go, so that a taken port or an unknown host is one line before the
    server starts (uvicorn would log several lines and exit 3).

    Raises:
        LocaldiffError: the host does not resolve, or the address cannot be bound (in use, not this machine's).
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise LocaldiffError(f"--host {host}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            hint = " (is another server running there? use --port)" if e.errno == 98 else ""
            raise LocaldiffError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


def check_binding(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse a non-loopback ``host`` unless an API key is set or ``insecure`` is explicit.

    Raises:
        UsageError: with the two ways out in the message.
    """
    if host not in LOCAL_HOSTS and not api_key and not insecure:
        raise UsageError(f"refusing to listen on {host} without --api-key KEY (or --insecure to serve anyone who "
                         f"can reach this machine)")


def uvicorn_config(app, log_level: str = "info", **kw):
    """The ``uvicorn.Config`` that ``localdiff serve`` runs ``app`` with (the bench runs the same one).

    Event loop and HTTP parser "auto" (uvloop and httptools, base dependencies, when installed; else asyncio and
    h11). uvicorn's access log is off: the app writes the same line itself once a response is complete
    (:func:`localdiff.serve.asgi.log_access`) — uvicorn writes it as the response starts, ~0.15 ms of event-loop
    CPU before the first byte of every answer (``localdiff bench --only serve``). No proxy-header middleware
    (uvicorn trusts ``X-Forwarded-For`` from 127.0.0.1 by default: a local server logs the peer it sees, and skips
    that layer per request). Responses are written through :class:`localdiff.serve.transport.CorkedTransport` (one
    ``send`` per loop callback instead of one per head / chunk / terminator); ``http`` may name the parser ("auto",
    "h11", "httptools"). ``kw``: more ``uvicorn.Config`` arguments (host, port, ...). Raises ImportError without
    uvicorn.
    """
    import uvicorn

    from localdiff.serve.transport import protocol_class

    kw.setdefault("timeout_graceful_shutdown", 2)
    kw["http"] = protocol_class(kw.get("http", "auto"))   # one socket write per loop callback (serve/transport.py)
    kw.setdefault("lifespan", "off")   # the app has no startup / shutdown handlers; with "on", a second Ctrl-C
    # (uvicorn's force quit) printed a traceback of Starlette's lifespan task being cancelled
    return uvicorn.Config(app, log_level=log_level, proxy_headers=False, access_log=False, **kw)


def serve(model: str | None, default_model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          api_key: str | None = None, insecure: bool = False, device: str | None = None, quant: str | None = None,
          sampler: dict | None = None, max_queue: int = 32, keep_alive: float | None = 300.0,
          max_body: int | None = None, log_level: str = "info", gpu_mem: int | None = None,
          threads: int | None = None, gpu_layers=None) -> int:
    """Run the server in the foreground until Ctrl-C; returns 0.

    Args:
        model: load this model at start (``/health`` is 503 until it is ready); None = on the first request.
        default_model: the model for requests that name none.
        sampler: sampler options from flags / env / config (requests override them).
        max_queue: requests waiting at most; keep_alive: seconds before an idle model unloads (None = never).
        max_body: request size limit in bytes.
        gpu_mem / threads / gpu_layers: passed to ``localdiff.load`` (device budget in bytes for the memory plan;
            CPU threads and GPU layers of the gguf backend).
    Raises:
        UsageError: bad binding; LocaldiffError: the ASGI stack is missing or the port is taken.
    """
    check_binding(host, api_key, insecure)
    if model is not None:                  # a name that cannot load is an error now, not a log line after start
        import localdiff
        from localdiff.loader import gguf_target

        if gguf_target(model) is None:
            localdiff._resolve_path(model)
    check_port(host, port)
    try:
        import uvicorn
    except ImportError:
        raise LocaldiffError("`localdiff serve` needs starlette and uvicorn (part of the base install; reinstall "
                             "localdiff or pip install starlette uvicorn)") from None
    from localdiff.serve.app import DEFAULT_MAX_BODY, ServerSettings, build_app
    from localdiff.serve.worker import ModelWorker

    def loader(name: str):
        import localdiff

        return localdiff.load(name, device=device, quant=quant, gpu_mem=gpu_mem, threads=threads,
                              gpu_layers=gpu_layers)

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    worker = ModelWorker(loader, default_model, sampler, max_queue=max_queue, keep_alive=keep_alive)
    app = build_app(worker, ServerSettings(api_key=api_key, max_body=max_body or DEFAULT_MAX_BODY))
    config = uvicorn_config(app, log_level, host=host, port=port)
    server = uvicorn.Server(config)
    worker.start(preload=model)
    try:
        server.run()
    finally:
        worker.stop(wait=30.0)   # the running step ends (at most one step: the job was cancelled at shutdown)
    if not server.started:
        raise LocaldiffError(f"could not listen on {host}:{port} (is the port in use?)")
    return 0


__all__ = ["serve", "uvicorn_config", "check_binding", "check_port", "DEFAULT_PORT", "LOCAL_HOSTS"]
