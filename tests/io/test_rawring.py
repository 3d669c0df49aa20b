"""The raw-syscall io_uring ring and its backend: bytes, ring arithmetic, completions, close.

Everything here sets up real rings (``io_uring_setup`` through ctypes): skipped where io_uring
cannot be had at all (``conftest.py``, the ``io_uring`` marker).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import direct_io_unavailable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ioutil import open_files

from aioexperts._io.align import align_down, align_up
from aioexperts._io.backends.base import ReadOp, SubmitError
from aioexperts._io.backends.rawring import RawUringBackend
from aioexperts._io.files import ShardFiles
from aioexperts._io.loop import current_loop
from aioexperts._io.slab import Slab
from aioexperts._io.uring_raw import IORING_OP_NOP, RawRing

pytestmark = [pytest.mark.io_uring, pytest.mark.anyio]

FILE_BYTES = (3 << 20) + 12345  # not a multiple of the page: the last read is short
SLOT_BYTES = 1 << 20
ALIGN = 4096


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rawring") / "data.bin"
    path.write_bytes(np.random.default_rng(5).integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes())
    return path


@pytest.fixture(scope="module")
def direct(data_file: Path) -> bool:
    return direct_io_unavailable(data_file.parent) is None


class Harness:
    """A raw backend over one file and a slab, driven on an asyncio loop without a scheduler."""

    def __init__(self, files: ShardFiles, slab: Slab, depth: int, **options: Any) -> None:
        self.files, self.slab = files, slab
        self.backend = RawUringBackend(files, slab, current_loop(), depth, **options)
        self.results: dict[int, int | Exception] = {}
        self.kept: list[ReadOp] = []
        self.inside_submit = False
        self.delivered_inside_submit = 0
        self.backend.set_sink(self._sink)
        self.backend.attach()

    def _sink(self, op: ReadOp, result: int | Exception) -> None:
        self.delivered_inside_submit += self.inside_submit
        assert id(op) not in self.results, "two completions for one read"
        self.results[id(op)] = result

    def submit(self, ops: list[ReadOp]) -> None:
        self.kept.extend(ops)  # ids stay unique while the results are keyed by them
        self.inside_submit = True
        try:
            self.backend.submit(ops)
        finally:
            self.inside_submit = False

    async def wait(self, ops: list[ReadOp]) -> list[int | Exception]:
        with anyio.fail_after(10.0):
            while any(id(op) not in self.results for op in ops):
                await anyio.sleep(0.0005)
        return [self.results[id(op)] for op in ops]

    def close(self) -> None:
        self.backend.close()
        self.slab.close()
        self.files.close()


@pytest.fixture
async def make_harness(data_file: Path, direct: bool, anyio_backend: object) -> AsyncIterator[Any]:
    made: list[Harness] = []

    def make(depth: int = 8, n_slots: int = 8, **options: Any) -> Harness:
        harness = Harness(open_files([data_file], direct), Slab(n_slots, SLOT_BYTES), depth, **options)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        if not harness.backend._released:
            harness.close()


def widened(offset: int, n_bytes: int) -> tuple[int, int]:
    start = align_down(offset, ALIGN)
    return start, align_up(offset + n_bytes, ALIGN) - start


def expected_result(start: int, length: int) -> int:
    return max(0, min(length, FILE_BYTES - start))


segments = st.lists(
    st.tuples(st.integers(0, FILE_BYTES - 1), st.integers(1, SLOT_BYTES - ALIGN)).map(
        lambda t: (t[0], min(t[1], FILE_BYTES - t[0]))
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(segs=segments, depth=st.sampled_from([4, 8]), fixed=st.booleans())
def test_random_segments_read_through_the_raw_ring_equal_pread(
    data_file: Path, direct: bool, segs: list[tuple[int, int]], depth: int, fixed: bool
) -> None:
    reference = data_file.read_bytes()

    async def run() -> None:
        files = open_files([data_file], direct)
        harness = Harness(files, Slab(depth, SLOT_BYTES), depth, fixed_buffers=fixed)
        try:
            assert harness.backend.features()["fixed_buffers"] is fixed
            for first in range(0, len(segs), depth):  # a slot is reused only after its completion
                batch = segs[first : first + depth]
                ops = [ReadOp(0, *widened(off, n), slot, 0) for slot, (off, n) in enumerate(batch)]
                harness.submit(ops)
                results = await harness.wait(ops)
                for slot, ((off, n), op, res) in enumerate(zip(batch, ops, results, strict=True)):
                    assert res == expected_result(op.file_offset, op.n_bytes)  # short at end of file
                    got = bytes(harness.slab.view(slot, off - op.file_offset, n))
                    assert got == reference[off : off + n]
            assert harness.delivered_inside_submit == 0
            tail, head = harness.backend.ring.counters
            assert tail == head == len(segs)  # every entry consumed, every completion reaped
        finally:
            harness.close()

    asyncio.run(run())


async def test_more_reads_than_ring_entries_wrap_the_rings(
    make_harness: Any, data_file: Path, anyio_backend: object
) -> None:
    reference = data_file.read_bytes()
    harness = make_harness(depth=4, n_slots=4)
    ring = harness.backend.ring
    assert (ring.sq_entries, ring.cq_entries) == (4, 8)
    rng = np.random.default_rng(1)
    for _round in range(60):  # 240 reads through 4 SQ and 8 CQ entries: both wrap many times
        offsets = [int(o) * ALIGN for o in rng.integers(0, FILE_BYTES // ALIGN, 4)]
        ops = [ReadOp(0, off, 2 * ALIGN, slot, 0) for slot, off in enumerate(offsets)]
        harness.submit(ops)
        for slot, (op, res) in enumerate(zip(ops, await harness.wait(ops), strict=True)):
            assert res == expected_result(op.file_offset, op.n_bytes)
            assert bytes(harness.slab.view(slot, 0, res)) == reference[op.file_offset : op.file_offset + res]
    assert ring.counters == (240, 240)
    assert harness.backend.unexpected_completions == 0


@pytest.mark.parametrize("cq_entries", [4, 32])
async def test_the_backend_s_cq_entries_reach_the_ring(
    make_harness: Any, data_file: Path, anyio_backend: object, cq_entries: int
) -> None:
    """``RawUringBackend(cq_entries=)`` sizes the completion queue (issue 31 item 14: it was dropped)."""
    reference = data_file.read_bytes()
    harness = make_harness(depth=4, n_slots=4, cq_entries=cq_entries)
    ring = harness.backend.ring
    assert (ring.sq_entries, ring.cq_entries) == (4, cq_entries)
    for _round in range(5):
        ops = [ReadOp(0, (slot + 3 * _round) * ALIGN, ALIGN, slot, 0) for slot in range(4)]
        harness.submit(ops)
        for slot, (op, res) in enumerate(zip(ops, await harness.wait(ops), strict=True)):
            assert res == ALIGN
            assert bytes(harness.slab.view(slot, 0, res)) == reference[op.file_offset : op.file_offset + res]


def test_a_full_completion_queue_overflows_into_the_kernel_and_is_flushed_not_lost() -> None:
    ring = RawRing(4, cq_entries=4)
    try:
        for batch in range(3):  # 12 completions, never reaped in between, into 4 CQ entries
            ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, batch * 4 + i + 1, 0) for i in range(4)])
            assert ring.enter(4) == 4
        assert ring.cq_ready() == 4 and ring.cq_overflow_pending
        users, results = ring.reap()
        assert users == list(range(1, 13)) and results == [0] * 12
        assert not ring.cq_overflow_pending and ring.cq_ready() == 0
    finally:
        ring.close()


async def test_a_completion_is_delivered_only_from_its_own_cqe(make_harness: Any, anyio_backend: object) -> None:
    harness = make_harness(depth=8)
    ops = [ReadOp(0, slot * SLOT_BYTES, SLOT_BYTES, slot, 0) for slot in range(3)]
    harness.submit(ops)
    assert harness.results == {} and harness.backend.in_flight == 3
    ring = harness.backend.ring
    harness.backend.detach()  # the loop stops reaping: completions pile up in the CQ
    for _ in range(2000):
        if ring.cq_ready() == 3:
            break
        await anyio.sleep(0.001)
    assert ring.cq_ready() == 3
    await anyio.sleep(0.01)
    assert harness.results == {} and harness.backend.in_flight == 3  # done in the kernel, not yet reaped
    harness.backend.attach()
    os.eventfd_write(harness.backend._efd, 1)  # the wake-up was consumed while detached
    assert await harness.wait(ops) == [SLOT_BYTES] * 3
    assert harness.backend.in_flight == 0


async def test_eof_reads_are_short_then_zero(make_harness: Any, anyio_backend: object) -> None:
    harness = make_harness()
    last_page = align_down(FILE_BYTES, ALIGN)
    ops = [ReadOp(0, last_page, 2 * ALIGN, 0, 0), ReadOp(0, align_up(FILE_BYTES, ALIGN), ALIGN, 1, 0)]
    harness.submit(ops)
    assert await harness.wait(ops) == [FILE_BYTES - last_page, 0]


async def test_a_failed_read_completes_with_the_kernels_oserror(
    make_harness: Any, data_file: Path, anyio_backend: object
) -> None:
    harness = make_harness()
    write_only = os.open(data_file, os.O_WRONLY)
    try:
        harness.files.fds = (*harness.files.fds, write_only)
        ops = [ReadOp(1, 0, ALIGN, 0, 0), ReadOp(0, 0, ALIGN, 1, 0)]
        harness.submit(ops)
        bad, good = await harness.wait(ops)
        assert isinstance(bad, OSError) and bad.errno == errno.EBADF
        assert good == ALIGN
    finally:
        harness.files.fds = harness.files.fds[:1]
        os.close(write_only)


@pytest.mark.parametrize(
    "op",
    [
        ReadOp(0, 0, SLOT_BYTES + ALIGN, 0, 0),  # longer than its slot
        ReadOp(0, 0, ALIGN, 0, SLOT_BYTES),  # starts at the slot's end
        ReadOp(0, 0, ALIGN, 8, 0),  # no such slot
        ReadOp(0, 0, ALIGN, -1, 0),
        ReadOp(3, 0, ALIGN, 0, 0),  # no such shard
    ],
    ids=["too-long", "past-slot", "no-slot", "negative-slot", "no-shard"],
)
async def test_an_op_outside_the_slab_is_refused_before_the_kernel_sees_it(
    make_harness: Any, op: ReadOp, anyio_backend: object
) -> None:
    harness = make_harness()
    good = ReadOp(0, 0, ALIGN, 1, 0)
    with pytest.raises(SubmitError) as info:
        harness.submit([good, op])
    assert info.value.taken == 0 and harness.backend.in_flight == 0
    assert harness.backend.ring.counters == (0, 0)  # nothing was published
    harness.submit([good])
    assert await harness.wait([good]) == [ALIGN]


async def test_a_failed_enter_takes_its_entries_back(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    harness = make_harness()
    ring = harness.backend.ring
    monkeypatch.setattr(ring, "enter", lambda *args: -errno.EFAULT)
    ops = [ReadOp(0, 0, ALIGN, slot, 0) for slot in range(3)]
    with pytest.raises(SubmitError) as info:
        harness.submit(ops)
    assert info.value.taken == 0 and isinstance(info.value.__cause__, OSError)
    assert ring.sq_unconsumed() == 0 and harness.backend.queued_entries == 0 and harness.backend.in_flight == 0
    monkeypatch.undo()
    ops = [ReadOp(0, ALIGN, ALIGN, slot, 0) for slot in range(3)]
    harness.submit(ops)  # the taken-back entries never reach the kernel: only these three complete
    assert await harness.wait(ops) == [ALIGN] * 3
    await anyio.sleep(0.01)
    assert harness.backend.unexpected_completions == 0 and ring.counters == (3, 3)


async def test_a_transient_enter_failure_submits_later(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    harness = make_harness()
    ring = harness.backend.ring
    real_enter = ring.enter
    calls = []

    def busy_once(*args: int) -> int:
        calls.append(args)
        return -errno.EAGAIN if len(calls) == 1 else real_enter(*args)

    monkeypatch.setattr(ring, "enter", busy_once)
    ops = [ReadOp(0, 0, ALIGN, slot, 0) for slot in range(2)]
    harness.submit(ops)  # taken: the entries stay published and go out on the next tick
    assert harness.backend.in_flight == 2 and harness.backend.queued_entries == 2
    assert await harness.wait(ops) == [ALIGN, ALIGN]
    assert len(calls) >= 2 and harness.backend.queued_entries == 0


def _slab_mapped(slab: Slab) -> bool:
    start = f"{slab.address:x}-"
    with open("/proc/self/maps") as maps:
        return any(line.startswith(start) for line in maps)


async def test_close_with_reads_in_flight_reaps_every_completion_before_releasing(
    make_harness: Any, anyio_backend: object
) -> None:
    harness = make_harness(depth=8, n_slots=8)
    backend, slab = harness.backend, harness.slab
    ops = [ReadOp(0, (slot % 3) * SLOT_BYTES, SLOT_BYTES, slot, 0) for slot in range(8)]
    harness.submit(ops)
    assert backend.in_flight == 8
    slab.close()  # the wrong order, as an interrupted release might do: the slab must stay mapped
    assert _slab_mapped(slab)
    backend.detach()
    await anyio.to_thread.run_sync(backend.close)  # cancels, then waits for all eight CQEs
    assert backend.in_flight == 0 and backend._ops == {}
    assert backend.ring.closed and backend._efd < 0
    assert harness.results == {}  # reaped at close, not delivered to a sink that is gone
    del harness, backend
    gc.collect()
    assert not _slab_mapped(slab)  # the pin is gone: the mapping is freed once nothing reads into it


async def test_close_waits_and_then_refuses_more_work(make_harness: Any, anyio_backend: object) -> None:
    harness = make_harness()
    backend = harness.backend
    op = ReadOp(0, 0, SLOT_BYTES, 0, 0)
    harness.submit([op])
    backend.detach()
    backend.drain_timeout = 10.0
    backend.close()  # on this thread: the loop is not running meanwhile, the drain reaps itself
    assert backend.in_flight == 0
    with pytest.raises(SubmitError):
        backend.submit([ReadOp(0, 0, ALIGN, 1, 0)])
    backend.close()  # idempotent


def test_an_attached_backend_closed_from_another_thread_is_refused(data_file: Path, direct: bool) -> None:
    async def run() -> None:
        harness = Harness(open_files([data_file], direct), Slab(2, SLOT_BYTES), 4)
        with pytest.raises(RuntimeError, match="detach"):
            await asyncio.to_thread(harness.backend.close)
        harness.close()  # on the loop thread: detaches first

    asyncio.run(run())


@pytest.mark.parametrize("head_start", range(8))
def test_a_bulk_reap_across_the_cq_wrap_returns_every_cqe_once_in_order(head_start: int) -> None:
    """The bulk copy of the CQ (strided slices, split at the ring's end) from every head position:
    each batch's user_data and res come back in CQ order, whatever part of the ring they span."""
    ring = RawRing(8, cq_entries=8)
    try:
        ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, 1000 + i, 0) for i in range(head_start)])
        assert ring.enter(head_start) == head_start
        assert ring.reap()[0] == list(range(1000, 1000 + head_start))
        for batch in range(3):  # 7 completions a batch: from head_start on, they cross the end of the ring
            first = 1 + 100 * batch
            ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, first + i, 0) for i in range(7)])
            assert ring.enter(7) == 7
            users, results = ring.reap()
            assert users == list(range(first, first + 7)) and results == [0] * 7
            assert ring.cq_ready() == 0
    finally:
        ring.close()


