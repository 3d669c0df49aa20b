"""Regression tests of the I/O core's fault handling: submit faults, callback boundaries, close.

Each test drives the real scheduler and cache (and the real io_uring backend where it matters)
through the cache API and checks the invariants with :meth:`Stack.problems`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts._cache.scheduler import Load, Priority, ReadScheduler
from aioexperts._cache.stats import Counters
from aioexperts._errors import ExpertReadError, StoreClosedError
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._io.backends.base import ReadOp
from aioexperts._io.backends.threads import ThreadBackend
from aioexperts._io.backends.uring import UringBackend
from aioexperts._io.files import open_shards
from aioexperts._io.loop import current_loop
from aioexperts._io.plan import max_plan_bytes, plan_expert
from aioexperts._io.select import create_backend
from aioexperts._io.slab import Slab
from aioexperts.testing import FakeBackend
from faults.guard import CheckedFake, CheckedUring
from faults.ringproxy import RingFaults
from faults.script import POSITIONS, FaultyFake, position
from faults.stack import Key, Stack, open_fds, open_stack, waiter_threads_ended

pytestmark = pytest.mark.anyio

FIRST_EIGHT: list[Key] = [(0, e) for e in range(8)]


@pytest.fixture
def ring() -> Iterator[RingFaults]:
    faults = RingFaults()
    with faults.installed():
        yield faults


def open_uring(model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, **kw: Any) -> Stack:
    stack = open_stack(model_path, CheckedUring, reference=reference, **kw)
    ring.watch(stack.backend)  # type: ignore[arg-type]
    return stack


async def settle(ticks: int = 10) -> None:
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()


async def check_and_close(stack: Stack, ring: RingFaults | None = None) -> None:
    """Quiet, no broken invariant, every expert's bytes right on the next request, clean close."""
    await stack.quiesce()
    assert stack.problems() == []
    if ring is not None:
        ring.enabled = False
    assert await stack.verify_all() == []
    await stack.quiesce()
    assert stack.problems() == []
    if ring is not None:
        assert ring.violations == []
        backend = stack.backend
        assert isinstance(backend, UringBackend)
        assert backend.queued_entries == 0 and backend.nops_in_flight == 0 and backend.unexpected_completions == 0
    await stack.aclose()


# -- 1. a failed submit never frees a slot with a read in the ring --------------------------------


@pytest.mark.parametrize("at", POSITIONS)
async def test_a_prep_that_raises_mid_batch_leaves_no_read_in_the_ring(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, at: str, anyio_backend: object
) -> None:
    # depth 8: the warm-up below wraps the submission queue, so every entry is recycled and a
    # failed prep would leave the previous read in it (io_uring_get_sqe does not clear entries)
    stack = open_uring(model_path, reference, ring, slots=8, depth=8)
    assert await stack.request(FIRST_EIGHT) == "ok"
    ring.fail_prep(ring.calls["prep"] + position(at, 6), TypeError("scripted prep failure"))
    outcome = await stack.request([(1, 0), (1, 1)])  # six reads in one batch
    assert outcome == "ExpertReadError"
    error = stack.errors[-1]
    assert isinstance(error.__cause__, TypeError)
    assert ring.calls["nop"] >= 1  # the entry of the failed prep became a NOP
    await check_and_close(stack, ring)


@pytest.mark.parametrize(
    "exc",
    [OSError(errno.EFAULT, "Bad address"), RuntimeError("wrapper error")],
    ids=["OSError", "RuntimeError"],
)
async def test_a_submit_that_raises_fails_the_loads_and_neutralizes_their_entries(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, exc: Exception, anyio_backend: object
) -> None:
    stack = open_uring(model_path, reference, ring, slots=8, depth=8)
    assert await stack.request([(0, 0)]) == "ok"
    ring.fail_submit(ring.calls["submit"], exc)
    assert await stack.request([(1, 0), (1, 1)]) == "ExpertReadError"
    assert stack.errors[-1].__cause__ is exc
    # the next request's submit hands the queue to the kernel: it must hold NOPs, not those reads
    assert await stack.request([(2, 0), (2, 1)]) == "ok"
    assert ring.violations == []
    await check_and_close(stack, ring)


