"""aioexperts._compute.pool: bounded compute, fan-out without deadlock, cancellation, native thread caps."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref

import anyio
import numpy as np
import pytest

from aioexperts._compute.pool import MAX_THREADS, ComputePool, compute_pool, configure_compute_pool, default_threads
from aioexperts._errors import ConfigError, StoreClosedError

pytestmark = pytest.mark.anyio


class Meter:
    """Counts the calls running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.threads: set[str] = set()

    def work(self, seconds: float, value: int = 0) -> int:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.threads.add(threading.current_thread().name)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return value


@pytest.fixture
def pool():
    p = ComputePool(2, limit_native_threads=False)
    yield p
    p.close()


async def test_run_returns_results_and_bounds_concurrency(pool: ComputePool, anyio_backend: object) -> None:
    meter = Meter()
    results: list[int] = []

    async def one(i: int) -> None:
        results.append(await pool.run(meter.work, 0.02, i))

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(one, i)
    assert sorted(results) == list(range(12))
    assert meter.peak == 2  # 12 concurrent callers, 2 workers
    assert all(name.startswith("aioexperts-compute-") for name in meter.threads)
    assert pool.statistics().jobs == 12


async def test_run_raises_the_job_exception(pool: ComputePool, anyio_backend: object) -> None:
    def boom() -> None:
        raise KeyError("in the worker")

    with pytest.raises(KeyError, match="in the worker"):
        await pool.run(boom)
    assert await pool.run(lambda: 5) == 5  # the worker survived


async def test_jobs_start_in_submission_order(anyio_backend: object) -> None:
    pool = ComputePool(1, limit_native_threads=False)
    order: list[int] = []
    try:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(pool.run, order.append, i)
                await anyio.sleep(0.005)
        assert order == list(range(6))
    finally:
        pool.close()


async def test_a_queued_job_cancelled_never_runs(anyio_backend: object) -> None:
    pool = ComputePool(1, limit_native_threads=False)
    ran: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def blocker() -> None:
        started.set()
        release.wait(5)
        ran.append("blocker")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, blocker)
            await anyio.to_thread.run_sync(started.wait, 5)
            with anyio.move_on_after(0.05) as scope:
                await pool.run(ran.append, "queued")
            assert scope.cancelled_caught
            release.set()
        assert ran == ["blocker"]
        assert pool.statistics().dropped == 1
    finally:
        release.set()
        pool.close()


async def test_a_running_job_is_waited_for_when_cancelled(pool: ComputePool, anyio_backend: object) -> None:
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        finished.append(time.perf_counter())

    t0 = time.perf_counter()
    with anyio.move_on_after(0.05) as scope:
        await pool.run(slow)
    assert scope.cancelled_caught
    assert finished, "the cancelled caller returned before its job finished"
    assert finished[0] - t0 >= 0.19


def test_map_keeps_order_and_spreads_over_idle_workers(pool: ComputePool) -> None:
    meter = Meter()
    assert pool.map(lambda i: meter.work(0.02, i * i), range(8)) == [i * i for i in range(8)]
    assert meter.peak >= 2
    assert pool.statistics().items_helped >= 1
    assert pool.map(str, []) == []
    assert pool.map(str, [1]) == ["1"]


def test_map_inside_busy_jobs_runs_inline_without_deadlock(pool: ComputePool) -> None:
    meter = Meter()

    async def main() -> list[list[int]]:
        results: list[list[int]] = []

        async def job(k: int) -> None:
            results.append(await pool.run(pool.map, lambda i: meter.work(0.01, k * 10 + i), range(5)))

        async with anyio.create_task_group() as tg:
            for k in range(6):
                tg.start_soon(job, k)
        return results

    results = anyio.run(main)
    assert sorted(results) == [[k * 10 + i for i in range(5)] for k in range(6)]
    assert meter.peak <= 2  # never more threads computing than workers


def test_map_raises_the_first_error_after_every_item(pool: ComputePool) -> None:
    done: list[int] = []

    def item(i: int) -> int:
        time.sleep(0.01)
        done.append(i)
        if i == 2:
            raise ValueError("item 2")
        return i

    with pytest.raises(ValueError, match="item 2"):
        pool.map(item, range(6))
    assert sorted(done) == list(range(6))


async def test_closed_pool_refuses_work(anyio_backend: object) -> None:
    pool = ComputePool(2, limit_native_threads=False)
    assert await pool.run(lambda: 1) == 1
    pool.close()
    pool.close()
    with pytest.raises(StoreClosedError):
        await pool.run(lambda: 1)
    assert pool.map(lambda i: i, [1, 2]) == [1, 2]  # inline after close