async def test_a_batch_of_completions_reaped_at_once_resolves_each_read_into_its_own_slot(
    make_harness: Any, data_file: Path, anyio_backend: object
) -> None:
    """Reads of shuffled file blocks into shuffled slots pile up in the CQ and are reaped in one
    wake-up (one bulk copy, whatever order the kernel finished them in): each op gets its own
    completion and each slot holds the bytes of its own read."""
    harness = make_harness(depth=8, n_slots=8)
    blocks = [5, 2, 7, 0, 3, 6, 1, 4]
    slots = [3, 6, 0, 7, 1, 4, 2, 5]
    block = SLOT_BYTES // 4  # 8 blocks fit in the file
    ops = [ReadOp(0, b * block, block, s, 0) for b, s in zip(blocks, slots, strict=True)]
    ring = harness.backend.ring
    harness.backend.detach()  # completions pile up: the reap below sees them all at once
    harness.submit(ops)
    for _ in range(2000):
        if ring.cq_ready() == len(ops):
            break
        await anyio.sleep(0.001)
    assert ring.cq_ready() == len(ops)
    harness.backend.attach()
    os.eventfd_write(harness.backend._efd, 1)
    assert await harness.wait(ops) == [block] * len(ops)
    data = data_file.read_bytes()
    for b, s in zip(blocks, slots, strict=True):
        got = bytes(harness.slab.view(s, 0, block))
        assert got == data[b * block : (b + 1) * block], f"slot {s} does not hold block {b}"


