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
import traceback
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
        "aioexperts/testing/_fake_backend.py",
        frozenset({"_complete"}),
        "sync by design: the scriptable test backend (aioexperts.testing.FakeBackend) reads with pread on "
        "the loop thread when it delivers a completion (small test files; its docstring says so); the "
        "store's code around it still counts",
    ),
    (
        "logging/__init__.py",
        frozenset({"emit"}),
        "not the library's call: a logging handler writes where the application configured it (here the "
        "stderr pytest captures); the library logs rare events (a fallback, a warning) from the loop, as "
        "asyncio itself does",
    ),
    (
        "aioexperts/_compute/pool.py",
        frozenset({"_limit_native_threads"}),
        "KNOWN DEFECT, not by design: the process-wide compute pool is made on first use, on the loop's "
        "thread, and threadpoolctl reads files there (once per process). Moving the cap into the first "
        "worker left BLAS uncapped (tests/compute/test_pool.py); to fix with the pool's owner",
    ),
)

#: the folders whose async tests run with the check (the store, the model)
SCOPE = ("tests/store/", "tests/model/")

#: the folders whose every test runs with the check: the server's event loop runs in a thread of its
#: own (tests/serve/serving.py) while the test itself is sync
SCOPE_EVERY_TEST = ("tests/serve/",)

#: tests that block the loop on purpose: ``(file::test name, why)``
BLOCKS_ON_PURPOSE: tuple[tuple[str, str], ...] = ()

#: not library code: the test helpers (writing a model file is sync by design); the library code they
#: call still counts
EXCLUDED = ["aioexperts.testing"]

#: the library's own blocking calls that blockbuster does not watch by itself
EXTRA_CALLS = ("os.pread", "os.preadv", "os.readv", "os.open", "os.fstat", "os.posix_fadvise")


@contextmanager
def no_blocking_calls() -> Iterator[None]:
    """Fail (``blockbuster.BlockingError``) any blocking call made on the loop thread by ``aioexperts``.

    A ``BlockingError`` that the code caught (an I/O callback's guard, a server's error response)
    fails the block too, when it ends: each is recorded as it is made.
    """
    from blockbuster import BlockBuster, BlockBusterFunction, BlockingError

    raised: list[str] = []
    init = BlockingError.__init__

    def recording_init(self: BlockingError, *args: object) -> None:
        init(self, *args)
        raised.append(f"{self}\n{''.join(traceback.format_stack(limit=14)[:-1])}")

    buster = BlockBuster(scanned_modules=["aioexperts"], excluded_modules=EXCLUDED)
    for name in EXTRA_CALLS:
        buster.functions[name] = BlockBusterFunction(
            None, name, scanned_modules=["aioexperts"], excluded_modules=EXCLUDED
        )
    for function in buster.functions.values():
        for filename, functions, _why in ALLOWED:
            function.can_block_in(filename, functions)
    BlockingError.__init__ = recording_init  # type: ignore[method-assign]
    buster.activate()
    try:
        yield
    finally:
        buster.deactivate()
        BlockingError.__init__ = init  # type: ignore[method-assign]
    if raised:
        raise AssertionError(f"{len(raised)} blocking call(s) on the loop were caught by the code:\n" + raised[0])


def _checked(request: pytest.FixtureRequest) -> bool:
    path = request.node.path.as_posix()
    if any(f"{path}::{request.node.originalname}".endswith(name) for name, _why in BLOCKS_ON_PURPOSE):
        return False
    if any(folder in path for folder in SCOPE_EVERY_TEST):
        return True
    return any(folder in path for folder in SCOPE) and inspect.iscoroutinefunction(getattr(request, "function", None))


@pytest.fixture(autouse=True)
def blockbuster(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every async test of the folders in :data:`SCOPE`, and every test of :data:`SCOPE_EVERY_TEST`,
    runs with :func:`no_blocking_calls` (except :data:`BLOCKS_ON_PURPOSE`)."""
    if not _checked(request):
        yield
        return
    with no_blocking_calls():
        yield
