"""The model thread with step-level batching (``serve --max-batch N``, N > 1): requests for the resident model that
are in flight together advance together, one packed forward per step (:mod:`localdiff.engine.batch`).

:func:`run_batched` replaces :meth:`ModelWorker._run`'s one-job-at-a-time loop. Jobs are taken from the worker's
queue in arrival order: a job for the resident model joins the running batch at the next step boundary while the
batch has room (``max_batch`` lanes) and its KV cache fits ``kv_budget`` beside the running ones' (the memory
plan's estimate for the prompt and ``max_tokens``: :func:`kv_bytes`); anything else — a job for another model, a load, a ``call`` —
waits at the head of the queue, with every job after it, until the batch has drained (so the order of the queue
holds, and a model is never swapped under running requests). A job whose cache alone is over the budget runs once
the batch is empty, alone, as without batching. Each lane runs :meth:`ModelWorker._generate` unchanged (events,
cancellation, stop strings, errors); a finished or cancelled lane leaves without disturbing the others.
"""

from __future__ import annotations

import queue
import time

from localdiff.engine.batch import Batcher, batchable
from localdiff.serve.errors import cancelled_error, from_engine


def kv_bytes(model, prompt_tokens: int, max_new_tokens: int | None) -> int:
    """Estimated K/V bytes of one request: the memory plan's :func:`localdiff.quantize.plan.kv_bytes` of the model's
    config.json for prompt + answer tokens (rounded up to whole blocks; a canvas model's answer to whole canvases) in
    the model's dtype. 0 when the config does not give the layers' geometry (nothing to budget)."""
    from localdiff.quantize.plan import kv_bytes as plan_kv_bytes

    n = prompt_tokens + (max_new_tokens or model.default_max_new_tokens)
    blk = int(getattr(model.config, "block_size", 1) or 1)
    canvas = int(getattr(model.config, "canvas_length", 0) or 0)  # the canvas family: the answer in whole canvases
    if canvas and blk == 1:
        n = prompt_tokens + -(-(n - prompt_tokens) // canvas) * canvas
    try:
        return plan_kv_bytes(dict(model.config.raw), -(-n // blk) * blk, dtype=str(model.dtype).split(".")[-1])
    except Exception:  # noqa: BLE001 — a config the plan cannot read: no estimate
        return 0


def _fits(worker, job) -> bool:
    """Whether ``job`` may join now: the batch has room and the budget holds its cache beside the running ones'."""
    if worker.batcher is not None and len(worker.batcher.lanes) >= worker.max_batch:
        return False
    if worker.kv_budget is None or not worker.running:
        return True
    return sum(j.kv_bytes or 0 for j in worker.running) + (job.kv_bytes or 0) <= worker.kv_budget


def _admit(worker, model, job) -> None:
    """Start ``job`` as a lane of the batch on ``model``."""
    if worker.batcher is None or worker.batcher.model is not model:
        worker.batcher = Batcher(model, worker.threads)
    worker.running.append(job)

    def lane(view) -> None:
        try:
            worker._generate(job, view)
        finally:
            worker.running.remove(job)
            worker.last_used = time.monotonic()
            job.finished.set()
            job.wake()

    job.lane = worker.batcher.add(lane, job)


def _prepare(worker, job):
    """The resident model for ``job`` (loaded when it names another and the batch is empty), with the job's cache
    estimate set; None when the job ended here (cancelled, or its model failed to load: its error is posted)."""
    if job.cancel.is_set():
        job.post(("error", cancelled_error(job, "cancelled before it started")), wake=False)
        job.finished.set()
        job.wake()
        return None
    try:
        t0 = time.perf_counter()
        model = worker._ensure(job.req.model)
        job.load_seconds = time.perf_counter() - t0
        ids = model.encode_prompt(job.req.prompt, job.req.chat)[0] if worker.kv_budget is not None else []
    except Exception as exc:  # noqa: BLE001 — one JSON error, as the worker's own _generate reports it
        job.post(("error", from_engine(exc, job.req.shown)), wake=False)
        job.finished.set()
        job.wake()
        return None
    job.kv_bytes = kv_bytes(model, len(ids), job.req.max_new_tokens) if ids else 0  # (set: prepared)
    return model


def _joins(worker, job) -> bool:
    """Whether a queued item may join the running batch (a job for the resident model, whose forwards pack)."""
    model = worker.model
    return (
        not isinstance(job, tuple)
        and job is not None
        and model is not None
        and (not job.req.model or job.req.model in (model.name, worker._key))
        and batchable(model)
    )


def _serial(worker, job) -> None:
    """Run ``job`` in this thread, alone (a model whose forwards do not pack: as without batching)."""
    worker.run_alone(job)
    worker._close_ended()


def run_batched(worker) -> None:
    """The model thread's loop with batching (module docstring); ends when the worker stops and the batch drained."""
    held = None  # an item taken off the queue that waits for the batch to drain
    while True:
        lanes = worker.batcher.lanes if worker.batcher is not None else []
        if worker._stop:
            for job in worker.running:
                job.cancel.set()
        if lanes:
            while held is None and not worker._stop:
                try:
                    item = worker._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    worker._stop = True
                elif not _joins(worker, item):
                    held = item
                elif _prepare(worker, item) is not None:
                    if _fits(worker, item):
                        _admit(worker, worker.model, item)
                    else:
                        held = item
            worker.batcher.step()
            continue
        if worker._stop:
            break
        if held is not None:
            item, held = held, None
        else:
            try:
                item = worker._q.get(timeout=1.0)
            except queue.Empty:
                worker._maybe_unload()
                if worker.model is None:
                    worker.batcher = None  # (it holds the model: let an unloaded one go)
                continue
        if item is None:
            break
        if isinstance(item, tuple) and item[0] == "call":
            try:
                item[2].set_result(item[1]())
            except BaseException as exc:  # noqa: BLE001 — handed to the caller
                item[2].set_exception(exc)
        elif isinstance(item, tuple):
            worker._ensure(item[1], quiet=True)
        elif item.kv_bytes is not None or _prepare(worker, item) is not None:
            if batchable(worker.model):
                _admit(worker, worker.model, item)
            else:
                _serial(worker, item)
