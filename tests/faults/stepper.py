"""Cancel a call at its n-th await point, deterministically, on asyncio, uvloop and trio.

:class:`Stepper` awaits a coroutine on behalf of a task and counts the times it suspends (gives
control back to the event loop); at each suspension it calls ``at_step(n)``, *before* the
suspension reaches the loop. A test that cancels there (an anyio cancel scope's ``cancel()``, or
asyncio's ``Task.cancel()`` of the running task) has the cancellation delivered at exactly that
await point: asyncio cancels the future the task waits on, trio delivers a pending cancel as soon
as the task blocks. Counting suspensions rather than loop ticks makes the enumeration independent
of how long worker threads take.

:func:`cancellation_point` names where a cancellation exception was raised: the innermost frames of
the ``aioexperts`` package in its traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from types import TracebackType
from typing import Any

import aioexperts

PACKAGE_DIR = str(Path(aioexperts.__file__).resolve().parent)


class Stepper:
    """``await Stepper(coro, at_step)``: run ``coro``; call ``at_step(n)`` at its n-th suspension (n >= 1).

    Attributes:
        steps: suspensions so far.
    """

    def __init__(self, coro: Coroutine[Any, Any, Any], at_step: Callable[[int], None]) -> None:
        self.coro = coro
        self.at_step = at_step
        self.steps = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            self.steps += 1
            self.at_step(self.steps)
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation (or anything thrown in): pass it on
                error = exc


#: Pass-through frames, named by their callers instead: the compute pool, and the shielded wait.
PASS_THROUGH = (
    (os.path.join("_compute", "pool.py"), None),
    # the sources forward acquire() to their cache: the await point is the cache's
    (os.path.join("_sources", "slab.py"), "acquire"),
    (os.path.join("_sources", "mapped.py"), "acquire"),
    (os.path.join("_io", "loop.py"), "wait_through_cancellation"),
)


def _frames(tb: TracebackType | None) -> list[tuple[str, str]]:
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append((code.co_filename, code.co_name))
        tb = tb.tb_next
    return out


def cancellation_point(exc: BaseException) -> str:
    """``"caller>callee"``: the two innermost ``aioexperts`` functions the exception was raised through.

    ``"outside"`` when no frame of the package is in the traceback (the cancellation hit the test's
    own code, e.g. the body of an ``experts()`` block that the context manager had left already).
    """
    names = [
        name
        for filename, name in _frames(exc.__traceback__)
        if filename.startswith(PACKAGE_DIR)
        and not any(filename.endswith(f) and fn in (None, name) for f, fn in PASS_THROUGH)
    ]
    if not names:
        return "outside"
    return ">".join(names[-2:])
