"""Where a token's experts came from and where the pass waited: the store's request categories,
the device's busy time and the runner's stall seconds (issue 36, honest statistics)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aioexperts
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


def fake_store(path: Path, holder: dict[str, FakeBackend], **kwargs: Any) -> aioexperts.ExpertStore:
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        holder["fake"] = FakeBackend(files, slab, loop, depth, **kwargs)
        return holder["fake"]

    return aioexperts.open(path, slots=8, io=aioexperts.IOOptions(backend=factory))


async def settle(ticks: int = 5) -> None:
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()


def categories(st: aioexperts.StoreStatistics) -> tuple[int, int, int, int]:
    return st.cached_hits, st.prefetched_in_time, st.prefetched_late, st.demand_misses


async def test_each_request_lands_in_one_category(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model_path, holder, auto=False) as store:
        fake = holder["fake"]

        async def pin(ids: list[int]) -> None:
            async with store.experts(0, ids):
                pass

        async with anyio.create_task_group() as tg:  # a cold expert: a demand miss
            tg.start_soon(pin, [3])
            await settle()
            fake.complete_all()
        assert categories(store.statistics()) == (0, 0, 0, 1)

        assert store.prefetch([(0, 0), (0, 1)]) == 2
        await settle()
        slot0 = next(op.slot for op in fake.pending if op.context[0].plan.key == (0, 0))
        for op in [op for op in fake.pending if op.slot == slot0]:
            fake.complete(op)  # (0, 0) arrives in time, (0, 1) is still being read
        async with anyio.create_task_group() as tg:
            tg.start_soon(pin, [0, 1, 2, 3])
            await settle()
            fake.complete_all()
        st = store.statistics()
        # 3 resident from before; 0 prefetched and READY; 1 prefetched, still loading; 2 a new read
        assert categories(st) == (1, 1, 1, 2)
        assert st.requests == 5 == sum(categories(st))
        assert st.hits == 2 and st.inflight_joins == 1 and st.misses == 2  # the old counters agree

        await pin([0, 1])  # now resident, and no prefetch brought them since: the cache's own hits
        assert categories(store.statistics()) == (3, 1, 1, 2)

        store.prefetch([(0, 5)])
        await settle()
        fake.complete_all()
        await settle()
        await pin([5])  # every key READY: the pin-at-once path counts it as prefetched in time
        # start_loads' demand reads count as the request's misses, whichever path pins them
        store.start_loads(0, [6])
        await settle()
        fake.complete_all()
        await settle()
        await pin([6])
        st = store.statistics()
        assert categories(st) == (3, 2, 1, 3)
        assert st.requests == sum(categories(st)) == 9
        assert st.low_tier_misses == 0


async def test_device_busy_time_and_stalls_follow_a_known_delay(model_path: Path, anyio_backend: object) -> None:
    delay = 0.15
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model_path, holder, delay=delay) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        x = np.random.default_rng(0).standard_normal((1, SMALL.n_embd)).astype(np.float32)
        t0 = time.perf_counter()
        await runner.moe(0, x)  # cold: its experts are read in one submission
        wall = time.perf_counter() - t0
        st, rs = store.statistics(), runner.statistics()
        assert st.demand_misses == SMALL.n_expert_used
        assert delay <= st.device_busy_seconds <= wall
        assert delay <= rs.stall_seconds <= rs.io_wait_seconds <= wall
        assert st.device_rate is not None and st.device_rate == pytest.approx(st.bytes_read / st.device_busy_seconds)

        stalled, busy = rs.stall_seconds, st.device_busy_seconds
        await runner.moe(0, x)  # the same experts, resident: no read, no stall
        st, rs = store.statistics(), runner.statistics()
        assert st.cached_hits == SMALL.n_expert_used
        assert st.device_busy_seconds == busy
        assert rs.stall_seconds - stalled < delay / 3


async def test_reads_still_in_flight_count_as_busy_time(model_path: Path, anyio_backend: object) -> None:
    """A snapshot taken while reads are in flight counts the open busy interval (a run whose
    prefetches never all landed reported no device time, "device idle", after reading 549 MB)."""
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model_path, holder, auto=False) as store:
        assert store.prefetch([(0, 0), (0, 1)]) == 2
        await settle()
        fake = holder["fake"]
        in_flight = bool(fake.pending)
        await anyio.sleep(0.05)
        first = store.statistics().device_busy_seconds
        await anyio.sleep(0.02)
        second = store.statistics().device_busy_seconds
        fake.complete_all()  # before any assert: a store closing with reads pending would wait for them
        await settle()
        assert in_flight and 0.05 <= first < second
        landed = store.statistics().device_busy_seconds
        assert landed >= second
        await anyio.sleep(0.02)
        assert store.statistics().device_busy_seconds == landed  # nothing in flight: no time added


async def test_statistics_reset_zeroes_the_new_counters(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model_path, holder, delay=0.01) as store:
        async with store.experts(0, [0, 1]):
            pass
        assert store.statistics().device_busy_seconds > 0
        store.reset_statistics()
        st = store.statistics()
        assert categories(st) == (0, 0, 0, 0) and st.device_busy_seconds == 0.0 and st.device_rate is None


async def test_the_sources_sum_to_the_requests_with_prefetch_on(model_path: Path, anyio_backend: object) -> None:
    """Tokens through every layer with the default predictor: prefetches arrive in time or late,
    and every request still has exactly one source."""
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model_path, holder, delay=0.002) as store:
        runner = aioexperts.MoERunner(store)  # the default prefetch of the layers ahead
        rng = np.random.default_rng(1)
        for _ in range(12):
            await runner.run_moe_layers(rng.standard_normal((1, SMALL.n_embd)).astype(np.float32))
        st = store.statistics()
        assert st.requests == sum(categories(st)) == 12 * SMALL.n_layer * SMALL.n_expert_used
        assert st.prefetch_issued > 0 and st.prefetched_in_time + st.prefetched_late > 0
        assert st.prefetch_hits == st.prefetched_in_time + st.prefetched_late
        assert 0 <= runner.statistics().stall_seconds <= runner.statistics().io_wait_seconds
