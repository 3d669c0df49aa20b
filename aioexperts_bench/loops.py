"""Run the benches' coroutines on asyncio, uvloop or trio, and measure what one await costs on each.

The library never starts an event loop; the CLI does, here. ``uvloop`` is the CLI's default.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ("LOOPS", "await_cost", "run")

#: Event loops the CLI can run on (``--loop``).
LOOPS = ("uvloop", "asyncio", "trio")
T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], *args: Any, loop: str = "uvloop") -> T:
    """``fn(*args)`` on a fresh event loop of kind ``loop``.

    Raises:
        ValueError: an unknown loop name.
        ImportError: trio (or uvloop) is not installed.
    """
    if loop == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    if loop == "asyncio":
        return anyio.run(fn, *args, backend="asyncio")
    if loop == "trio":
        return anyio.run(fn, *args, backend="trio")
    raise ValueError(f"unknown event loop {loop!r}; choose from {', '.join(LOOPS)}")


async def _await_cost(n: int) -> dict[str, float]:
    checkpoint = anyio.lowlevel.checkpoint
    for _ in range(1000):
        await checkpoint()
    t0 = time.perf_counter()
    for _ in range(n):
        await checkpoint()
    yield_s = (time.perf_counter() - t0) / n

    event_s = 0.0
    rounds = max(1, n // 10)
    t0 = time.perf_counter()
    for _ in range(rounds):
        event = anyio.Event()

        async def setter(event: anyio.Event = event) -> None:
            event.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(setter)
            await event.wait()
    event_s = (time.perf_counter() - t0) / rounds
    return {"yield_us": yield_s * 1e6, "task_event_us": event_s * 1e6}


def await_cost(loop: str, n: int = 100_000) -> dict[str, float]:
    """Microseconds per await on ``loop``.

    Returns:
        ``yield_us``: one ``await anyio.lowlevel.checkpoint()`` (a trip through the loop);
        ``task_event_us``: start a task that sets an event, await the event, join the task.
    """
    return run(_await_cost, n, loop=loop)
