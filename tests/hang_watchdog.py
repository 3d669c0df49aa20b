"""A hang fails fast: a watchdog thread per test that ends the whole run past the test's limit.

Loaded by ``tests/conftest.py`` (and by ``-p hang_watchdog`` with ``tests/`` on the path).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from collections.abc import Iterator

import pytest

#: Seconds past a test's pytest-timeout limit after which the hang watchdog ends the whole run
#: (``$AIOEXPERTS_HANG_GRACE_S`` overrides it).
HANG_GRACE_S = float(os.environ.get("AIOEXPERTS_HANG_GRACE_S", "30"))
#: The watchdog's limit for a test whose timeout is off (``timeout(0)``).
HANG_LIMIT_UNTIMED_S = 1800.0


def time_limit_of(item: pytest.Item) -> float:
    """The pytest-timeout limit of ``item`` in seconds (its ``timeout`` marker, else the ini value); 0 = none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else 0)
    else:
        value = item.config.getini("timeout") or 0
    return float(value or 0)


def _end_hung_run(item: pytest.Item, limit: float) -> None:
    """Watchdog thread: the test outlived its limit and the grace: dump every thread and exit the process."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:  # restore the real stderr (as pytest-timeout's thread method does)
        capman.suspend_global_capture(in_=True)
    nodeid = item.nodeid
    sys.stderr.write(f"\nHANG: {nodeid} still running {limit:.0f} s after it started; ending the run (exit 3)\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    _dump_asyncio_tasks()
    sys.stderr.flush()
    os._exit(3)


def _dump_asyncio_tasks() -> None:
    """Every live asyncio task's stack (where a task that ignores its cancellation waits); best effort."""
    try:
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and not o.is_closed()]
        for loop in loops:
            for task in list(asyncio.all_tasks(loop)):
                sys.stderr.write(f"\n-- asyncio task {task!r}\n")
                task.print_stack(file=sys.stderr)
    except Exception as exc:  # the loop's thread runs on: its state may change under us
        sys.stderr.write(f"(asyncio tasks not dumped: {exc!r})\n")
    sys.stderr.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A hang fails fast, whatever the event loop is doing.

    pytest-timeout's signal method raises ``Failed`` in the main thread; when that lands inside an
    asyncio task step the task swallows it (``Task.__step`` keeps a ``BaseException`` as the task's
    result) and a loop that waits for a task ignoring its cancellation sits forever. This timer
    thread fires regardless: ``HANG_GRACE_S`` after the test's own limit it dumps every thread's
    stack and ends the process with exit code 3, so CI fails at once instead of hanging.
    """
    limit = time_limit_of(item)
    limit = (limit + HANG_GRACE_S) if limit > 0 else HANG_LIMIT_UNTIMED_S
    timer = threading.Timer(limit, _end_hung_run, args=(item, limit))
    timer.daemon = True
    timer.name = "hang-watchdog"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
