"""The model worker: one thread does all model work (load, generate, unload), fed by a bounded FIFO queue.

Why one thread: torch ops from a second thread compete for the same cores (matmuls get ~5x slower), and the KV
cache and the generator's random state belong to one generation at a time. The HTTP side (asyncio) only enqueues
jobs and reads their events; ``submit`` on a full queue raises a 503 with Retry-After.

A job's events go to an ``asyncio.Queue`` on the server's loop: ``("start", model)`` once the prompt and
options passed the engine's checks, ``("delta", text)`` per finished canvas, ``("done", Done, used)`` at the end, or
``("error", ApiError)`` instead. Cancellation (client gone, stop string hit): the job's ``cancel`` event is checked
after every denoising step; the worker then closes the engine's generator, so at most one more step runs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field

from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.serve.errors import ApiError, from_engine
from localdiff.serve.options import GenRequest

log = logging.getLogger("localdiff.serve")


@dataclass
class Job:
    """One queued generation: the request, where its events go, and its cancel flag."""

    req: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    steps: int = 0            # denoising steps run so far (tests read it to see a cancelled job stop)
    finished: threading.Event = field(default_factory=threading.Event)
    model: object = None      # the Model that runs it (set when it starts)
    seed: int | None = None   # the seed actually used

    def post(self, item: tuple) -> None:
        """Hand an event to the HTTP side (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


class ModelWorker:
    """Owns the resident model and the worker thread.

    Args:
        loader: ``loader(name) -> Model`` (``localdiff.load`` with the server's device / quant).
        default_model: the model used when a request names none.
        defaults: sampler options from the server's flags / env / config file (a request overrides them).
        max_queue: jobs waiting at most (besides the running one); more → 503.
        keep_alive: seconds an idle model stays loaded (None = forever).
    """

    def __init__(self, loader, default_model: str, defaults: dict | None = None, max_queue: int = 32,
                 keep_alive: float | None = 300.0) -> None:
        self.loader, self.default_model, self.defaults = loader, default_model, dict(defaults or {})
        self.keep_alive = keep_alive
        self.model = None
        self.loading: str | None = None
        self.load_error: str | None = None
        self.last_used = time.monotonic()
        self.current: Job | None = None
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="localdiff-model", daemon=True)
        self._stop = False

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, preload: str | None = None) -> None:
        """Start the worker thread; with ``preload``, load that model first (``/health`` is 503 meanwhile)."""
        if preload:
            self.loading = preload
            self._q.put(("load", preload))
        self._thread.start()

    def stop(self) -> None:
        """Ask the worker to end after the running job (the thread is a daemon; it also dies with the process)."""
        self._stop = True
        running = self.current
        if running is not None:
            running.cancel.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self._q.qsize()

    def submit(self, job: Job) -> None:
        """Enqueue ``job`` in arrival order. Raises ApiError(503, Retry-After) when the queue is full."""
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise ApiError(503, f"server busy: {self._q.maxsize} requests already queued; retry later",
                           type="server_busy", code="queue_full", headers={"Retry-After": "5"}) from None

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            try:
                item = self._q.get(timeout=1.0)
            except queue.Empty:
                self._maybe_unload()
                continue
            if item is None:
                break
            if isinstance(item, tuple):
                self._ensure(item[1], quiet=True)
                continue
            if item.cancel.is_set():
                item.post(("error", ApiError(499, "cancelled before it started", code="cancelled")))
                item.finished.set()
                continue
            self.current = item
            try:
                self._generate(item)
            finally:
                self.current = None
                self.last_used = time.monotonic()
                item.finished.set()

    def _maybe_unload(self) -> None:
        if (self.model is not None and self.keep_alive is not None
                and time.monotonic() - self.last_used > self.keep_alive):
            log.info("unloading %s after %.0f s idle", self.model.name, self.keep_alive)
            self.model = None

    def _ensure(self, name: str, quiet: bool = False):
        """The resident model when it is ``name`` (or ``name`` is empty); else load ``name`` in this thread."""
        if self.model is not None and (not name or name == self.model.name):
            return self.model
        name = name or self.default_model
        self.loading = name
        try:
            model = self.loader(name)
        except Exception as exc:  # noqa: BLE001 — reported to the client / the log as one line
            self.load_error = f"{name}: {exc}"
            if quiet:
                log.error("could not load %s: %s", name, exc)
                return None
            raise
        finally:
            self.loading = None
        self.model, self.load_error = model, None
        self.last_used = time.monotonic()
        log.info("model %s ready", name)
        return model

    def _generate(self, job: Job) -> None:
        req = job.req
        stream = None
        try:
            model = self._ensure(req.model)
            sampler = {**model.applicable(self.defaults), **req.sampler}   # server-wide defaults: this decoder's
            seed = req.seed if req.seed is not None else random.randrange(2**63)  # known even if stopped early
            stream = model.stream(req.prompt, max_new_tokens=req.max_new_tokens, seed=seed, chat=req.chat,
                                  emit_steps=True, **sampler)
            first = next(stream)  # option / prompt / context errors surface here, before any response starts
            job.model, job.seed = model, seed
            job.post(("start", model))
            for ev in itertools.chain([first], stream):
                if isinstance(ev, StepEvent):
                    job.steps += 1
                elif isinstance(ev, CanvasDone):
                    job.post(("delta", ev.text))
                elif isinstance(ev, Done):
                    job.post(("done", ev, {"seed": getattr(ev, "seed", seed),
                                           "sampler": getattr(ev, "options", None) or {}}))
                    return
                if job.cancel.is_set():
                    job.post(("error", ApiError(499, "cancelled", code="cancelled")))
                    return
        except Exception as exc:  # noqa: BLE001 — every failure becomes one JSON error and one log line
            err = from_engine(exc)
            if err.status >= 500:
                log.error("generation failed: %s: %s", type(exc).__name__, exc)
            job.post(("error", err))
        finally:
            if stream is not None:
                stream.close()

