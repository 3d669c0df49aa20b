"""The compiled fan-out (kernels/fanout.py, ComputePool.fan_out): every item exactly once, statuses summed."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numba
import numpy as np
import pytest

from aioexperts._compute import fused
from aioexperts._compute import pool as pool_module
from aioexperts._compute.kernels import fanout
from aioexperts._compute.kernels.common import address_pointer
from aioexperts._errors import ConfigError

pytestmark = pytest.mark.skipif(not fused.backend().name == "numba", reason="needs numba")

# descriptor: counts address, items, work iterations per item
_SIG = numba.types.int64(numba.types.int64, numba.types.int64)


@numba.cfunc(_SIG, nopython=True)
def _count_task(desc_address, item):  # type: ignore[no-untyped-def]
    desc = numba.carray(address_pointer(desc_address), (3,), np.int64)
    counts = numba.carray(address_pointer(desc[0]), (desc[1],), np.int64)
    counts[item] += 1
    acc = 0.0
    for i in range(desc[2]):  # some work, so that both threads take items
        acc += np.sqrt(np.float64(i + item))
    counts[item] += 0 if acc >= 0 else 1
    return 1 if item % 3 == 0 else 0


@numba.njit(nogil=True)
def _post_back_to_back(ctrl, fn, descs, ns, rounds):  # type: ignore[no-untyped-def]
    """Posts that follow each other within nanoseconds (no Python between them); the statuses summed."""
    total = 0
    for _ in range(rounds):
        for i in range(descs.shape[0]):
            total += fanout.fan_out(ctrl, fn, descs[i], ns[i])
    return total


def _descriptor(counts: np.ndarray, work: int) -> np.ndarray:
    return np.array([counts.ctypes.data, counts.shape[0], work], dtype=np.int64)


def test_every_item_runs_exactly_once_with_a_worker_serving_between_posts() -> None:
    ctrl = fanout.new_control()
    signal = np.zeros(1, dtype=np.int64)
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            fanout.serve(ctrl, signal, 0, 0, 1 << 20)

    thread = threading.Thread(target=worker)
    thread.start()
    # two posts that alternate (different items and memory): a worker that read one post must
    # never run an item of the next with the old descriptor, nor an item twice
    # (the third: items of no work, so that both threads claim at the same moments)
    a, b, c = np.zeros(7, dtype=np.int64), np.zeros(13, dtype=np.int64), np.zeros(64, dtype=np.int64)
    desc_a, desc_b, desc_c = _descriptor(a, 200), _descriptor(b, 50), _descriptor(c, 0)
    rounds = 3000
    try:
        statuses = set()
        for _ in range(rounds):
            statuses.add(fanout.fan_out(ctrl, _count_task.address, desc_a.ctypes.data, 7))
            statuses.add(fanout.fan_out(ctrl, _count_task.address, desc_b.ctypes.data, 13))
            statuses.add(fanout.fan_out(ctrl, _count_task.address, desc_c.ctypes.data, 64))
        # the same from compiled code: a worker finishing a post's last item meets the next post at once
        addresses = np.array([d.ctypes.data for d in (desc_a, desc_b, desc_c)], dtype=np.int64)
        total = _post_back_to_back(ctrl, _count_task.address, addresses, np.array([7, 13, 64]), rounds)
    finally:
        stop.set()
        signal[0] = 1
        thread.join()
    assert total == rounds * (3 + 5 + 22)
    np.testing.assert_array_equal(a, np.full(7, 2 * rounds))
    np.testing.assert_array_equal(b, np.full(13, 2 * rounds))
    np.testing.assert_array_equal(c, np.full(64, 2 * rounds))
    assert statuses == {3, 5, 22}  # items 0, 3, 6 (of 7), 0, 3, .., 12 (of 13) and 0, 3, .., 63 return 1
    assert ctrl[fanout.HELPED] > 0  # the worker took items
    assert ctrl[fanout.SPINNERS] == 0


def test_run_inline_and_zero_items() -> None:
    counts = np.zeros(5, dtype=np.int64)
    desc = _descriptor(counts, 0)
    assert fanout.run_inline(_count_task.address, desc.ctypes.data, 5) == 2
    np.testing.assert_array_equal(counts, np.ones(5))
    ctrl = fanout.new_control()
    assert fanout.fan_out(ctrl, _count_task.address, desc.ctypes.data, 0) == 0
    np.testing.assert_array_equal(counts, np.ones(5))


def _ready(pool: pool_module.ComputePool) -> None:
    """Start the pool's threads and wait until its compiled kernels are loaded."""
    pool.fan_out(_count_task.address, _descriptor(np.zeros(2, dtype=np.int64), 0), 2)
    deadline = time.monotonic() + 120
    while pool._spin is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._spin is not None


