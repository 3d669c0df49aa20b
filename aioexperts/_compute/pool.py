"""A bounded compute pool: MoE compute off the event loop, never more threads than cores.

One process-wide :class:`ComputePool` (:func:`compute_pool`) of ``n_threads`` workers, by default
one per core this process may run on (``os.sched_getaffinity``; ``$AIOEXPERTS_COMPUTE_THREADS``
overrides). Two ways in:

* ``await pool.run(fn, *args)`` from the event loop: ``fn`` is queued (first come, first served)
  and runs on a worker; at most ``n_threads`` such jobs run at once, so 16 concurrent tokens do not
  start 16 threads that fight over 2 cores.
* ``pool.map(fn, items)`` from inside a job (or any thread): the items are shared between the
  calling thread and the workers that are idle right now. One token alone uses every core (its
  experts spread over the workers); many tokens at once each run on their own worker, and their
  fan-outs find no idle worker and run inline. Either way at most ``n_threads`` threads compute.

Native thread pools are capped to one thread per call while the pool lives (BLAS and OpenMP,
through ``threadpoolctl``): the pool's workers are the parallelism, and a BLAS call that started
its own threads in each worker would oversubscribe the cores (measured before this pool: 16
concurrent tokens 6x slower per token than with one BLAS thread, docs/notes/KERNELS.md pitfall 6). The numba
kernels are single-threaded (``nogil``, no ``parallel=True``): numba's threading layer is never
started, which also avoids OpenMP's stalls on a shared 2-core machine (pitfall 5).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._errors import ConfigError, StoreClosedError
from .._io.loop import current_loop, wait_through_cancellation

__all__ = ("THREADS_ENV", "ComputePool", "PoolStatistics", "compute_pool", "configure_compute_pool", "split_ranges")

log = logging.getLogger("aioexperts")

THREADS_ENV = "AIOEXPERTS_COMPUTE_THREADS"
#: threads each native library (BLAS, OpenMP) may use per call while a pool lives
NATIVE_THREADS_PER_CALL = 1

R = TypeVar("R")
I = TypeVar("I")  # noqa: E741


def default_threads() -> int:
    """``$AIOEXPERTS_COMPUTE_THREADS``, else the cores this process may run on.

    Raises:
        ConfigError: the variable is set but not an integer >= 1.
    """
    value = os.environ.get(THREADS_ENV)
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{THREADS_ENV} must be an integer >= 1, got {value!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """Counters of a :class:`ComputePool` (a snapshot).

    Attributes:
        n_threads: worker threads.
        jobs: jobs run to completion (or failure) by :meth:`ComputePool.run`.
        dropped: jobs cancelled while still queued (never run).
        maps: :meth:`ComputePool.map` calls with more than one item.
        items_helped: map items run by a worker other than the calling thread.
        queued: jobs waiting now.
    """

    n_threads: int
    jobs: int
    dropped: int
    maps: int
    items_helped: int
    queued: int


class _Job(Generic[R]):
    """One ``run`` call: queued, then run by a worker, then done (result or exception)."""

    __slots__ = ("args", "error", "fn", "notify", "result", "started")

    def __init__(self, fn: Callable[..., R], args: tuple[Any, ...], notify: Callable[[], None]) -> None:
        self.fn = fn
        self.args = args
        self.notify = notify
        self.started = False
        self.result: R | None = None
        self.error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # delivered to the awaiting task
            self.error = exc

    def wake(self) -> None:
        try:
            self.notify()
        except RuntimeError:  # the event loop was closed under the job: nobody waits any more
            pass


class _Batch(Generic[I, R]):
    """The items of one ``map`` call; any thread may claim the next item (under the pool lock)."""

    __slots__ = ("done", "errors", "fn", "items", "next", "remaining", "results")

    def __init__(self, fn: Callable[[I], R], items: Sequence[I]) -> None:
        self.fn = fn
        self.items = items
        self.next = 0
        self.remaining = len(items)
        self.results: list[Any] = [None] * len(items)
        self.errors: list[BaseException] = []
        self.done = threading.Event()

    def run_item(self, i: int, lock: threading.Lock) -> None:
        try:
            self.results[i] = self.fn(self.items[i])
        except BaseException as exc:  # re-raised by the caller of map
            with lock:
                self.errors.append(exc)
        with lock:
            self.remaining -= 1
            finished = self.remaining == 0
        if finished:
            self.done.set()


class ComputePool:
    """Worker threads for compute, shared by every runner of the process (see the module docstring).

    Args:
        n_threads: workers (>= 1); default :func:`default_threads`.
        limit_native_threads: cap BLAS/OpenMP to one thread per call while the pool lives.

    Raises:
        ConfigError: ``n_threads`` < 1.
    """

    def __init__(self, n_threads: int | None = None, *, limit_native_threads: bool = True) -> None:
        n = default_threads() if n_threads is None else n_threads
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n_threads must be an int >= 1, got {n_threads!r}")
        self._n = n
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._jobs: collections.deque[_Job[Any]] = collections.deque()
        self._batches: collections.deque[_Batch[Any, Any]] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._counts = {"jobs": 0, "dropped": 0, "maps": 0, "items_helped": 0}
        self._limits: Any = None
        if limit_native_threads:
            self._limits = _limit_native_threads()

    @property
    def n_threads(self) -> int:
        """Worker threads."""
        return self._n

    def statistics(self) -> PoolStatistics:
        """A snapshot of the counters."""
        with self._lock:
            return PoolStatistics(self._n, queued=len(self._jobs), **self._counts)

    # -- async face -----------------------------------------------------------------------------

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(*args)`` on a worker and return its result (or raise its exception).

        Jobs start in the order they were submitted, at most ``n_threads`` at a time.

        Raises:
            StoreClosedError: the pool is closed.
            Whatever ``fn`` raises.

        Cancellation handling:
            A job cancelled while queued is dropped and never runs. A job already running is not
            abandoned: the caller waits (shielded) until it has finished, then the cancellation
            propagates; ``fn`` may read memory that the caller frees afterwards (pinned slots).
        """
        loop = current_loop()
        done = loop.new_event()  # the loop's own event (asyncio.Event, trio.Event): no anyio layer per job
        job: _Job[R] = _Job(fn, args, lambda: loop.call_soon_threadsafe(done.set))
        with self._lock:
            if self._closed:
                raise StoreClosedError("the compute pool is closed")
            self._start_threads()
            self._jobs.append(job)
            self._work.notify()
        try:
            await done.wait()
        except BaseException:
            with self._lock:
                queued = not job.started
                if queued:
                    self._jobs.remove(job)
                    self._counts["dropped"] += 1
            if not queued:
                await wait_through_cancellation(done.wait, done.is_set)  # a second Task.cancel() is held too
            raise
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    # -- fan-out --------------------------------------------------------------------------------

    def map(self, fn: Callable[[I], R], items: Iterable[I]) -> list[R]:
        """``[fn(item) for item in items]``, spread over the calling thread and idle workers.

        The calling thread runs items too, so ``map`` from inside a job never waits for a worker
        that is busy with another job (no deadlock, no extra threads). Results keep the order of
        ``items``.

        Raises:
            The first exception an item raised (after every item has finished).
        """
        seq = list(items)
        if len(seq) <= 1 or self._n <= 1 or self._closed:
            return [fn(item) for item in seq]
        batch: _Batch[I, R] = _Batch(fn, seq)
        with self._lock:
            self._counts["maps"] += 1
            self._start_threads()
            self._batches.append(batch)
            self._work.notify(min(len(seq) - 1, self._n))
        while True:
            with self._lock:
                i = self._claim(batch)
            if i is None:
                break
            batch.run_item(i, self._lock)
        batch.done.wait()
        if batch.errors:
            raise batch.errors[0]
        return batch.results

    def _claim(self, batch: _Batch[Any, Any]) -> int | None:
        """Next unclaimed item of ``batch`` (lock held); the batch leaves the queue when exhausted."""
        if batch.next >= len(batch.items):
            return None
        i = batch.next
        batch.next += 1
        if batch.next == len(batch.items) and self._batches and self._batches[0] is batch:
            self._batches.popleft()
        elif batch.next == len(batch.items):
            self._batches.remove(batch)
        return i

    # -- workers --------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        """Start the workers on first use (lock held)."""
        if self._threads:
            return
        for k in range(self._n):
            thread = threading.Thread(target=self._worker, name=f"aioexperts-compute-{k}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._batches and not self._jobs and not self._closed:
                    self._work.wait()
                if self._batches:  # fan-out items first: they belong to a job already running
                    batch = self._batches[0]
                    i = self._claim(batch)
                    self._counts["items_helped"] += i is not None
                    job = None
                elif self._jobs:
                    job = self._jobs.popleft()
                    job.started = True
                    batch, i = None, None
                else:  # closed and idle
                    return
            if job is not None:
                job.execute()
                with self._lock:
                    self._counts["jobs"] += 1
                job.wake()
            elif batch is not None and i is not None:
                batch.run_item(i, self._lock)
            # an idle worker keeps nothing alive: a job's arguments (slot views) would otherwise pin
            # their memory (and keep a closed store's slab mapped) until the next job arrives
            job = batch = None

    def close(self) -> None:
        """Stop the workers once the queued jobs are done; restore native thread limits. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
        if self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None


def _limit_native_threads() -> Any:
    """Cap every native thread pool (BLAS, OpenMP) to :data:`NATIVE_THREADS_PER_CALL`; None if impossible."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # a declared dependency; kept optional so that a broken install still computes
        log.warning("threadpoolctl is missing; BLAS may start its own threads in each compute worker")
        return None
    return threadpool_limits(limits=NATIVE_THREADS_PER_CALL)


_pool_lock = threading.Lock()
_pool: ComputePool | None = None


def compute_pool() -> ComputePool:
    """The process-wide pool, created on first use with :func:`default_threads` workers."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ComputePool()
        return _pool


def configure_compute_pool(n_threads: int | None = None, *, limit_native_threads: bool = True) -> ComputePool:
    """Replace the process-wide pool (benchmarks compare 1 and 2 threads; hosts pin a size).

    The old pool finishes its queued jobs before its workers stop. Call it while no job runs.

    Raises:
        ConfigError: ``n_threads`` < 1.
    """
    global _pool
    with _pool_lock:
        old, _pool = _pool, None
    if old is not None:
        old.close()  # first: it restores the native thread limits the new pool then sets again
    new = ComputePool(n_threads, limit_native_threads=limit_native_threads)
    with _pool_lock:
        _pool = new
    return new


def split_ranges(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``min(n, parts)`` contiguous runs (at least one) whose sizes differ by
    at most one, shortest first: the work of one :meth:`ComputePool.map` item each."""
    parts = max(1, min(n, parts))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]
