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

While a job submitted with ``spin=True`` runs (the resident decode pass: every expert in memory,
no read in flight), an idle worker spins for a short while (``$AIOEXPERTS_COMPUTE_SPIN_US``,
default :data:`DEFAULT_SPIN_US` microseconds, 0: never, at most :data:`MAX_SPIN_US`) before it
sleeps, and so does a ``map`` caller waiting for its helpers' items: the job's next fan-out then
starts without a futex wake-up (about 50 us each on the 2-vCPU machines here, a few hundred per
decode token). The spin polls a counter in compiled code without the GIL
(:mod:`aioexperts._compute.kernels.spin`). Other jobs never spin: under a memory limit the event
loop needs the cores between compute jobs to read (spinning there measured slower), and with
numba unavailable the threads sleep at once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .._errors import ConfigError, StoreClosedError
from .._io.loop import current_loop, wait_through_cancellation

__all__ = (
    "DEFAULT_SPIN_US",
    "MAX_SPIN_US",
    "MAX_THREADS",
    "SPIN_ENV",
    "THREADS_ENV",
    "ComputePool",
    "PoolStatistics",
    "compute_pool",
    "configure_compute_pool",
)

log = logging.getLogger("aioexperts")

THREADS_ENV = "AIOEXPERTS_COMPUTE_THREADS"
#: the most workers a pool takes: far past any core count this runs on, well below the threads a
#: process can start (a larger count failed at the first job with a RuntimeError traceback)
MAX_THREADS = 1024
SPIN_ENV = "AIOEXPERTS_COMPUTE_SPIN_US"
#: microseconds an idle worker or a waiting ``map`` caller spins before it sleeps (while a ``spin`` job runs)
DEFAULT_SPIN_US = 1000
#: the longest spin accepted (one second): a spin is meant to bridge the gap between two fan-outs;
#: a longer one only burns a core, and past about 2**63 iterations it cannot reach the compiled loop
MAX_SPIN_US = 1_000_000
# the counters the spinning threads poll: work posted (jobs and fan-outs), fan-out items finished
_POSTED, _FINISHED = 0, 1
#: threads each native library (BLAS, OpenMP) may use per call while a pool lives
NATIVE_THREADS_PER_CALL = 1

R = TypeVar("R")
I = TypeVar("I")  # noqa: E741


def default_spin_us() -> int:
    """``$AIOEXPERTS_COMPUTE_SPIN_US``, else :data:`DEFAULT_SPIN_US` (microseconds).

    Raises:
        ConfigError: the variable is set but not an integer from 0 to :data:`MAX_SPIN_US`.
    """
    value = os.environ.get(SPIN_ENV, "").strip()
    if not value:
        return DEFAULT_SPIN_US
    try:
        us = int(value)
    except ValueError:
        us = -1
    if not 0 <= us <= MAX_SPIN_US:
        raise ConfigError(f"{SPIN_ENV} must be an integer from 0 to {MAX_SPIN_US} (microseconds), got {value!r}")
    return us


#: ``spin(signal, index, seen, max_iters) -> value read last`` (kernels/spin.py)
Spin = Callable[[np.ndarray, int, int, int], int]


@dataclass(frozen=True, slots=True)
class _Spinner:
    """The compiled spin and fan-out kernels of a pool (:mod:`.kernels.spin`, :mod:`.kernels.fanout`)."""

    spin: Spin  # a waiting ``map`` caller
    serve: Callable[..., int]  # an idle worker: spins and runs fan-out items
    publish: Callable[..., int]
    finish: Callable[..., int]
    fan_out: Callable[..., int]  # publish then finish in one call
    run_inline: Callable[..., int]
    iterations: int  # polls in about ``spin_us``
    limits: tuple[int, int]  # :func:`_fan_out_limits`


def _spinner(us: int) -> _Spinner | None:
    """The compiled kernels, and the iterations of a spin that last about ``us`` microseconds here
    (0 when ``us`` is 0: the threads never spin, fan-outs still run); None without compiled kernels."""
    from .jit import jit_status

    if not jit_status().available:
        return None
    try:
        from .kernels import fanout
        from .kernels.spin import spin_while_equal

        probe = np.zeros(1, dtype=np.int64)
        spin_while_equal(probe, 0, 0, 1)  # compiled (or loaded from the cache) by the calling worker
        ctrl = fanout.new_control()
        fanout.serve(ctrl, probe, 0, 0, 1)
        fanout.finish(ctrl, fanout.publish(ctrl, 0, 0, 0), 0)  # no items: returns at once
        fanout.fan_out(ctrl, 0, 0, 0)
        fanout.run_inline(0, 0, 0)
        n = 20_000
        t0 = time.perf_counter()
        spin_while_equal(probe, 0, 0, n)
        per_iteration = max(time.perf_counter() - t0, 1e-9) / n
    except Exception as exc:  # numba failing to compile: sleep at once, as without numba
        log.info("compute pool threads will not spin before they sleep: %s: %s", type(exc).__name__, exc)
        return None
    iterations = 0 if us <= 0 else min(max(1, int(us * 1e-6 / per_iteration)), 1 << 62)  # int64 loop count
    return _Spinner(
        spin_while_equal,
        fanout.serve,
        fanout.publish,
        fanout.finish,
        fanout.fan_out,
        fanout.run_inline,
        iterations,
        _fan_out_limits(),
    )