async def test_a_batch_sink_gets_each_reap_whole_only_while_it_stands_for_the_sink_set(
    make_harness: Any, anyio_backend: object
) -> None:
    """IOBackend.set_batch_sink: the reap hands its completions to the batch sink in one call (the
    backend's count of reads in flight drops by the batch); once another sink is set in place of
    the one it stands for (a recording wrapper), that sink sees every completion, one call each."""
    harness = make_harness()
    backend = harness.backend
    batches: list[list[tuple[int, int | Exception]]] = []
    backend.set_batch_sink(
        lambda ops, results: batches.append(list(zip(map(id, ops), results, strict=True))), harness._sink
    )
    ops = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(4)]
    harness.submit(ops)
    with anyio.fail_after(10.0):
        while sum(map(len, batches)) < len(ops):
            await anyio.sleep(0.0005)
    assert sorted(sum(batches, [])) == sorted((id(op), ALIGN) for op in ops)
    assert harness.results == {} and backend.in_flight == 0  # the per-op sink saw none of them

    wrapped: list[int] = []

    def wrapper(op: ReadOp, result: int | Exception) -> None:
        wrapped.append(id(op))
        harness._sink(op, result)

    backend.set_sink(wrapper)  # the batch sink stands for harness._sink, not for this one
    more = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(4)]
    harness.submit(more)
    assert await harness.wait(more) == [ALIGN] * 4
    assert sorted(wrapped) == sorted(map(id, more)) and sum(map(len, batches)) == len(ops)


