"""Admission of generations: ``parallel`` run at once, a bounded first-come-first-served queue for more.

Each admitted request decodes its own sequence (its own KV cache) in its own task; the sequences
that run at the same time share the model, whose compute goes through the bounded compute pool, so
any ``parallel`` keeps the cores from being oversubscribed. A request arriving when ``parallel``
run and ``queue_size`` wait is refused at once (503, ``queue_full``), never held without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ._errors import APIError

__all__ = ("Scheduler",)


def _busy(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


class Scheduler:
    """Slots for ``parallel`` generations and a FIFO queue of ``queue_size`` waiting ones.

    Args:
        parallel: generations that run at once (``>= 1``).
        queue_size: requests that may wait for a slot (``>= 0``).

    Attributes:
        running: generations holding a slot now.
        admitted: requests given a slot since the start.
        rejected: requests refused because the queue was full or the server was stopping.
        queue_seconds: total time admitted requests waited in the queue.
    """

    def __init__(self, parallel: int, queue_size: int) -> None:
        self.parallel = parallel
        self.queue_size = queue_size
        self.running = 0
        self.admitted = 0
        self.rejected = 0
        self.queue_seconds = 0.0
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._tasks: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()
        self._closed = False

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for f in self._waiters if not f.done())

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with`` (the caller's task is tracked for :meth:`drain`).

        Raises:
            APIError: 503 ``queue_full`` when the queue is full, 503 ``shutting_down`` after :meth:`close`.
        """
        if self._closed:
            self.rejected += 1
            raise _busy("the server is shutting down", "shutting_down")
        if self.running < self.parallel and not self.queued:
            self.running += 1
        else:
            if self.queued >= self.queue_size:
                self.rejected += 1
                raise _busy(
                    f"the server is busy: {self.running} running and {self.queued} waiting "
                    f"(--parallel {self.parallel}, --queue {self.queue_size}); retry later",
                    "queue_full",
                )
            await self._wait_for_slot()
        self.admitted += 1
        self._idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            yield
        finally:
            if task is not None:
                self._tasks.discard(task)
            self._release()

    async def _wait_for_slot(self) -> None:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        t0 = time.perf_counter()
        try:
            granted = await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.result():
                self._release()  # handed a slot while being cancelled: pass it on
            else:
                fut.cancel()
            raise
        finally:
            self.queue_seconds += time.perf_counter() - t0
        if not granted:
            self.rejected += 1
            raise _busy("the server is shutting down", "shutting_down")

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)  # the slot goes to the next in line; running stays the same
                return
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    def close(self) -> None:
        """Admit nothing more: queued requests are refused (503 ``shutting_down``); running ones go on."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)

    def hurry(self) -> None:
        """End the wait of a :meth:`drain` under way (or to come) now: the running generations are cancelled."""
        self._hurry.set()

    async def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds (less after :meth:`hurry`) for the running generations to end,
        then cancel the rest.

        Returns:
            How many generations were cancelled.
        """
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())]
        try:
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._idle.is_set():
            return 0
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.wait_for(self._idle.wait(), None)
        return len(tasks)
