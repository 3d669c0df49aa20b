"""The few event-loop services the I/O layer needs, for asyncio (uvloop included) and trio.

aioexperts never starts an event loop; it adapts to the one it is awaited from. The I/O layer
needs: run a callback soon on the loop thread (once per tick, to batch submissions), run one from
another thread, watch a file descriptor for readability (the io_uring eventfd), and an event
that many tasks can wait on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio

__all__ = ("AsyncEvent", "LoopAdapter", "current_loop", "wait_through_cancellation")

log = logging.getLogger("aioexperts")


class AsyncEvent(Protocol):
    """An event many tasks can wait on; ``set`` is called on the loop thread."""

    def set(self) -> None: ...
    def is_set(self) -> bool: ...
    async def wait(self) -> Any: ...


class LoopAdapter(ABC):
    """The event-loop services the I/O layer uses; one instance per store."""

    #: ``"asyncio"`` or ``"trio"``.
    name: str

    @abstractmethod
    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread after the current step (not re-entrantly).

        Callbacks should not raise; one that does is logged and the loop goes on, on every loop
        (trio would otherwise abort the whole run with ``TrioInternalError``).
        """

    @abstractmethod
    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Like :meth:`call_soon`, from any thread."""

    @abstractmethod
    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop thread whenever ``fd`` is readable."""

    @abstractmethod
    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd``; call before closing it."""

    @abstractmethod
    def new_event(self) -> AsyncEvent:
        """A fresh :class:`AsyncEvent`."""

    @abstractmethod
    def current_task(self) -> object:
        """The task running now (a hashable identity), for per-task bookkeeping."""

    @abstractmethod
    def is_current(self) -> bool:
        """True when called from this adapter's loop (thread and loop both match)."""


def _guarded(callback: Callable[[], None]) -> None:
    """Run ``callback``; log what it raises instead of letting it reach trio's run loop."""
    try:
        callback()
    except Exception:
        log.exception("an I/O callback raised; the event loop goes on")


class _AsyncioLoop(LoopAdapter):
    name = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.loop.call_soon(_guarded, callback)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(_guarded, callback)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.loop.add_reader(fd, _guarded, callback)

    def remove_reader(self, fd: int) -> None:
        self.loop.remove_reader(fd)

    def new_event(self) -> AsyncEvent:
        return asyncio.Event()

    def current_task(self) -> object:
        return asyncio.current_task(self.loop)

    def is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False


class _TrioLoop(LoopAdapter):
    name = "trio"

    def __init__(self) -> None:
        import trio

        self._trio = trio
        self._token = trio.lowlevel.current_trio_token()
        self._readers: dict[int, Any] = {}

    def call_soon(self, callback: Callable[[], None]) -> None:
        # trio turns an exception escaping a run_sync_soon callback into TrioInternalError
        self._token.run_sync_soon(_guarded, callback)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        self._token.run_sync_soon(_guarded, callback)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        trio = self._trio
        scope = trio.CancelScope()

        async def watch() -> None:
            # a system task must never raise: trio would tear down the whole run
            with scope:
                try:
                    while not scope.cancel_called:
                        await trio.lowlevel.wait_readable(fd)
                        _guarded(callback)
                except (trio.ClosedResourceError, OSError):  # the fd was closed under us: we are done
                    pass
                except Exception:  # anything else would abort the run
                    log.exception("the reader of fd %d failed; it stops watching", fd)

        self._readers[fd] = scope
        trio.lowlevel.spawn_system_task(watch, name=f"aioexperts-reader-{fd}")

    def remove_reader(self, fd: int) -> None:
        scope = self._readers.pop(fd, None)
        if scope is not None:
            self._trio.lowlevel.notify_closing(fd)
            scope.cancel()

    def new_event(self) -> AsyncEvent:
        return self._trio.Event()

    def current_task(self) -> object:
        return self._trio.lowlevel.current_task()

    def is_current(self) -> bool:
        try:
            return bool(self._trio.lowlevel.current_trio_token() is self._token)
        except RuntimeError:
            return False


def current_loop() -> LoopAdapter:
    """The adapter for the event loop running in this thread.

    Raises:
        RuntimeError: no supported event loop is running here.
    """
    try:
        return _AsyncioLoop(asyncio.get_running_loop())
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return _TrioLoop()
    raise RuntimeError("aioexperts must be used from a running asyncio (or uvloop) or trio event loop")


async def wait_through_cancellation(
    wait: Callable[[], Awaitable[object]], done: Callable[[], bool] | None = None
) -> BaseException | None:
    """Await ``wait()`` to its end, shielded; return the cancellation that arrived meanwhile, or None.

    anyio and trio cancel scopes never interrupt a shielded wait, but a plain asyncio
    ``Task.cancel()`` (an ``asyncio.wait_for`` timeout) does: the wait is then started again, as
    often as it takes, until ``done()`` says that what it waits for has finished. ``done`` is
    looked at before every wait, so once it is true no further wait starts: a wait on something
    finished still passes a checkpoint (``Event.wait()`` of a set event, ``to_thread.run_sync``),
    where a canceller that cancels the task again each time it wakes (one ``Task.cancel()`` per
    loop tick) would otherwise interrupt it every time and keep the task spinning for ever.
    Without ``done``, ``wait()`` must return without awaiting once its condition holds (as
    ``ReadScheduler.wait_idle`` does). The caller re-raises what is returned once it is safe
    (memory the kernel or a worker thread may still use is no longer at stake).
    """
    held: BaseException | None = None
    while done is None or not done():
        try:
            with anyio.CancelScope(shield=True):
                await wait()
            return held
        except anyio.get_cancelled_exc_class() as exc:
            held = exc
    return held