async def test_one_reap_with_a_full_a_short_a_failed_read_and_a_stranger_delivers_each_its_own(
    make_harness: Any, data_file: Path, anyio_backend: object
) -> None:
    """The reap's bulk path (one pass over the CQEs, errors turned into OSError only when one is
    there): a full read, a short read at end of file, a read the kernel fails (EBADF) and a CQE
    the backend never issued, all in one reap: every op gets exactly its own result, in its own
    type, the stranger is counted and dropped, and nothing is left in flight."""
    harness = make_harness(depth=8)
    backend, ring = harness.backend, harness.backend.ring
    write_only = os.open(data_file, os.O_WRONLY)
    try:
        harness.files.fds = (*harness.files.fds, write_only)
        last_page = align_down(FILE_BYTES, ALIGN)
        ops = [ReadOp(0, 0, ALIGN, 0, 0), ReadOp(0, last_page, 2 * ALIGN, 1, 0), ReadOp(1, 0, ALIGN, 2, 0)]
        backend.detach()  # completions pile up: one reap below sees them all
        harness.submit(ops)
        ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, 999_999, 0)])  # a CQE no read of the backend's
        assert ring.enter(1) == 1
        for _ in range(2000):
            if ring.cq_ready() == len(ops) + 1:
                break
            await anyio.sleep(0.001)
        assert ring.cq_ready() == len(ops) + 1
        backend.attach()
        os.eventfd_write(backend._efd, 1)
        full, short, failed = await harness.wait(ops)
    finally:
        harness.files.fds = harness.files.fds[:1]
        os.close(write_only)
    assert type(full) is int and full == ALIGN
    assert type(short) is int and short == FILE_BYTES - last_page
    assert isinstance(failed, OSError) and failed.errno == errno.EBADF
    assert backend.unexpected_completions == 1 and backend.in_flight == 0 and ring.cq_ready() == 0