def _fan_out_limits() -> tuple[int, int]:
    """``(MAX_ITEMS, SPINNERS)`` of :mod:`.kernels.fanout` (imported here: it needs numba)."""
    from .kernels.fanout import MAX_ITEMS, SPINNERS

    return MAX_ITEMS, SPINNERS


def default_threads() -> int:
    """``$AIOEXPERTS_COMPUTE_THREADS``, else the cores this process may run on.

    Raises:
        ConfigError: the variable is set but not an integer from 1 to :data:`MAX_THREADS`.
    """
    value = os.environ.get(THREADS_ENV)
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_THREADS:
            raise ConfigError(f"{THREADS_ENV} must be an integer from 1 to {MAX_THREADS}, got {value!r}")
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
        fan_outs: :meth:`ComputePool.fan_out` calls with more than one item.
        fan_out_items_helped: fan-out items run by a worker other than the calling thread.
        fan_out_seconds: wall seconds callers spent in :meth:`ComputePool.fan_out` calls of more
            than one item, posted or run inline on the caller (another thread's fan-out in
            progress): the compiled kernels and the caller's wait for its helpers' last items (a
            decode token's products, experts and attention), summed over the callers. (``fan_outs``
            also counts calls that returned None, kernels not ready, which add no seconds.)
    """

    n_threads: int
    jobs: int
    dropped: int
    maps: int
    items_helped: int
    queued: int
    fan_outs: int = 0
    fan_out_items_helped: int = 0
    fan_out_seconds: float = 0.0


class _Job(Generic[R]):
    """One ``run`` call: queued, then run by a worker, then done (result or exception)."""

    __slots__ = ("args", "error", "fn", "notify", "result", "spin", "started")

    def __init__(self, fn: Callable[..., R], args: tuple[Any, ...], notify: Callable[[], None], spin: bool) -> None:
        self.fn = fn
        self.args = args
        self.notify = notify
        self.spin = spin
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

    def run_item(self, i: int, lock: threading.Lock, signal: np.ndarray) -> None:
        try:
            self.results[i] = self.fn(self.items[i])
        except BaseException as exc:  # re-raised by the caller of map
            with lock:
                self.errors.append(exc)
        with lock:
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()  # before the counter moves: a caller that sees it move finds the batch done
            signal[_FINISHED] += 1


class ComputePool:
    """Worker threads for compute, shared by every runner of the process (see the module docstring).

    Args:
        n_threads: workers (1 to :data:`MAX_THREADS`); default :func:`default_threads`.
        limit_native_threads: cap BLAS/OpenMP to one thread per call while the pool lives.
        spin_us: microseconds an idle worker, and a ``map`` caller waiting for its helpers, spin
            before sleeping while a ``spin`` job runs (0: never, at most :data:`MAX_SPIN_US`);
            default :func:`default_spin_us`.

    Raises:
        ConfigError: ``n_threads`` outside [1, :data:`MAX_THREADS`], ``spin_us`` outside [0, :data:`MAX_SPIN_US`].
    """

    def __init__(
        self, n_threads: int | None = None, *, limit_native_threads: bool = True, spin_us: int | None = None
    ) -> None:
        n = default_threads() if n_threads is None else n_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
            raise ConfigError(f"n_threads must be an int from 1 to {MAX_THREADS}, got {n_threads!r}")
        us = default_spin_us() if spin_us is None else spin_us
        if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= MAX_SPIN_US:
            raise ConfigError(f"spin_us must be an int from 0 to {MAX_SPIN_US} (microseconds), got {spin_us!r}")
        self._n = n
        self._spin_us = us if n > 1 else 0
        self._spin: _Spinner | None = None
        self._control = np.zeros(16, dtype=np.int64)  # the fan-out control block (kernels/fanout.py)
        self._fan_lock = threading.Lock()  # one fan-out caller at a time on the control block
        self._invited = False  # a fan-out has asked a sleeping worker to join (not yet taken)
        self._spin_known = False  # the set-up thread has set the spin up (or found it impossible)
        self._signal = np.zeros(2, dtype=np.int64)
        self._spin_jobs = 0  # ``spin`` jobs running now (threads spin only while one does)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._jobs: collections.deque[_Job[Any]] = collections.deque()
        self._batches: collections.deque[_Batch[Any, Any]] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._counts = {"jobs": 0, "dropped": 0, "maps": 0, "items_helped": 0, "fan_outs": 0}
        self._fan_out_seconds = 0.0
        self._limits: Any = None
        if limit_native_threads:
            self._limits = _limit_native_threads()

    @property
    def n_threads(self) -> int:
        """Worker threads."""
        return self._n

    @property
    def spin_us(self) -> int:
        """Microseconds a thread spins before it sleeps (0: never; see the module docstring). A
        thread of its own sets the spin up when the workers start (once, a compile or a cache load);
        if it cannot (no numba), 0 from then on."""
        with self._lock:
            return 0 if self._spin_known and (self._spin is None or not self._spin.iterations) else self._spin_us

    def statistics(self) -> PoolStatistics:
        """A snapshot of the counters."""
        from .kernels.fanout import HELPED

        with self._lock:
            return PoolStatistics(
                self._n,
                queued=len(self._jobs),
                fan_out_items_helped=int(self._control[HELPED]),
                fan_out_seconds=self._fan_out_seconds,
                **self._counts,
            )

    # -- async face -----------------------------------------------------------------------------

    async def run(self, fn: Callable[..., R], *args: Any, spin: bool = False) -> R:
        """Run ``fn(*args)`` on a worker and return its result (or raise its exception).

        Jobs start in the order they were submitted, at most ``n_threads`` at a time. ``spin``:
        while it runs, idle threads spin before sleeping (module docstring): for a job that fans
        out many times with no read in flight.

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
        job: _Job[R] = _Job(fn, args, lambda: loop.call_soon_threadsafe(done.set), spin)
        with self._lock:
            if self._closed:
                raise StoreClosedError("the compute pool is closed")
            self._start_threads()
            self._jobs.append(job)
            self._signal[_POSTED] += 1
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
            self._signal[_POSTED] += 1
            self._work.notify(min(len(seq) - 1, self._n))
        while True:
            with self._lock:
                i = self._claim(batch)
            if i is None:
                break
            batch.run_item(i, self._lock, self._signal)
        spin = self._spin if self._spin_jobs else None
        if spin is not None and spin.iterations:  # the helpers' items end soon after the caller's: poll before sleeping
            seen = int(self._signal[_FINISHED])
            while not batch.done.is_set():
                moved = spin.spin(self._signal, _FINISHED, seen, spin.iterations)
                if moved == seen:
                    break
                seen = moved
        batch.done.wait()
        if batch.errors:
            raise batch.errors[0]
        return batch.results

    def fan_out(self, task: int, desc: np.ndarray, n: int, desc_address: int = 0) -> int | None:
        """Run a compiled fan-out task over items ``0..n-1`` on this thread and idle workers, without the GIL.

        ``task`` is the address of a C function ``int64 task(int64 desc, int64 item)`` (a
        ``numba.cfunc``; :mod:`aioexperts._compute.kernels.fanout`), ``desc`` its ``int64``
        descriptor, which, with everything it points to, the caller keeps alive and unchanged for
        the call (``desc_address``, when given, is ``desc.ctypes.data``: a microsecond saved per
        call by a caller that keeps it). Workers spinning between a ``spin`` job's fan-outs claim
        items at once; a sleeping worker is asked to join (it takes the items left when it wakes).
        Another thread's fan-out in progress, a pool of one thread or a closed pool: every item on
        this thread. Never more threads than the pool has.

        Returns:
            The sum of the items' return values (0: all went right); None when the compiled kernels
            are not ready (no numba, or still loading): the caller computes another way.

        Raises:
            ConfigError: ``n`` outside ``0..MAX_ITEMS`` or ``desc`` not a C-contiguous int64 array.
        """
        spinner = self._spin
        limits = _fan_out_limits() if spinner is None else spinner.limits
        if not 0 <= n <= limits[0] or desc.dtype != np.int64 or not desc.flags.c_contiguous:
            raise ConfigError(f"fan_out: {n} items (0..{limits[0]}), descriptor {desc.dtype} {desc.shape}")
        if spinner is None or not self._threads:
            with self._lock:
                if not self._closed:
                    self._start_threads()  # the set-up thread compiles or loads the kernels
                if spinner is None:
                    self._counts["fan_outs"] += n > 1
                    return None
        address = desc_address or desc.ctypes.data
        t0 = time.perf_counter()
        if n <= 1 or self._n <= 1 or self._closed or not self._fan_lock.acquire(blocking=False):
            status = int(spinner.run_inline(task, address, n))
            if n > 1:
                self._count_fan_out(t0)
            return status
        try:
            control = self._control
            if control[limits[1]] or self._invited:  # a worker spins or comes: post and run in one call
                return int(spinner.fan_out(control, task, address, n))
            gen = spinner.publish(control, task, address, n)
            if not control[limits[1]] and not self._invited:
                self._invite()
            return int(spinner.finish(control, gen, n))
        finally:
            self._count_fan_out(t0)
            self._fan_lock.release()

    def _count_fan_out(self, t0: float) -> None:
        """Count a fan-out of more than one item that began at ``t0`` (perf_counter seconds)."""
        with self._lock:  # callers on several threads: one inline while another posts
            self._counts["fan_outs"] += 1
            self._fan_out_seconds += time.perf_counter() - t0

    def _invite(self) -> None:
        """Ask one sleeping worker to join the fan-outs (:meth:`_join`)."""
        with self._lock:
            if self._closed or self._invited:
                return
            self._start_threads()
            self._invited = True
            self._batches.append(_Batch(self._join, [None]))
            self._signal[_POSTED] += 1
            self._work.notify()

    def _join(self, _: None) -> None:
        """A woken worker: the items of the current fan-out that are left, then a spin for the next
        (a quarter of the usual spin outside ``spin`` jobs)."""
        self._invited = False
        spinner = self._spin
        if spinner is not None:
            iterations = spinner.iterations if self._spin_jobs else spinner.iterations // 4
            spinner.serve(self._control, self._signal, _POSTED, int(self._signal[_POSTED]), iterations)

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
        if self._n > 1:
            threading.Thread(target=self._set_up_spin, name="aioexperts-compute-spin-setup", daemon=True).start()
        for k in range(self._n):
            thread = threading.Thread(target=self._worker, name=f"aioexperts-compute-{k}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _set_up_spin(self) -> None:
        """Compile (or load) the spin kernel in a thread of its own, started with the workers: not on
        the event loop's thread, which starts them, and not in a worker, which jobs may be waiting
        for. Until it is ready the threads sleep at once."""
        spin = _spinner(self._spin_us)
        with self._lock:
            self._spin, self._spin_known = spin, True

    def _worker(self) -> None:
        spun = False  # the last spin saw nothing posted: sleep now
        while True:
            seen: int | None = None
            job: _Job[Any] | None = None
            batch: _Batch[Any, Any] | None = None
            i: int | None = None
            with self._lock:
                idle = not self._batches and not self._jobs and not self._closed
                if idle and not spun and self._spin_jobs and self._spin is not None and self._spin.iterations:
                    seen = int(self._signal[_POSTED])  # a running job may fan out again soon
                else:
                    while not self._batches and not self._jobs and not self._closed:
                        self._work.wait()
                    spun = False
                    if self._batches:  # fan-out items first: they belong to a job already running
                        batch = self._batches[0]
                        i = self._claim(batch)
                        self._counts["items_helped"] += i is not None
                    elif self._jobs:
                        job = self._jobs.popleft()
                        job.started = True
                        self._spin_jobs += job.spin
                    else:  # closed and idle
                        return
            if seen is not None:  # the lock is free while spinning
                spin = self._spin
                assert spin is not None
                spun = spin.serve(self._control, self._signal, _POSTED, seen, spin.iterations) == seen
                continue
            if job is not None:
                job.execute()
                with self._lock:
                    self._counts["jobs"] += 1
                    self._spin_jobs -= job.spin
                job.wake()
            elif batch is not None and i is not None:
                batch.run_item(i, self._lock, self._signal)
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


def _current_pool() -> ComputePool | None:
    """The process-wide pool if one was made (kernels that split their work never create it)."""
    return _pool


def compute_pool() -> ComputePool:
    """The process-wide pool, created on first use with :func:`default_threads` workers."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ComputePool()
        return _pool


def configure_compute_pool(
    n_threads: int | None = None, *, limit_native_threads: bool = True, spin_us: int | None = None
) -> ComputePool:
    """Replace the process-wide pool (benchmarks compare 1 and 2 threads, spinning or not; hosts pin a size).

    The old pool finishes its queued jobs before its workers stop. Call it while no job runs.

    Raises:
        ConfigError: ``n_threads`` outside [1, :data:`MAX_THREADS`], ``spin_us`` outside [0, :data:`MAX_SPIN_US`].
    """
    global _pool
    with _pool_lock:
        old, _pool = _pool, None
    if old is not None:
        old.close()  # first: it restores the native thread limits the new pool then sets again
    new = ComputePool(n_threads, limit_native_threads=limit_native_threads, spin_us=spin_us)
    with _pool_lock:
        _pool = new
    return new
