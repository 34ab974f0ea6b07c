"""``localdiff serve``: an OpenAI- and Ollama-compatible HTTP API on this machine (uvicorn; the generation routes as
plain ASGI, the rest Starlette).

:func:`serve` runs the server until interrupted; :func:`check_binding` is the refusal to listen beyond this
machine without an API key. The app itself is :func:`localdiff.serve.app.build_app`.
"""

from __future__ import annotations

import logging
import signal
import threading

from localdiff.errors import CheckpointError, LocaldiffError, UsageError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 11436
LOG_FORMAT = "%(levelname)s:     %(message)s"  # localdiff's server log lines (access lines included)


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
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            hint = " (is another server running there? use --port)" if e.errno == 98 else ""
            raise LocaldiffError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


def check_binding(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse an empty ``host``, and a non-loopback one unless an API key is set or ``insecure`` is explicit.

    Raises:
        UsageError: with the two ways out in the message.
    """
    if not host.strip():  # getaddrinfo reads "" as every interface; the refusal read "listen on  without"
        raise UsageError("--host: empty host name (leave --host out for 127.0.0.1)")
    if host not in LOCAL_HOSTS and not api_key and not insecure:
        raise UsageError(
            f"refusing to listen on {host} without --api-key KEY (or --insecure to serve anyone who "
            f"can reach this machine)"
        )


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
    kw["http"] = protocol_class(kw.get("http", "auto"))  # one socket write per loop callback (serve/transport.py)
    kw.setdefault("lifespan", "off")  # the app has no startup / shutdown handlers; with "on", a second Ctrl-C
    # (uvicorn's force quit) printed a traceback of Starlette's lifespan task being cancelled
    return uvicorn.Config(app, log_level=log_level, proxy_headers=False, access_log=False, **kw)


def serve(
    models,
    default_model: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    insecure: bool = False,
    device: str | None = None,
    quant: str | None = None,
    sampler: dict | None = None,
    max_queue: int = 32,
    keep_alive: float | None = 300.0,
    max_body: int | None = None,
    log_level: str = "info",
    gpu_mem: int | None = None,
    threads: int | str | None = None,
    gpu_layers=None,
    draft: str | None = None,
    max_batch: int = 8,
    kv_budget: int | None = None,
    decoder_from: str | None = None,
) -> int:
    """Run the server in the foreground until Ctrl-C or SIGTERM; returns 0 once it has drained (a normal stop).

    Args:
        models: the ``-m`` models (names or paths; a str is one), besides the installed ones: the only paths the
            server ever loads (:mod:`localdiff.serve.names`); the first is loaded at start (``/health`` is 503 until
            it is ready). None / empty = load on the first request.
        default_model: the model for requests that name none (offered too).
        sampler: sampler options from flags / env / config (requests override them).
        max_queue: requests waiting at most; keep_alive: seconds before an idle model unloads (None = never).
        max_body: request size limit in bytes.
        gpu_mem / threads / gpu_layers: passed to ``localdiff.load`` (device budget in bytes for the memory plan;
            CPU threads, or "auto": by model size; GPU layers of the gguf backend).
        draft: a DFlash draft for the causal models ("auto": each one's catalog pairing; :mod:`localdiff.serve.drafts`).
        max_batch: requests advanced together, one packed forward per step (1 = one at a time);
            kv_budget: KV-cache bytes the batch's requests hold together at most (None = no limit)
            (:mod:`localdiff.serve.batching`).
        decoder_from: where ``sampler["decoder"]`` came from when given for this run ("--decoder",
            "LOCALDIFF_DECODER"): refused now if no offered model can run it (:mod:`localdiff.serve.decoder_check`).
    Raises:
        UsageError: bad binding, a bad ``draft``; LocaldiffError: the ASGI stack is missing or the port is taken.
    """
    check_binding(host, api_key, insecure)
    models = [models] if isinstance(models, str) else list(models or ())
    import localdiff
    from localdiff.loader import gguf_target, load_config

    for model in models:  # a name that cannot load is an error now, not a log line after start
        if gguf_target(model) is None:
            folder = localdiff._resolve_path(model)[0]
            try:
                load_config(folder)  # a folder that is no checkpoint (serve -m /etc) too
            except CheckpointError as e:
                raise CheckpointError(f"-m {model}: {e}") from None
            _check_not_draft(model, folder)
    if decoder_from and (sampler or {}).get("decoder"):
        from localdiff.serve.decoder_check import check_decoder

        check_decoder(sampler["decoder"], models or [default_model], decoder_from)
    from localdiff.serve.drafts import Drafts

    drafts = Drafts(draft)
    drafts.check(models)
    check_port(host, port)
    try:
        import uvicorn
    except ImportError:
        raise LocaldiffError(
            "`localdiff serve` needs starlette and uvicorn (part of the base install; reinstall "
            "localdiff or pip install starlette uvicorn)"
        ) from None
    from localdiff.errors import ModelNotFoundError
    from localdiff.serve.app import DEFAULT_MAX_BODY, ServerSettings, build_app
    from localdiff.serve.names import NOT_OFFERED, ModelNames
    from localdiff.serve.worker import ModelWorker

    names = ModelNames(models, default_model or (models[0] if models else ""))

    def loader(name: str):
        if names.resolve(name) != name:  # the HTTP side passes offered names only; this is the second lock
            raise ModelNotFoundError(NOT_OFFERED)
        return localdiff.load(
            name,
            device=device,
            quant=quant,
            gpu_mem=gpu_mem,
            threads=threads,
            gpu_layers=gpu_layers,
            draft=drafts.for_model(name),
        )

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    worker = ModelWorker(
        loader,
        names.default,
        sampler,
        max_queue=max_queue,
        keep_alive=keep_alive,
        max_batch=max_batch,
        kv_budget=kv_budget,
    )
    app = build_app(worker, ServerSettings(api_key=api_key, max_body=max_body or DEFAULT_MAX_BODY), names)
    config = uvicorn_config(app, log_level, host=host, port=port)
    server = uvicorn.Server(config)
    worker.start(preload=names.default if models else None)
    stop = StopSignals(lambda: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        stop.restore()  # a signal while the model thread lets go: Python's own handling again
        worker.stop(wait=30.0)  # the running step ends (at most one step: the job was cancelled at shutdown)
    if not server.started:
        raise LocaldiffError(f"could not listen on {host}:{port} (is the port in use?)")
    if stop.seen:
        logging.getLogger("localdiff.serve").info("stopped by %s after draining; exit 0", stop.seen[0])
    return 0


def _check_not_draft(name: str, folder) -> None:
    """``serve -m`` of a DFlash draft: one line now (it does not run alone; it failed on every request).

    Raises:
        UsageError: naming the draft's catalog targets.
    """
    import json
    from pathlib import Path

    from localdiff.hub import catalog

    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the load reports a broken config.json itself
    if isinstance(cfg, dict) and catalog.is_draft(cfg):
        targets = catalog.draft_targets(name)
        raise UsageError(
            f"-m {name}: a DFlash draft does not run alone; serve its target"
            f"{' (' + ', '.join(targets) + ')' if targets else ''} with --draft {name} instead"
        )


class StopSignals:
    """While a server runs, SIGINT (Ctrl-C) and SIGTERM are its normal stop (exit 0). uvicorn catches them itself,
    drains the requests, then delivers each again once its own handlers are gone (``signal.raise_signal``, so that
    Python's defaults would follow: KeyboardInterrupt, exit 130; death by SIGTERM, exit 143); the handlers set here,
    under uvicorn's, take that second delivery and only note it in :attr:`seen` ("Ctrl-C (SIGINT)", "SIGTERM").
    :meth:`restore` puts the previous handlers back. ``on_signal()`` runs at each (a signal before uvicorn set its
    handlers still stops the server). Does nothing outside the main thread (no signals there)."""

    NAMES = {"SIGINT": "Ctrl-C (SIGINT)", "SIGTERM": "SIGTERM"}

    def __init__(self, on_signal=None) -> None:
        self.seen: list[str] = []
        self.on_signal = on_signal
        self._saved: dict = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                sig = getattr(signal, name)
                self._saved[sig] = signal.signal(sig, self._note)

    def _note(self, sig, frame) -> None:
        self.seen.append(self.NAMES.get(signal.Signals(sig).name, str(sig)))
        if self.on_signal is not None:
            self.on_signal()

    def restore(self) -> None:
        """Put the handlers back as they were (once)."""
        saved, self._saved = self._saved, {}
        for sig, handler in saved.items():
            signal.signal(sig, handler)


__all__ = ["serve", "StopSignals", "uvicorn_config", "check_binding", "check_port", "DEFAULT_PORT", "LOCAL_HOSTS"]