async def test_a_partly_consumed_batch_takes_back_exactly_the_unconsumed_reads(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """An ``io_uring_enter`` that consumes only part of the published entries, then fails hard:
    the consumed reads complete as usual, the rest are reported not taken (their user_data are the
    last ones handed out) and never reach the kernel."""
    harness = make_harness(depth=8)
    ring = harness.backend.ring
    real_enter = ring.enter
    calls: list[tuple[int, ...]] = []

    def two_then_fault(*args: int) -> int:
        calls.append(args)
        if len(calls) == 1:
            return real_enter(2)  # the kernel takes the first two entries only
        return -errno.EFAULT

    monkeypatch.setattr(ring, "enter", two_then_fault)
    ops = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(5)]
    with pytest.raises(SubmitError) as info:
        harness.submit(ops)
    assert info.value.taken == 2 and harness.backend.in_flight == 2 and harness.backend.queued_entries == 0
    assert ring.sq_unconsumed() == 0
    monkeypatch.undo()
    assert await harness.wait(ops[:2]) == [ALIGN, ALIGN]
    await anyio.sleep(0.01)
    assert all(id(op) not in harness.results for op in ops[2:])
    assert harness.backend.unexpected_completions == 0 and ring.counters == (2, 2)


def test_wait_cqes_blocks_until_enough_completions_are_in_the_cq() -> None:
    """``RawRing.wait_cqes(n, timeout)`` waits the whole timeout while fewer than ``n`` CQEs are ready
    (then returns 0 if some are, ``-ETIME`` if none: reaped ones do not count), and returns at once
    once ``n`` are (the batched wake-ups' waiter thread relies on both)."""
    ring = RawRing(8)
    try:
        assert ring.can_wait_with_timeout
        assert ring.wait_cqes(1, 0.01) == -errno.ETIME
        ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, i + 1, 0) for i in range(2)])
        assert ring.enter(2) == 2
        started = time.perf_counter()
        assert ring.wait_cqes(3, 0.05) == 0
        assert time.perf_counter() - started >= 0.04  # two ready are not three: it waited
        ring.queue([(IORING_OP_NOP, 0, -1, 0, 0, 0, 3, 0)])
        assert ring.enter(1) == 1
        started = time.perf_counter()
        assert ring.wait_cqes(3, 30.0) >= 0
        assert time.perf_counter() - started < 10.0
        assert ring.reap()[0] == [1, 2, 3]
        assert ring.wait_cqes(1, 0.01) == -errno.ETIME  # reaped: nothing is ready any more
    finally:
        ring.close()


