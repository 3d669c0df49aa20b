"""The liburing backend's completions: one batch per reap, and batched wake-ups of the loop.

``UringBackend`` wakes the event loop once per batch of completions through a waiter thread
(:mod:`aioexperts._io.backends.waiter`, the raw ring's too), with the kernel's eventfd writes
switched off; every reap's completions go to the
scheduler's batch sink in one call and end the batch. Skipped where the wheel cannot run.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import direct_io_unavailable
from ioutil import open_files

from aioexperts._io import uring_raw
from aioexperts._io.backends.base import ReadOp, ReadResult
from aioexperts._io.backends.uring import UringBackend
from aioexperts._io.loop import current_loop
from aioexperts._io.slab import Slab

pytestmark = [pytest.mark.liburing, pytest.mark.anyio]

FILE_BYTES = 1 << 20
SLOT_BYTES = 1 << 16
ALIGN = 4096


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("uring_wakeups") / "data.bin"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes())
    return path


class Harness:
    """A liburing backend over one file and a slab, driven without a scheduler: the per-op sink
    and the batch sink that stands for it both record, the batch ends are counted."""

    def __init__(self, data_file: Path, depth: int, **options: Any) -> None:
        direct = direct_io_unavailable(data_file.parent) is None
        self.files, self.slab = open_files([data_file], direct), Slab(8, SLOT_BYTES)
        self.backend = UringBackend(self.files, self.slab, current_loop(), depth, **options)
        self.results: dict[int, ReadResult] = {}
        self.kept: list[ReadOp] = []
        self.batches: list[int] = []  # ops per batch-sink call
        self.batch_ends = 0
        self.backend.set_sink(self._sink, self._batch_end)
        self.backend.set_batch_sink(self._batch, self._sink)
        self.backend.attach()

    def _sink(self, op: ReadOp, result: ReadResult) -> None:
        assert id(op) not in self.results, "two completions for one read"
        self.results[id(op)] = result

    def _batch(self, ops: list[ReadOp], results: list[ReadResult]) -> None:
        self.batches.append(len(ops))
        for op, result in zip(ops, results, strict=True):
            self._sink(op, result)

    def _batch_end(self) -> None:
        self.batch_ends += 1

    def submit(self, ops: list[ReadOp]) -> None:
        self.kept.extend(ops)  # ids stay unique while the results are keyed by them
        self.backend.submit(ops)

    async def wait(self, ops: list[ReadOp]) -> list[ReadResult]:
        with anyio.fail_after(10.0):
            while any(id(op) not in self.results for op in ops):
                await anyio.sleep(0.0005)
        return [self.results[id(op)] for op in ops]

    def close(self) -> None:
        self.backend.close()
        self.slab.close()
        self.files.close()


@pytest.fixture
async def make_harness(data_file: Path, anyio_backend: object) -> AsyncIterator[Any]:
    made: list[Harness] = []

    def make(depth: int = 8, **options: Any) -> Harness:
        harness = Harness(data_file, depth, **options)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.backend.detach()
        await anyio.to_thread.run_sync(harness.close)


def reads(n: int, first: int = 0) -> list[ReadOp]:
    return [ReadOp(0, (first + i) * ALIGN, ALIGN, i, 0) for i in range(n)]


def waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aioexperts-uring-waiter" and t.is_alive()]


@pytest.mark.parametrize("batch_wakeups", [True, False])
async def test_reads_complete_with_and_without_batched_wakeups_in_batches(
    make_harness: Any, data_file: Path, batch_wakeups: bool
) -> None:
    """Every read completes with its bytes either way; each reap hands its completions to the batch
    sink in one call and ends the batch; with batched wake-ups a waiter thread runs (and the hint
    of 4 lets the 4 reads of a round come in few wake-ups), and close() off the loop ends it."""
    harness = make_harness(batch_wakeups=batch_wakeups)
    backend = harness.backend
    assert backend.features()["batch_wakeups"] is batch_wakeups
    assert (backend._waiter is not None and backend._waiter.is_alive()) is batch_wakeups
    backend.set_wake_hint(lambda: 4)
    data = data_file.read_bytes()
    for r in range(3):
        ops = reads(4, 4 * r)
        harness.submit(ops)
        assert await harness.wait(ops) == [ALIGN] * 4
        for op in ops:
            assert bytes(harness.slab.view(op.slot, 0, ALIGN)) == data[op.file_offset : op.file_offset + ALIGN]
    assert sum(harness.batches) == 12 and harness.batch_ends == len(harness.batches)
    assert 1 <= backend.features()["wakeups"] <= 12
    if batch_wakeups:
        assert len(harness.batches) <= 6  # 4 reads per wake-up, or a few more wake-ups at the 20 ms timeout
    waiter = backend._waiter
    backend.detach()
    await anyio.to_thread.run_sync(harness.close)  # off the loop, as the store closes: it waits for the waiter
    assert waiter is None or not waiter.is_alive()


async def test_a_failed_waiter_thread_hands_the_wakeups_back_to_the_kernel(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the waiter thread dies, the loop is woken once more and switches the kernel's eventfd
    writes back on: every read still completes (nothing waits for a wake-up that never comes)."""

    def broken(ring_fd: int, min_complete: int, timeout: float) -> int:
        raise RuntimeError("the waiter breaks")

    monkeypatch.setattr(uring_raw, "wait_cqes", broken)
    harness = make_harness()
    backend = harness.backend
    assert backend.features()["batch_wakeups"] is True
    for r in range(3):
        ops = reads(4, 4 * r)
        harness.submit(ops)
        assert await harness.wait(ops) == [ALIGN] * 4
    assert backend.features()["batch_wakeups"] is False


async def test_reads_complete_across_quick_detach_and_attach(make_harness: Any) -> None:
    """Each attach starts a waiter thread with an arming eventfd of its own: a waiter stopped by the
    detach just before cannot take the new one's arming (reads would then wait for ever)."""
    harness = make_harness()
    backend = harness.backend
    backend.set_wake_hint(lambda: 2)
    for r in range(40):
        ops = reads(2, 2 * (r % 100))
        harness.submit(ops)
        backend.detach()
        backend.attach()
        assert await harness.wait(ops) == [ALIGN] * 2
    with anyio.fail_after(5):  # the stopped waiters end by themselves
        while len(waiters()) > 1:
            await anyio.sleep(0.001)
