"""The model worker: one thread does all model work (load, generate, unload), fed by a bounded FIFO queue.

Why one thread: torch ops from a second thread compete for the same cores (matmuls get ~5x slower), and the KV
cache and the generator's random state belong to one generation at a time. The worker thread runs torch with the
thread count of the thread that built the worker (``torch.set_num_threads``), set explicitly. The HTTP side
(asyncio) only enqueues jobs and reads their events; ``submit`` on a full queue raises a 503 with Retry-After.

A job's events go to an :class:`Inbox` on the server's loop: ``("start", model, begin)`` once the prompt and
options passed the engine's checks (streamed requests only; ``begin`` is the canvas-events header or None),
``("step", dict)`` per denoising step (when the request asked for ``events: "steps"``), ``("delta", text, canvas)``
per finished canvas (``canvas``: its wire dict when events were asked for, else None), ``("done", Done, used)`` at
the end, or ``("error", ApiError)`` instead. One hand-off (one ``call_soon_threadsafe``, one wake-up of the loop)
per burst: what the engine yields between two denoising steps travels together — the worker wakes the loop before
the next step, or after the end once the job is cleaned up (the last canvas and Done travel together;
:meth:`Job.post`, :meth:`Job.wake`). ``start`` (and with it the response head) rides with the first text, step
event or error, so a short streamed answer costs the loop one wake-up in all; it goes alone once the generation has
run ``START_WAIT`` (50 ms) without any, so a client of a long canvas still learns soon that its request runs. The
HTTP side adds ``("gone",)`` itself when the client disconnects (``localdiff.serve.asgi``). The job and its hand-off
to the loop: :mod:`localdiff.serve.handoff`.

A resident causal model keeps its conversation cache across requests (``Model.new_cache``; exact prefix reuse).

Cancellation (client gone, stop string hit): the engine polls the job's ``cancel`` flag before every denoising step
(``Model.stream(cancel=...)``), so at most the step already running finishes; no step events are needed for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time

import torch

from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.serve.errors import ApiError, cancelled_error as _cancelled, from_engine
from localdiff.serve.handoff import Job
from localdiff.serve.inbox import Flag, Inbox  # noqa: F401  (re-exported)
from localdiff.serve.options import check_clashes
from localdiff.serve.spent import Spent
from localdiff.wire import EventEncoder

log = logging.getLogger("localdiff.serve")
START_WAIT = 0.05  # s: a stream's response head waits this long at most for the first text or step event
CLOSE_AFTER = 0.002  # s: a finished job's engine stream is closed after this idle time (or before the next item)


class ModelWorker:
    """Owns the resident model and the worker thread.

    Args:
        loader: ``loader(name) -> Model`` (``localdiff.load`` with the server's device / quant).
        default_model: the model used when a request names none.
        defaults: sampler options from the server's flags / env / config file (a request overrides them).
        max_queue: jobs waiting at most (besides the running one); more → 503.
        keep_alive: seconds an idle model stays loaded (None = forever).
        max_batch: generations advanced together, one packed forward per step (:mod:`localdiff.serve.batching`);
            1 = one at a time. kv_budget: KV-cache bytes the batch's requests may hold together (None = no limit).
    """

    def __init__(
        self,
        loader,
        default_model: str,
        defaults: dict | None = None,
        max_queue: int = 32,
        keep_alive: float | None = 300.0,
        max_batch: int = 1,
        kv_budget: int | None = None,
    ) -> None:
        self.loader, self.default_model, self.defaults = loader, default_model, dict(defaults or {})
        self.keep_alive = keep_alive
        self.model = None
        self._key = None  # the name the resident model was loaded by
        self.loading: str | None = None
        self.load_error: str | None = None
        self.last_used = time.monotonic()
        self.current: Job | None = None
        self.max_batch, self.kv_budget = max(1, int(max_batch)), kv_budget
        self.running: list[Job] = []  # the batch's jobs (max_batch > 1)
        self.batcher = None  # its localdiff.engine.batch.Batcher while a batch runs
        # a C queue: put (on the loop) and get (in this thread) run no Python, so neither thread holds the GIL long
        # around a hand-off (queue.Queue's Condition is ~30 lines of Python on each side); bounded in submit()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.max_queue = max_queue
        self._thread = threading.Thread(target=self._run, name="localdiff-model", daemon=True)
        self._stop = False
        self._ended = None  # the last job's engine stream, not closed yet (:meth:`_close_ended`)
        self._applicable: tuple = (None, {})  # (model, its share of ``defaults``)
        self._conversation: tuple = (None, None)  # (causal model, its conversation cache kept across requests)
        self.threads = torch.get_num_threads()  # applied in the worker thread (see the module docstring)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, preload: str | None = None) -> None:
        """Start the worker thread; with ``preload``, load that model first (``/health`` is 503 meanwhile)."""
        if preload:
            self.loading = preload
            self._q.put(("load", preload))
        self._thread.start()

    def stop(self, wait: float | None = None) -> None:
        """Ask the worker to end after the running job (cancelled: it stops before its next step); with ``wait``,
        wait up to that many seconds for the thread to end (so that the process does not exit while the thread is
        inside torch: at interpreter exit that aborted the process, exit code 134)."""
        self._stop = True
        for running in [self.current, *self.running]:
            if running is not None:
                running.cancel.set()
        self._q.put(None)
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def expires_at(self) -> float | None:
        """When the resident model unloads if it stays idle (``time.time()`` seconds), or None (never; no model)."""
        if self.model is None or self.keep_alive is None:
            return None
        idle = (
            0.0 if self.current is not None or self.running else time.monotonic() - self.last_used
        )  # (a job runs: not idle)
        return time.time() + max(self.keep_alive - idle, 0.0)

    def batch_info(self) -> dict:
        """The running batch (``/api/ps``): ``active`` requests, ``max_batch``, ``rows_last_step`` (rows of the last
        packed step's forwards, all requests), ``steps`` run by this batch."""
        b = self.batcher
        return {
            "active": len(self.running) + (self.current is not None),
            "max_batch": self.max_batch,
            "rows_last_step": b.last_rows if b is not None and self.running else 0,
            "steps": b.steps if b is not None else 0,
        }

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self._q.qsize()

    def submit(self, job: Job) -> None:
        """Enqueue ``job`` in arrival order. Raises ApiError(503, Retry-After) when the queue is full."""
        if self._q.qsize() >= self.max_queue:  # (jobs are submitted from the loop thread only: no race)
            many = "s" * (self.max_queue != 1)
            raise ApiError(
                503,
                f"server busy: {self.max_queue} request{many} already queued; retry later",
                type="server_busy",
                code="queue_full",
                headers={"Retry-After": "5"},
            )
        self._q.put(job)

    def load(self, name: str):
        """The model ``name`` ("" = the resident or default one), loaded in the model thread in queue order (blocks);
        returns it. Raises ApiError (``from_engine``: 404 for an unknown model, ...)."""
        try:
            return self.call(lambda: self._ensure(name))
        except Exception as exc:  # noqa: BLE001 — one JSON error
            raise from_engine(exc) from None

    def call(self, fn):
        """Run ``fn()`` in the model thread, in queue order, and return its result (blocks; re-raises its error).
        For callers that must use the model exactly as the worker does, e.g. the bench's in-process runs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(("call", fn, fut))
        return fut.result()

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        if self.max_batch > 1:
            from localdiff.serve.batching import run_batched

            return run_batched(self)
        while not self._stop:
            try:
                item = self._q.get(timeout=1.0 if self._ended is None else CLOSE_AFTER)
            except queue.Empty:
                if self._ended is not None:
                    self._close_ended()
                else:
                    self._maybe_unload()
                continue
            self._close_ended()
            if item is None:
                break
            if isinstance(item, tuple) and item[0] == "call":
                try:
                    item[2].set_result(item[1]())
                except BaseException as exc:  # noqa: BLE001 — handed to the caller
                    item[2].set_exception(exc)
                continue
            if isinstance(item, tuple):
                self._ensure(item[1], quiet=True)
                continue
            if item.cancel.is_set():
                item.post(("error", _cancelled(item, "cancelled before it started")), wake=False)
                item.finished.set()
                item.wake()
                continue
            self.run_alone(item)
        self._close_ended()

    def run_alone(self, job: Job) -> None:  # on the model thread
        """Run ``job`` to its end, alone, then mark it finished (the batch loop's path for nets that do not pack)."""
        self.current = job
        try:
            self._generate(job)
        finally:
            self.current = None
            self.last_used = time.monotonic()
            job.finished.set()
            job.wake()  # the last burst, once this thread is about to wait (the loop need not wait for it)

    def _close_ended(self) -> None:
        """Close the last job's engine stream (its clean-up: the generation lock, the KV cache and the canvas
        buffers freed, ~0.08 ms on the embedded model), deferred by :meth:`_generate` until the answer is out."""
        stream, self._ended = self._ended, None
        if stream is not None:
            stream.close()

    def _maybe_unload(self) -> None:
        if (
            self.model is not None
            and self.keep_alive is not None
            and time.monotonic() - self.last_used > self.keep_alive
        ):
            log.info("unloading %s after %.0f s idle", self.model.name, self.keep_alive)
            self.model, self._conversation = None, (None, None)

    def _ensure(self, name: str, quiet: bool = False):
        """The resident model when it is ``name`` (or ``name`` is empty); else load ``name`` in this thread."""
        if self.model is not None and (not name or name in (self.model.name, self._key)):
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
        self.model, self.load_error, self._key = model, None, name  # (its label may spell the name otherwise)
        self.last_used = time.monotonic()
        log.info("model %s ready", name)
        return model

    def _defaults_for(self, model) -> dict:
        """The server-wide sampler defaults that apply to ``model``'s decoder (computed once per loaded model)."""
        if not self.defaults:
            return {}
        if self._applicable[0] is not model:
            self._applicable = (model, model.applicable(self.defaults))
        return self._applicable[1]

    def _cache_for(self, model):
        """``model``'s conversation cache kept across requests (causal family; None for the others; one model's)."""
        if self._conversation[0] is not model:
            self._conversation = (model, model.new_cache() if model.family == "causal" else None)
        return self._conversation[1]

    def _generate(self, job: Job, lane=None) -> None:
        """Run ``job`` to its end, posting its events; ``lane``: the batch's view of the resident model (the job is
        a lane of :mod:`localdiff.serve.batching`), else the model it names is loaded first."""
        req = job.req
        stream = None
        try:
            t_load = time.perf_counter()
            model = self._ensure(req.model) if lane is None else lane
            if lane is None:  # (a lane's job: set when the batch loop prepared it)
                job.load_seconds = time.perf_counter() - t_load
            check_clashes(model.options_cls, req.sampler, req.shown)
            sampler = {**self._defaults_for(self.model if lane is not None else model), **req.sampler}
            seed = req.seed if req.seed is not None else random.randrange(2**63)  # known even if stopped early
            wire = EventEncoder(model) if req.events != "none" else None

            def cancel() -> bool:  # the engine calls it before every step; the first call: the request is valid
                now, stops = time.perf_counter(), job.cancel.is_set()
                if job.spent is None:
                    job.spent = Spent(now)
                job.spent.poll(now, stops)
                if job.steps == 0:
                    job.model, job.seed = model, seed
                    if req.stream:  # rides with the first text / step event / error: no wake-up of its own
                        job.post(("start", model, wire.begin() if wire else None), wake=False, lead=True)
                        job.began = time.monotonic()
                else:  # what the last step yielded goes out while the next one runs; the start
                    job.wake(leads=time.monotonic() - job.began > START_WAIT)  # alone after START_WAIT s
                job.steps += 1
                return stops

            ids = model.encode_prompt(req.prompt, req.chat)[0]  # rendered and tokenized once per request
            job.prompt_tokens = len(ids)
            stream = model.stream(
                ids,
                max_new_tokens=req.max_new_tokens,
                seed=seed,
                emit_steps=req.events == "steps",
                cancel=cancel,
                cache=self._cache_for(model) if lane is None else None,
                **sampler,
            )
            for ev in stream:
                if isinstance(ev, StepEvent):
                    job.post(("step", wire.step(ev)), wake=False)
                elif isinstance(ev, CanvasDone):
                    last = bool(ev.finished.all())  # then Done follows at once; the end wakes the loop
                    job.spent.canvas_done(model.family not in ("causal", "slots"))
                    job.post(("delta", ev.text, wire.canvas(ev) if wire else None), wake=not last)
                elif isinstance(ev, Done):
                    job.post(
                        (
                            "done",
                            ev,
                            {"seed": getattr(ev, "seed", seed), "sampler": getattr(ev, "options", None) or {}},
                        ),
                        wake=False,
                    )
                    return
                if job.cancel.is_set():
                    break
            if job.spent is not None:  # cancelled (a stop string, the client gone): what it used so far
                job.spent.end(time.perf_counter())
                job.spent.sampler = model.sampler_options(**sampler)
            job.post(("error", _cancelled(job, "cancelled")), wake=False)
        except Exception as exc:  # noqa: BLE001 — every failure becomes one JSON error and one log line
            err = from_engine(exc, req.shown)
            if err.status >= 500:
                log.error("generation failed: %s: %s", type(exc).__name__, exc)
            job.post(("error", err), wake=False)
        finally:  # closed once the loop has the last burst (CLOSE_AFTER idle, or before the next item)
            if lane is None:
                self._ended = stream
            elif stream is not None:
                stream.close()
