"""A blocking call on the event loop's thread from ``aioexperts`` code fails the test (``blockbuster``).

:func:`no_blocking_calls` wraps blockbuster's detectors (``time.sleep``, ``os.read``/``os.write``,
``os.stat`` and friends, file object reads and writes, sockets, a contended ``threading.Lock``) and
adds the calls this library could make on the loop by mistake: ``os.pread``, ``os.preadv``,
``os.readv``, ``os.open``, ``os.fstat``, ``os.posix_fadvise``. A call counts only when it runs on a
thread with a running asyncio loop (asyncio and uvloop; blockbuster cannot see trio's loop) and
``aioexperts`` code is on its stack; worker threads are free to block.

:data:`ALLOWED` is the allow-list: functions that are sync by design, each with its reason. A call
found outside it is a defect to fix (or to report), not a line to add here; the one entry that is
a defect says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

#: ``(file, functions, why)``: where a blocking call on the loop thread is allowed.
ALLOWED: tuple[tuple[str, frozenset[str], str], ...] = (
    (
        "aioexperts/_format/model.py",
        frozenset({"open_model"}),
        "sync by design: parses a header with pread (aioexperts.open calls it in a worker thread; "
        "a host may call it anywhere)",
    ),
    (
        "aioexperts/_format/expert_map.py",
        frozenset({"write_expert_map"}),
        "sync by design: writes a map file (aioexperts-map, or a host preparing a model before serving it)",
    ),
    (
        "aioexperts/_compute/pool.py",
        frozenset({"_limit_native_threads"}),
        "KNOWN DEFECT, not by design: the process-wide compute pool is made on first use, on the loop's "
        "thread, and threadpoolctl reads files there (once per process). Moving the cap into the first "
        "worker left BLAS uncapped (tests/compute/test_pool.py); to fix with the pool's owner",
    ),
)

#: the test files whose async tests run with the check (narrow for now: the rest of tests/store and
#: tests/model still meet blocking calls or hang under it; see the list in CHANGELOG.md, issue 17)
SCOPE = ("tests/store/test_api.py", "tests/store/test_asyncio_usage.py")

#: not library code: the test helpers (writing a model file is sync by design); the library code they
#: call still counts
EXCLUDED = ["aioexperts.testing"]

#: the library's own blocking calls that blockbuster does not watch by itself
EXTRA_CALLS = ("os.pread", "os.preadv", "os.readv", "os.open", "os.fstat", "os.posix_fadvise")


@contextmanager
def no_blocking_calls() -> Iterator[None]:
    """Fail (``blockbuster.BlockingError``) any blocking call made on the loop thread by ``aioexperts``."""
    from blockbuster import BlockBuster, BlockBusterFunction

    buster = BlockBuster(scanned_modules=["aioexperts"], excluded_modules=EXCLUDED)
    for name in EXTRA_CALLS:
        buster.functions[name] = BlockBusterFunction(
            None, name, scanned_modules=["aioexperts"], excluded_modules=EXCLUDED
        )
    for function in buster.functions.values():
        for filename, functions, _why in ALLOWED:
            function.can_block_in(filename, functions)
    buster.activate()
    try:
        yield
    finally:
        buster.deactivate()


@pytest.fixture(autouse=True)
def blockbuster(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every async test of the files in :data:`SCOPE` runs with :func:`no_blocking_calls`."""
    path = request.node.path.as_posix()
    in_scope = any(path.endswith(name) for name in SCOPE)
    if not in_scope or not inspect.iscoroutinefunction(getattr(request, "function", None)):
        yield
        return
    with no_blocking_calls():
        yield
