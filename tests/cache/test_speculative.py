"""Speculative loads: read only while the device would otherwise sit idle, moved up when asked for.

The decode pass predicts ``PrefetchOptions.speculative`` layers beyond the prefetch depth; their
loads wait in a queue of their own that the scheduler submits only while nothing else is queued and
fewer than ``SPECULATIVE_MAX_OPS`` reads are in flight (timelines of a 1/4 limit showed the disk idle
about a fifth of each token, between a layer's prefetch landing and the next layer's routing).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from cacheutil import CheckedFake, cache_of, fake_factory, settle

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts._cache.scheduler import SPECULATIVE_MAX_OPS, LoadState, Priority
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SPEC = SyntheticSpec(n_layer=6, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "six.gguf"
    write_synthetic_model(path, SPEC)
    return path


def loads_of(ops: list[aioexperts.testing.FakeBackend] | list[object]) -> list[tuple[int, int]]:
    """The load keys of a list of read ops, each load once, in order."""
    return [key for key, _ in itertools.groupby(op.context[0].plan.key for op in ops)]  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def drained(fake: CheckedFake) -> AsyncIterator[None]:
    """Complete every read on the way out, pass or fail: a store closes only once its reads are done."""
    try:
        yield
    finally:
        for _ in range(4):
            fake.complete_all()
            await settle()


def load_of(store: aioexperts.ExpertStore, key: tuple[int, int]) -> object:
    entry = cache_of(store).entries[key]
    assert entry.load is not None
    return entry.load


async def test_speculative_loads_wait_for_an_idle_device_then_go_out(model_path: Path, anyio_backend: object) -> None:
    """Nothing speculative is submitted beside queued or many in-flight reads; the completions that
    bring the device below the cap submit them (a completion that did not flush them left the disk
    idle: the bug this guards)."""
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False))
    async with aioexperts.open(model_path, slots=16, io=io) as store:
        fake = holder["fake"]
        started = store.start_loads(0, [0, 1], prefetch=[(1, 0), (1, 1)], speculative=[(2, 0), (2, 1)])
        assert started == 6
        # demand and prefetch went out (12 reads > the cap): the speculative loads wait
        assert loads_of(fake.submitted[-1]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert len(fake.pending) == 12 > SPECULATIVE_MAX_OPS
        spec = [load_of(store, (2, e)) for e in (0, 1)]
        assert all(load.state is LoadState.QUEUED and load.priority is Priority.SPECULATIVE for load in spec)
        try:
            # complete reads one by one: the first speculative load goes out once the reads in
            # flight leave room for its three under the cap, never earlier
            for _ in range(12):
                fake.complete(fake.pending[0])
                await settle()
                keys = [op.context[0].plan.key for op in fake.pending]
                if (2, 0) in keys:
                    break
                assert len(fake.pending) > SPECULATIVE_MAX_OPS - 3 or not keys
            assert (2, 0) in keys, "the completions did not submit the speculative load"
            assert len(fake.pending) <= SPECULATIVE_MAX_OPS and (2, 1) not in keys
        finally:  # a store closes only when its reads are done
            for _ in range(4):
                fake.complete_all()
                await settle()
        assert cache_of(store).state_of((2, 0)) is SlotState.READY
        assert cache_of(store).state_of((2, 1)) is SlotState.READY
        # a later request of a speculative expert is a prefetch hit in time
        s0 = store.statistics()
        async with store.experts(2, [0]):
            pass
        s1 = store.statistics()
        assert (s1.prefetched_in_time - s0.prefetched_in_time, s1.misses - s0.misses) == (1, 0)


async def test_a_queued_speculative_load_moves_up_when_asked_for(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False))
    async with aioexperts.open(model_path, slots=16, io=io) as store:
        fake = holder["fake"]
        async with drained(fake):
            store.start_loads(0, [0, 1, 2, 3], speculative=[(3, 0), (3, 1), (4, 0)])
            load30, load31, load40 = (load_of(store, k) for k in ((3, 0), (3, 1), (4, 0)))
            assert all(load.priority is Priority.SPECULATIVE for load in (load30, load31, load40))
            # the next step: (3, 0) is now within the prefetch depth, (3, 1) a demand of the step
            store.start_loads(3, [1], prefetch=[(3, 0)])
            assert load30.priority is Priority.PREFETCH and load31.priority is Priority.DEMAND  # type: ignore[attr-defined]
            assert load40.priority is Priority.SPECULATIVE  # type: ignore[attr-defined]
            # both went out in that call (the ring's depth has room), the speculative one did not
            pending = {op.context[0].plan.key for op in fake.pending}
            assert {(3, 0), (3, 1)} <= pending and (4, 0) not in pending


async def test_drop_prefetches_drops_queued_speculative_loads_and_frees_their_slots(
    model_path: Path, anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False))
    async with aioexperts.open(model_path, slots=16, io=io) as store:
        fake = holder["fake"]
        async with drained(fake):
            store.start_loads(0, [0, 1, 2, 3], speculative=[(5, 0), (5, 1)])
            free_before = len(cache_of(store).free_slots)
            assert store.drop_prefetches(keep=lambda key: key == (5, 1)) == 1
            assert (5, 0) not in cache_of(store).entries and (5, 1) in cache_of(store).entries
            assert len(cache_of(store).free_slots) == free_before + 1


async def test_the_wake_hint_with_only_speculative_loads_queued_wakes_in_time_for_them(
    model_path: Path, anyio_backend: object
) -> None:
    """A request waiting for many completions must not keep the loop asleep past the point where
    a speculative load could go out."""
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False))
    async with aioexperts.open(model_path, slots=16, io=io) as store:
        fake = holder["fake"]
        async with drained(fake):
            scheduler = cache_of(store).scheduler
            store.start_loads(0, [0, 1, 2, 3, 4, 5], speculative=[(1, 0)])
            scheduler.waiting_need = lambda: 18  # every read of the six demand loads
            in_flight = len(fake.pending)
            assert in_flight == 18
            assert scheduler.wake_hint() == in_flight - (SPECULATIVE_MAX_OPS - 3)
            scheduler.waiting_need = None


async def test_the_router_predicts_speculative_layers_for_one_decode_row_only(
    model_path: Path, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=48) as store:
        router = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=2, speculative=2))._router
        await router.warmup() if hasattr(router, "warmup") and callable(router.warmup) else None
        assert router.upcoming_layers(0) == [1, 2] and router.speculative_layers(0) == [3, 4]
        assert router.speculative_layers(4) == [1, 2]  # wraps to the next token's first layers, never 4
        rng = np.random.default_rng(0)
        one = router.route(0, rng.standard_normal((1, SPEC.n_embd)).astype(np.float32))
        assert {k[0] for k in one.prefetch} == {1, 2} and {k[0] for k in one.speculative} == {3, 4}
        many = router.route(0, rng.standard_normal((3, SPEC.n_embd)).astype(np.float32))
        assert many.speculative == []  # prefill and batched rows: no speculative reads
    async with aioexperts.open(model_path, slots=48) as store:
        off = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(speculative=0))._router
        assert off.speculative_layers(0) == []
        none = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(depth=0, speculative=3))._router
        assert none.speculative_layers(0) == []  # no prefetch, no speculation


def test_speculative_must_be_a_non_negative_int() -> None:
    with pytest.raises(aioexperts.ConfigError):
        aioexperts.PrefetchOptions(speculative=-1)
    with pytest.raises(aioexperts.ConfigError):
        aioexperts.PrefetchOptions(speculative=1.5)  # type: ignore[arg-type]


async def test_speculative_loads_keep_the_ring_depth(model_path: Path, anyio_backend: object) -> None:
    """A ring shallower than SPECULATIVE_MAX_OPS bounds the speculative reads too (one flush loop
    for the three queues, one set of bounds)."""
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False), queue_depth=4)
    async with aioexperts.open(model_path, slots=16, io=io) as store:
        fake = holder["fake"]
        async with drained(fake):
            store.start_loads(0, [], speculative=[(2, 0), (2, 1)])
            assert [op.context[0].plan.key for op in fake.pending] == [(2, 0)] * 3
            assert load_of(store, (2, 1)).state is LoadState.QUEUED  # type: ignore[attr-defined]