def test_a_sleeping_worker_is_asked_to_join_and_concurrent_callers_stay_correct() -> None:
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    try:
        _ready(pool)
        time.sleep(0.05)  # no spin job: the workers sleep
        helped = pool.statistics().fan_out_items_helped
        counts = np.zeros(64, dtype=np.int64)
        desc = _descriptor(counts, 200_000)  # about 1 ms per item: the woken worker arrives in time
        assert pool.fan_out(_count_task.address, desc, 64) == 22
        np.testing.assert_array_equal(counts, np.ones(64))
        assert pool.statistics().fan_out_items_helped > helped

        # two callers at once: one posts, the other runs its items alone (never more threads)
        results: list[np.ndarray] = []

        def caller() -> None:
            mine = np.zeros(40, dtype=np.int64)
            for _ in range(50):
                pool.fan_out(_count_task.address, _descriptor(mine, 1000), 40)
            results.append(mine)

        threads = [threading.Thread(target=caller) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for mine in results:
            np.testing.assert_array_equal(mine, np.full(40, 50))
        assert pool.statistics().fan_outs >= 102
    finally:
        pool.close()


def test_a_spin_job_keeps_a_worker_claiming_items() -> None:
    pool = pool_module.ComputePool(2, limit_native_threads=False, spin_us=20_000)

    def job() -> tuple[int, int]:
        before = pool.statistics().fan_out_items_helped
        counts = np.zeros(8, dtype=np.int64)
        desc = _descriptor(counts, 20_000)
        for _ in range(200):
            pool.fan_out(_count_task.address, desc, 8)
        assert (counts == 200).all()
        return before, pool.statistics().fan_out_items_helped

    async def run() -> tuple[int, int]:
        return await pool.run(job, spin=True)

    try:
        _ready(pool)
        before, after = asyncio.run(run())
        assert after > before  # the spinning worker took items (how many depends on the machine's load)
    finally:
        pool.close()


def test_bind_two_writes_both_addresses_and_returns_the_descriptors() -> None:
    desc = np.zeros(8, dtype=np.int64)
    x = np.zeros((1, 64), dtype=np.float32)
    out = np.zeros(32, dtype=np.float32)[::2]  # any layout: only the data pointer is taken
    got = fanout.bind_two(desc, 5, x, 2, out)
    assert got == desc.ctypes.data
    assert desc[5] == x.ctypes.data and desc[2] == out.ctypes.data
    assert desc[[0, 1, 3, 4, 6, 7]].tolist() == [0] * 6


def test_a_worker_already_spinning_gets_the_post_and_run_in_one_call() -> None:
    """With a worker spinning, a fan-out posts and runs in one compiled call (not publish, then
    finish); every item still runs exactly once and the statuses are summed."""
    pool = pool_module.ComputePool(2, limit_native_threads=False, spin_us=20_000)

    def job() -> tuple[int, int]:
        counts = np.zeros(9, dtype=np.int64)
        desc = _descriptor(counts, 2_000)
        status = int(pool.fan_out(_count_task.address, desc, 9) or 0)  # invites a worker, which then spins
        deadline = time.monotonic() + 5
        while not pool._control[fanout.SPINNERS] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool._control[fanout.SPINNERS]
        spinner = pool._spin
        assert spinner is not None
        posted: list[int] = []

        def publish(*args: object) -> int:
            posted.append(1)
            return int(spinner.publish(*args))

        pool._spin = dataclasses.replace(spinner, publish=publish)
        try:
            status += sum(int(pool.fan_out(_count_task.address, desc, 9) or 0) for _ in range(50))
        finally:
            pool._spin = spinner
        assert (counts == 51).all()
        return status, len(posted)

    async def run() -> tuple[int, int]:
        return await pool.run(job, spin=True)

    try:
        _ready(pool)
        status, posted = asyncio.run(run())
        assert status == 51 * 3  # items 0, 3, 6 return 1
        assert posted <= 5  # the spinning worker was there for (nearly) every post: one call each
    finally:
        pool.close()


def test_fan_out_checks_its_arguments() -> None:
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    try:
        desc = _descriptor(np.zeros(1, dtype=np.int64), 0)
        with pytest.raises(ConfigError):
            pool.fan_out(_count_task.address, desc, -1)
        with pytest.raises(ConfigError):
            pool.fan_out(_count_task.address, desc, fanout.MAX_ITEMS + 1)
        with pytest.raises(ConfigError):
            pool.fan_out(_count_task.address, desc.astype(np.int32), 1)
    finally:
        pool.close()
    # a closed pool runs every item on the calling thread
    counts = np.zeros(4, dtype=np.int64)
    assert pool.fan_out(_count_task.address, _descriptor(counts, 0), 4) in (None, 2)


def test_the_split_flash_attention_has_the_bits_of_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioexperts._compute.kernels import halfvec
    from aioexperts._compute.kernels.flash import flash_attend_f16_bits

    if not halfvec.hardware_half():
        pytest.skip("no hardware float16 conversion: the scalar flash kernel serves")
    rng = np.random.default_rng(5)
    n_kv, n_head, n_head_kv, d = 400, 12, 3, 64  # 4,800 head-positions: over FLASH_SPLIT_MIN
    q = rng.standard_normal((1, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float16)
    sinks = rng.standard_normal(n_head).astype(np.float32)
    want = np.empty((1, n_head, d), dtype=np.float32)
    flash_attend_f16_bits(q, k.view(np.uint16), v.view(np.uint16), n_kv - 1, 0.125, sinks, 0, want, 0, n_head)
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    monkeypatch.setattr(pool_module, "_pool", pool)
    try:
        _ready(pool)
        before = pool.statistics().fan_outs
        got = np.full((1, n_head, d), np.nan, dtype=np.float32)
        fused.flash_kernel()(q, k, v, n_kv - 1, np.float32(0.125), sinks, 0, got)  # type: ignore[misc]
        assert pool.statistics().fan_outs == before + 1  # one item per KV head
    finally:
        pool.close()
    np.testing.assert_array_equal(got, want)


def test_the_seconds_in_fan_outs_are_counted_posted_or_inline() -> None:
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    try:
        _ready(pool)
        before = pool.statistics().fan_out_seconds
        desc = _descriptor(np.zeros(16, dtype=np.int64), 200_000)  # about 1 ms per item
        t0 = time.perf_counter()
        pool.fan_out(_count_task.address, desc, 16)
        wall = time.perf_counter() - t0
        posted = pool.statistics().fan_out_seconds - before
        assert 0 < posted <= wall
        with pool._fan_lock:  # another thread's fan-out in progress: this one runs inline, counted too
            pool.fan_out(_count_task.address, desc, 16)
        assert pool.statistics().fan_out_seconds - before > posted
        one = pool.statistics().fan_out_seconds
        pool.fan_out(_count_task.address, desc, 1)  # one item: not a fan-out
        assert pool.statistics().fan_out_seconds == one
    finally:
        pool.close()