def test_native_thread_pools_are_capped_while_the_pool_lives() -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    np.ones((64, 64)) @ np.ones((64, 64))  # BLAS is loaded
    blas = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    if not blas:
        pytest.skip("no BLAS library that threadpoolctl can see")

    def blas_threads() -> list[int]:
        return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]

    with threadpoolctl.threadpool_limits(limits=4, user_api="blas"):  # whatever the process-wide pool set
        before = blas_threads()
        assert before == [4] * len(before)
        pool = ComputePool(2)
        try:
            assert blas_threads() == [1] * len(before)
        finally:
            pool.close()
        assert blas_threads() == before


def test_sizes_and_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOEXPERTS_COMPUTE_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("AIOEXPERTS_COMPUTE_THREADS", str(MAX_THREADS))
    assert default_threads() == MAX_THREADS
    # past the bound: 99999999999999999999 was taken, and the first job failed with a
    # "can't start new thread" RuntimeError traceback (aioexperts-run printed it)
    for bad in ("zero", "0", str(MAX_THREADS + 1), "99999999999999999999"):
        monkeypatch.setenv("AIOEXPERTS_COMPUTE_THREADS", bad)
        with pytest.raises(ConfigError, match="AIOEXPERTS_COMPUTE_THREADS"):
            default_threads()
        with pytest.raises(ConfigError, match="AIOEXPERTS_COMPUTE_THREADS"):
            ComputePool()
    for bad_n in (MAX_THREADS + 1, 10**20):
        with pytest.raises(ConfigError, match="n_threads"):
            ComputePool(bad_n)
    monkeypatch.delenv("AIOEXPERTS_COMPUTE_THREADS")
    assert default_threads() >= 1
    with pytest.raises(ConfigError):
        ComputePool(0)
    original = compute_pool()
    try:
        one = configure_compute_pool(1, limit_native_threads=False)
        assert compute_pool() is one and one.n_threads == 1
    finally:
        configure_compute_pool(original.n_threads)
    assert compute_pool().n_threads == original.n_threads


def test_an_idle_worker_keeps_no_job_or_map_item_alive(pool: ComputePool) -> None:
    """A finished job's arguments and map items (slot views, in the runner) are released at once: a
    worker waiting for work held the last ones, which kept a closed store's slab mapped."""

    class Item:
        pass

    items = [Item() for _ in range(6)]
    refs = [weakref.ref(item) for item in items]
    pool.map(lambda item: time.sleep(0.02), items)  # the idle workers help with some
    assert pool.statistics().items_helped > 0
    arg = Item()
    refs.append(weakref.ref(arg))
    anyio.run(pool.run, lambda a: None, arg)
    del items, arg
    gc.collect()
    time.sleep(0.05)  # the workers are back waiting
    assert [r() for r in refs] == [None] * len(refs)


#: The two asyncio loops: only asyncio has a plain ``Task.cancel()``.
ASYNCIO_LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


@pytest.mark.parametrize("anyio_backend", ASYNCIO_LOOPS)
async def test_a_cancellation_at_every_step_ends_once_the_job_has_finished(
    pool: ComputePool, anyio_backend: object
) -> None:
    # Issue 31 item 1: a caller whose task is cancelled again each time it wakes (one Task.cancel()
    # per loop tick) waited through it while the job ran, as it should, but never returned after:
    # the shielded wait was started again on the set event, whose checkpoint took the next
    # cancellation, for ever (the task spun on the loop; a runner closing it never finished).
    import asyncio

    from faults.stepper import Stepper

    started, finished = threading.Event(), threading.Event()

    def job() -> int:
        started.set()
        time.sleep(0.05)
        finished.set()
        return 1

    cancelling = [False]
    task: list[asyncio.Task[object]] = []

    def at_step(k: int) -> None:
        if cancelling[0]:
            task[0].cancel()

    stepper = Stepper(pool.run(job), at_step)

    async def call() -> object:
        return await stepper

    task.append(asyncio.get_running_loop().create_task(call()))
    try:
        await anyio.to_thread.run_sync(started.wait, 5)  # running: no longer dropped when cancelled
        cancelling[0] = True
        task[0].cancel()  # and again at every step from now on
        with anyio.move_on_after(5):
            while not task[0].done():
                await asyncio.sleep(0.01)
        ended = task[0].done()
    finally:
        cancelling[0] = False  # let a task that spins end all the same
        with anyio.fail_after(5):
            while not task[0].done():
                await asyncio.sleep(0.01)
    assert finished.is_set()
    assert ended, f"still waiting {stepper.steps} steps after its job had finished"
    assert task[0].cancelled()


# -- spinning before sleeping ---------------------------------------------------------------------

numba_only = pytest.mark.skipif(
    not __import__("aioexperts._compute.jit", fromlist=["jit_status"]).jit_status().available,
    reason="the spin is compiled code: without numba the threads sleep at once",
)