@pytest.mark.parametrize("at", POSITIONS)
async def test_a_full_submission_queue_mid_batch(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, at: str, anyio_backend: object
) -> None:
    stack = open_uring(model_path, reference, ring, slots=8, depth=8)
    assert await stack.request([(0, 0)]) == "ok"
    # once: the backend hands the queue over and gets an entry; twice in a row: it gives up there
    first = ring.calls["get_sqe"] + position(at, 6)
    ring.sqe_none(first)
    assert await stack.request([(1, 0), (1, 1)]) == "ok"
    ring.sqe_none(ring.calls["get_sqe"] + position(at, 6))
    ring.sqe_none(ring.calls["get_sqe"] + position(at, 6) + 1)
    assert await stack.request([(2, 0), (2, 1)]) == "ExpertReadError"
    assert isinstance(stack.errors[-1].__cause__, OSError)
    await check_and_close(stack, ring)


async def test_a_deferred_submit_that_then_fails_fails_the_reads_through_their_completion(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, anyio_backend: object
) -> None:
    stack = open_uring(model_path, reference, ring, slots=8, depth=8)
    n = ring.calls["submit"]
    ring.fail_submit(n, OSError(errno.EAGAIN, "Resource temporarily unavailable"))  # taken, retried later
    boom = RuntimeError("the retry failed")
    ring.fail_submit(n + 1, boom)
    assert await stack.request([(1, 0), (1, 1)]) == "ExpertReadError"
    assert stack.errors[-1].__cause__ is boom
    await check_and_close(stack, ring)


async def test_a_ring_that_cannot_be_made_safe_is_never_entered_again(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, anyio_backend: object
) -> None:
    stack = open_uring(model_path, reference, ring, slots=8, depth=8)
    assert await stack.request(FIRST_EIGHT) == "ok"
    ring.fail_prep(ring.calls["prep"] + 2)
    ring.fail_nop(ring.calls["nop"])  # the stale entry cannot be rewritten
    submits = ring.calls["submit"]
    assert await stack.request([(1, 0), (1, 1)]) == "ExpertReadError"
    backend = stack.backend
    assert isinstance(backend, UringBackend) and backend.broken
    assert ring.calls["submit"] == submits  # the queue with the stale entry never reached the kernel
    assert await stack.request([(2, 0)]) == "ExpertReadError"  # a clear error, no hang
    await stack.quiesce()
    assert stack.problems() == [] and ring.violations == []
    await stack.aclose()