@pytest.mark.parametrize("batch_wakeups", [True, False])
async def test_reads_complete_with_and_without_batched_wakeups_and_close_ends_the_waiter(
    make_harness: Any, batch_wakeups: bool, anyio_backend: object
) -> None:
    """With batched wake-ups a waiter thread wakes the loop once the hinted number of completions
    is in the CQ (the kernel does not write the eventfd); without, the kernel wakes it per
    completion. Both deliver every read; close() off the loop ends the waiter thread before it
    releases the ring and the eventfds (on the loop it only stops it: the thread waits on
    duplicates of the descriptors, never on numbers the backend closed)."""
    harness = make_harness(depth=8, batch_wakeups=batch_wakeups)
    backend = harness.backend
    assert backend.features()["batch_wakeups"] is batch_wakeups
    backend.set_wake_hint(lambda: 4)
    for _ in range(3):
        ops = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(4)]
        harness.submit(ops)
        assert await harness.wait(ops) == [ALIGN] * 4
    assert 1 <= backend.wakeups <= 12
    waiter = backend._waiter
    assert (waiter is not None and waiter.is_alive()) is batch_wakeups
    if batch_wakeups:  # the waiter waits in the ring (as for a read the kernel has, which never comes)
        backend._in_flight += 1
        backend._arm()
        backend._in_flight -= 1
        await anyio.sleep(0.002)
    backend.detach()
    await anyio.to_thread.run_sync(harness.close)  # off the loop, as the store closes: it waits for the waiter
    assert waiter is None or not waiter.is_alive()


async def test_a_failed_waiter_thread_hands_the_wakeups_back_to_the_kernel(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """If the waiter thread of batched wake-ups dies, the loop is woken once more and registers
    the eventfd with the ring: every read still completes (nothing waits for a wake-up that never
    comes)."""
    from aioexperts._io import uring_raw

    def broken(ring_fd: int, min_complete: int, timeout: float) -> int:
        raise RuntimeError("the waiter breaks")

    monkeypatch.setattr(uring_raw, "wait_cqes", broken)  # what the waiter thread (backends/waiter.py) calls
    harness = make_harness(depth=8)
    backend = harness.backend
    for _ in range(3):
        ops = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(4)]
        harness.submit(ops)
        assert await harness.wait(ops) == [ALIGN] * 4
    assert backend.features()["batch_wakeups"] is False


async def test_reads_complete_across_quick_detach_and_attach_with_batched_wakeups(
    make_harness: Any, anyio_backend: object
) -> None:
    """Each attach starts a waiter thread with an arming eventfd of its own: a waiter stopped by the
    detach just before cannot take the new waiter's arming (reads would then wait for ever)."""
    harness = make_harness(depth=8)
    backend = harness.backend
    backend.set_wake_hint(lambda: 2)
    for _ in range(40):
        ops = [ReadOp(0, i * ALIGN, ALIGN, i, 0) for i in range(2)]
        harness.submit(ops)
        backend.detach()
        backend.attach()
        assert await harness.wait(ops) == [ALIGN] * 2