@numba_only
def test_spin_while_equal_sees_another_threads_write_without_the_gil() -> None:
    from aioexperts._compute.kernels.spin import spin_while_equal

    signal = np.zeros(2, dtype=np.int64)
    assert spin_while_equal(signal, 1, 0, 1000) == 0  # unchanged: gives up after max_iters

    def writer() -> None:
        time.sleep(0.02)  # Python code: runs only if the spinning thread released the GIL
        signal[1] = 7

    thread = threading.Thread(target=writer)
    thread.start()
    t0 = time.perf_counter()
    assert spin_while_equal(signal, 1, 0, 1 << 62) == 7  # a load hoisted out of the loop never returns
    assert time.perf_counter() - t0 < 5
    thread.join()


def test_spin_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioexperts._compute.pool import DEFAULT_SPIN_US, MAX_SPIN_US, SPIN_ENV, default_spin_us

    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert default_spin_us() == DEFAULT_SPIN_US
    monkeypatch.setenv(SPIN_ENV, "0")
    assert default_spin_us() == 0
    monkeypatch.setenv(SPIN_ENV, str(MAX_SPIN_US))
    assert default_spin_us() == MAX_SPIN_US
    # past the bound: a spin of 1e20 us was accepted, then its iteration count overflowed the
    # compiled loop's int64 in each worker thread (OverflowError, the thread gone)
    for bad in ("-1", "fast", str(MAX_SPIN_US + 1), "99999999999999999999"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ConfigError, match=SPIN_ENV):
            default_spin_us()
        with pytest.raises(ConfigError, match=SPIN_ENV):
            ComputePool(2)
    for bad_us in (-5, MAX_SPIN_US + 1, 10**20):
        with pytest.raises(ConfigError, match="spin_us"):
            ComputePool(2, spin_us=bad_us)
    assert ComputePool(1, spin_us=100).spin_us == 0  # nobody to hand work to


def _spin_ready(pool: ComputePool) -> ComputePool:
    """``pool`` once its threads started and its spin is set up (a thread of its own compiles it)."""
    pool.map(str, [1, 2])
    deadline = time.monotonic() + 60
    while not pool._spin_known and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._spin_known
    return pool


def _helped_without_a_wake_up(pool: ComputePool, spin: bool = True) -> None:
    """In one job: a first map wakes the other worker; a second map, posted with the condition's
    notify disabled, can then reach it only if it is spinning."""

    def item(i: int) -> None:
        time.sleep(0.02)  # releases the GIL: the caller does not finish both items first

    def job() -> None:
        pool.map(item, [0, 0])
        notify = pool._work.notify
        pool._work.notify = lambda n=1: None  # type: ignore[method-assign]
        try:
            pool.map(item, [0, 1])
        finally:
            pool._work.notify = notify  # type: ignore[method-assign]

    anyio.run(functools.partial(pool.run, job, spin=spin))


@numba_only
def test_a_worker_spinning_while_a_job_runs_takes_its_next_fan_out_without_a_wake_up() -> None:
    spinning = _spin_ready(ComputePool(2, limit_native_threads=False, spin_us=200_000))
    sleeping = ComputePool(2, limit_native_threads=False, spin_us=0)
    try:
        before = spinning.statistics().items_helped
        _helped_without_a_wake_up(spinning)
        assert spinning.statistics().items_helped - before == 2  # one item of each map
        before = spinning.statistics().items_helped
        _helped_without_a_wake_up(spinning, spin=False)  # a job without spin: the workers sleep
        assert spinning.statistics().items_helped - before == 1
        before = sleeping.statistics().items_helped
        _helped_without_a_wake_up(sleeping)
        assert sleeping.statistics().items_helped - before == 1  # the second map ran inline
    finally:
        spinning.close()
        sleeping.close()


@numba_only
def test_workers_spin_only_briefly_and_only_while_a_job_runs() -> None:
    pool = _spin_ready(ComputePool(2, limit_native_threads=False, spin_us=2000))
    try:
        pool.map(lambda i: time.sleep(0.005), range(2))  # both workers started and once busy
        t0 = time.process_time()
        time.sleep(0.3)  # no job runs: the workers sleep
        assert time.process_time() - t0 < 0.05

        def job() -> None:
            pool.map(lambda i: time.sleep(0.005), range(2))
            t1 = time.process_time()
            time.sleep(0.3)  # the job runs, posts nothing: the idle worker spins 2 ms once, then sleeps
            job_cpu.append(time.process_time() - t1)

        job_cpu: list[float] = []
        anyio.run(functools.partial(pool.run, job, spin=True))
        assert job_cpu[0] < 0.05
    finally:
        pool.close()