async def test_a_partly_taken_load_fails_but_keeps_its_slot_until_its_reads_complete(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    holder: dict[str, FaultyFake] = {}

    def factory(files: Any, slab: Any, loop: Any, depth: int) -> FaultyFake:
        holder["fake"] = FaultyFake(
            files, slab, loop, depth, auto=False, submit_fault=(0, 4, OSError(errno.EIO, "EIO"))
        )
        return holder["fake"]

    stack = open_stack(model_path, factory, reference=reference, slots=8)
    fake, cache = holder["fake"], stack.cache
    a, b, c = (0, 0), (0, 1), (0, 2)  # nine reads; the backend takes four: a's three and b's first
    async with anyio.create_task_group() as tg:
        tg.start_soon(stack.request, [a, b, c])
        await settle()
        assert len(fake.pending) == 4
        assert cache.state_of(c) is SlotState.FREE  # none of its reads were taken: failed, slot free
        b_slot = cache.entries[b].slot
        assert cache.state_of(b) is SlotState.LOADING and b_slot not in cache.free_slots
        assert cache.state_of(a) is SlotState.LOADING
        fake.complete_all()
    assert stack.outcomes == ["ExpertReadError"]
    assert isinstance(stack.errors[0].__cause__, OSError) and "could not be submitted" in str(stack.errors[0])
    assert cache.state_of(b) is SlotState.FREE and b_slot in cache.free_slots
    assert cache.state_of(a) is SlotState.READY
    fake.auto = True
    await check_and_close(stack)


# -- 2. no exception lost at a loop-callback boundary -----------------------------------------------


async def test_a_raising_callback_or_reader_does_not_abort_the_loop(
    anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    loop = current_loop()
    done = anyio.Event()
    loop.call_soon(lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    loop.call_soon(done.set)
    with anyio.fail_after(5):
        await done.wait()

    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    calls: list[int] = []
    second = anyio.Event()

    def on_readable() -> None:
        os.eventfd_read(efd)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the reader raised")
        second.set()

    loop.add_reader(efd, on_readable)
    try:
        os.eventfd_write(efd, 1)
        with anyio.fail_after(5):
            while not calls:
                await anyio.sleep(0.001)
        os.eventfd_write(efd, 1)  # the reader still watches after raising
        with anyio.fail_after(5):
            await second.wait()
    finally:
        loop.remove_reader(efd)
        os.close(efd)


async def test_any_exception_in_a_thread_read_fails_the_load(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    stack = open_stack(model_path, ThreadBackend, reference=reference, slots=8)
    slab = stack.slab
    real = slab.writable_view
    calls = {"n": 0}

    def failing_view(slot: int, start: int, n_bytes: int) -> memoryview:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("scripted")
        return real(slot, start, n_bytes)

    slab.writable_view = failing_view  # type: ignore[method-assign]
    assert await stack.request([(0, 0)]) == "ExpertReadError"
    assert isinstance(stack.errors[0].__cause__, MemoryError)
    await check_and_close(stack)


async def test_a_backend_raising_outside_the_contract_fails_the_loads(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    class Refusing(CheckedFake):
        refuse = True

        def submit(self, ops: Sequence[ReadOp]) -> None:
            if self.refuse:
                self.refuse = False
                raise ValueError("not a SubmitError")
            super().submit(ops)

    stack = open_stack(model_path, Refusing, reference=reference, slots=8)
    assert await stack.request([(0, 0), (0, 1)]) == "ExpertReadError"
    assert isinstance(stack.errors[0].__cause__, ValueError)
    await check_and_close(stack)


async def test_an_on_done_that_raises_leaves_the_scheduler_consistent(
    model_path: Path, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    model = open_model(model_path)
    layout = build_layout(model)
    files = open_shards(model)
    slab = Slab(2, max_plan_bytes(layout, files.alignment))
    loop = current_loop()
    backend = FakeBackend(files, slab, loop, 16, auto=False)
    backend.attach()
    scheduler = ReadScheduler(backend, loop, Counters(), files.sizes, files.dio_alignment, 1 << 30)
    finished: list[Load] = []

    def raising(load: Load) -> None:
        finished.append(load)
        raise RuntimeError("on_done raised")

    try:
        first = Load(plan_expert(layout.locate(0, 0), files.alignment), 0, Priority.DEMAND, finished.append)
        last = Load(plan_expert(layout.locate(0, 1), files.alignment), 1, Priority.DEMAND, raising)
        scheduler.enqueue(first)
        scheduler.enqueue(last)
        await settle()
        assert backend.in_flight == 6

        async def wait() -> None:
            with anyio.fail_after(5):
                await scheduler.wait_no_reads_in_flight()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await settle()
            backend.complete_all()  # FIFO: `last` completes last, so nothing completes after its on_done
        assert finished == [first, last]
        assert scheduler.reads_in_flight == 0 and scheduler.bytes_in_flight == 0 and backend.in_flight == 0
        assert "on_done raised" in caplog.text
        again = Load(plan_expert(layout.locate(0, 2), files.alignment), 0, Priority.DEMAND, finished.append)
        scheduler.enqueue(again)  # still working
        backend.auto = True
        with anyio.fail_after(5):
            await scheduler.wait_idle()
        assert finished[-1] is again and again.error is None
    finally:
        backend.close()
        files.close()
        slab.close()


# -- 3. the scheduler side of close ----------------------------------------------------------------


async def test_a_retry_queued_during_close_is_failed_and_never_submitted(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}

    def factory(files: Any, slab: Any, loop: Any, depth: int) -> CheckedFake:
        holder["fake"] = CheckedFake(files, slab, loop, depth, auto=False)
        return holder["fake"]

    stack = open_stack(model_path, factory, reference=reference, slots=8)
    fake = holder["fake"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(stack.request, [(0, 0)])
        await settle()
        assert len(fake.batches) == 1 and len(fake.pending) == 3
        first = fake.pending[0]
        fake.complete(first, first.n_bytes // 2)  # a short read: a re-read is queued (flush next tick)
        assert not stack.scheduler.idle and stack.scheduler.reads_in_flight == 2
        stack.cache.close()  # before the flush runs
        await settle()
        assert len(fake.batches) == 1  # the re-read was never submitted
        assert stack.scheduler.reads_in_flight == 2
        fake.complete_all()
    assert stack.outcomes == ["StoreClosedError"]
    with anyio.fail_after(5):
        await stack.scheduler.wait_idle()
    assert stack.problems() == []
    await stack.aclose()
    assert fake.closed and len(fake.batches) == 1


async def test_wait_idle_waits_for_queued_and_in_flight_reads(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}

    def factory(files: Any, slab: Any, loop: Any, depth: int) -> CheckedFake:
        holder["fake"] = CheckedFake(files, slab, loop, depth, auto=False)
        return holder["fake"]

    stack = open_stack(model_path, factory, reference=reference, slots=8, depth=3)
    fake, scheduler = holder["fake"], stack.scheduler
    idle = anyio.Event()

    async def waiter() -> None:
        await scheduler.wait_idle()
        idle.set()

    assert stack.cache.prefetch([(0, 0), (0, 1)]) == 2  # depth 3: the second load stays queued
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await settle()
        with anyio.CancelScope() as scope:  # a cancelled wait changes nothing
            scope.cancel()
            await scheduler.wait_idle()
        for _ in range(2):
            assert not idle.is_set()
            fake.complete_all()
            await settle()
        with anyio.fail_after(5):
            await idle.wait()
    assert scheduler.idle and stack.problems() == []
    await stack.aclose()


async def test_io_uring_close_can_be_finished_after_an_interrupted_close(
    model_path: Path, reference: dict[Key, list[bytes]], ring: RingFaults, anyio_backend: object
) -> None:
    baseline = open_fds()
    stack = open_uring(model_path, reference, ring, slots=8)
    assert await stack.request([(0, 0)]) == "ok"
    await stack.quiesce()
    backend = stack.backend
    ring.fail_call("io_uring_queue_exit", KeyboardInterrupt(), after=True)  # interrupted in the middle
    with pytest.raises(KeyboardInterrupt):
        backend.close()
    backend.close()  # finishes what is left; a second queue_exit would raise
    backend.close()
    assert not backend.attached
    stack.files.close()
    stack.slab.close()
    await waiter_threads_ended()  # closed on the loop thread: the waiter ends by itself
    assert open_fds() == baseline


async def test_ring_set_up_and_teardown_run_in_a_worker_thread(model_path: Path, anyio_backend: object) -> None:
    baseline = open_fds()
    model = open_model(model_path)
    layout = build_layout(model)
    files = await anyio.to_thread.run_sync(open_shards, model)
    slab = Slab(2, max_plan_bytes(layout, files.alignment))
    loop = current_loop()
    backend, reason = await anyio.to_thread.run_sync(
        lambda: create_backend("io_uring", files, slab, loop, 8, attach=False)
    )
    assert isinstance(backend, UringBackend) and reason is None and not backend.attached
    backend.attach()  # the only part on the loop thread
    scheduler = ReadScheduler(backend, loop, Counters(), files.sizes, files.dio_alignment, 1 << 30)
    done = anyio.Event()
    load = Load(plan_expert(layout.locate(0, 0), files.alignment), 0, Priority.DEMAND, lambda _: done.set())
    scheduler.enqueue(load)
    with anyio.fail_after(5):
        await done.wait()
    assert load.error is None
    with pytest.raises(RuntimeError, match="detach"):  # attached: the loop thread must detach it first
        await anyio.to_thread.run_sync(backend.close)
    backend.detach()
    await anyio.to_thread.run_sync(backend.close)
    files.close()
    slab.close()
    assert open_fds() == baseline


async def test_a_store_closed_with_a_failed_submit_in_flight_closes_cleanly(
    model_path: Path, anyio_backend: object
) -> None:
    """The store's existing aclose path (cache.close, wait, backend.close) on top of these changes."""
    holder: dict[str, FaultyFake] = {}

    def factory(files: Any, slab: Any, loop: Any, depth: int) -> FaultyFake:
        holder["fake"] = FaultyFake(files, slab, loop, depth, submit_fault=(0, 2, RuntimeError("x")))
        return holder["fake"]

    store = aioexperts.open(model_path, slots=8, io=aioexperts.IOOptions(backend=factory))
    await store.start()
    with pytest.raises(ExpertReadError):
        async with store.experts(0, [0, 1]):
            pass
    await store.aclose()
    assert holder["fake"].closed and holder["fake"].violations == []
    with pytest.raises(StoreClosedError):
        store.prefetch([(0, 0)])
