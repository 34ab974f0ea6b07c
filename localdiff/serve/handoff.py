"""A queued generation (:class:`Job`) and the hand-off of its events from the model worker's thread to the server's
event loop: one ``call_soon_threadsafe`` per burst of events (:meth:`Job.post`, :meth:`Job.wake`), read by the HTTP
side with :meth:`Job.batch`. The events and when the worker wakes the loop: :mod:`localdiff.serve.worker`."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from localdiff.serve.inbox import Flag, Inbox
from localdiff.serve.options import GenRequest
from localdiff.serve.spent import Spent


@dataclass
class Job:
    """One queued generation: the request, where its events go, and its cancel flag."""

    req: GenRequest
    loop: asyncio.AbstractEventLoop
    events: Inbox = field(default_factory=Inbox)
    cancel: Flag = field(default_factory=Flag)
    steps: int = 0  # denoising steps begun so far (tests read it to see a cancelled job stop)
    began: float = 0.0  # time.monotonic() at the first step (streamed requests)
    finished: Flag = field(default_factory=Flag)
    model: object = None  # the Model that runs it (set when it starts)
    seed: int | None = None  # the seed actually used
    prompt_tokens: int = 0  # the prompt's length in tokens, counted once when the job starts (for ``usage``)
    load_seconds: float = 0.0  # loading the model it names, when it was not resident (Ollama's load_duration)
    held: list = field(default_factory=list)  # events already taken off the queue by the handler (asgi.py)
    stopping: bool = False  # cancelled by the server's shutdown (a 503, not the client's 499)
    kv_bytes: int | None = None  # its KV-cache estimate once the batch loop prepared it (serve/batching.py)
    lane: object = None  # its localdiff.engine.batch.Lane when it ran in a batch (``lane.stats()``)
    spent: Spent | None = None  # the worker's own accounting (set at the first step; complete once the job ended)
    _pending: list = field(default_factory=list)
    _leads: int = 0  # pending events that wait for a later one (``post(lead=True)``)
    _scheduled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, item: tuple, wake: bool = True, lead: bool = False) -> None:
        """Hand an event to the HTTP side (thread-safe). Wakes the loop once per burst: while a hand-off is
        scheduled and not yet run, later events join it; with ``wake=False`` the event waits for the next
        :meth:`wake` (the worker wakes the loop before each denoising step and at the end, so everything the engine
        yields between two steps travels in one hand-off). With ``lead=True`` (and no wake) it also waits for the
        next event posted after it: a :meth:`wake` with only such events pending does nothing (the stream's
        ``start`` rides with the first text, step event or error instead of costing a wake-up of its own)."""
        with self._lock:
            self._pending.append(item)
            self._leads += lead
        if wake and not lead:
            self.wake()

    def wake(self, leads: bool = False) -> None:
        """Schedule one hand-off of the pending events to the loop (no-op when none are pending but ``lead``
        ones, or one is already scheduled); ``leads=True``: ``lead`` events alone are worth it too. Called by the
        worker thread only (before every denoising step): with nothing pending it returns without the lock (only
        this thread adds events; the loop only empties the list)."""
        if not self._pending:
            return
        with self._lock:
            if leads:
                self._leads = 0
            if self._scheduled or len(self._pending) <= self._leads:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _flush(self) -> None:  # on the loop
        with self._lock:
            items, self._pending, self._scheduled, self._leads = self._pending, [], False, 0
        for item in items:
            self.events.put_nowait(item)

    async def batch(self) -> list[tuple]:
        """The events ready now, oldest first (waits for at least one)."""
        if self.held:
            out, self.held = self.held, []
            return out
        out = [await self.events.get()]
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out
