"""What a job's two threads share: :class:`Inbox` (its events, read on the server's loop) and :class:`Flag` (its
cancel and finished flags), lighter than ``asyncio.Queue`` and ``threading.Event`` on a path that runs once per
request (``localdiff.serve.worker``, ``localdiff.serve.asgi``)."""

from __future__ import annotations

import asyncio
import collections
import threading


class Inbox:
    """A job's events on the server's loop, oldest first: the part of ``asyncio.Queue`` the HTTP side uses
    (unbounded, one consumer), without its task accounting — about half its cost per request. Loop thread only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        """Append ``item`` and wake the waiting :meth:`get`, if any."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def empty(self) -> bool:
        """True when no item is waiting."""
        return not self._items

    def get_nowait(self):
        """The oldest item. Raises asyncio.QueueEmpty when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty()
        return self._items.popleft()

    async def get(self):
        """The oldest item (waits for one)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Flag:
    """A one-way flag shared by the loop and the model thread: ``threading.Event``'s ``set`` / ``is_set`` / ``wait``
    without its Condition and Lock made per job (two per request were ~6 % of the event loop's busy time,
    ``py-spy`` on ``localdiff bench --only serve``): ``set`` and ``is_set`` are one attribute under the GIL; a
    ``threading.Event`` is made only for a caller that waits (tests, shutdown)."""

    __slots__ = ("_set", "_event")
    _make = threading.Lock()  # makes ``_event`` once, whichever threads wait

    def __init__(self) -> None:
        self._set, self._event = False, None

    def set(self) -> None:
        """Raise the flag and wake the waiters."""
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        """Whether the flag is up."""
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is up or ``timeout`` seconds pass; returns whether it is up."""
        if self._set:
            return True
        with Flag._make:
            if self._event is None:
                self._event = threading.Event()
        if self._set:  # set() ran before the event existed
            self._event.set()
        return self._event.wait(timeout)
