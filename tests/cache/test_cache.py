"""The expert cache and scheduler: slot safety under cancellation, faults, batching and load."""

from __future__ import annotations

import errno
import itertools
import os
import random
import re
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from cacheutil import CheckedFake, cache_of, fake_factory, settle
from ioutil import pread_segment

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


@pytest.fixture(scope="module")
def reference(model_path: Path) -> dict[tuple[int, int], list[bytes]]:
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    return {(loc.layer, loc.expert): [pread_segment(model, s) for s in loc.segments] for loc in layout}


def as_bytes(view: aioexperts.ExpertView | None) -> list[bytes]:
    assert view is not None
    return [bytes(p.data) for p in (view.gate, view.up, view.down)]


async def test_cancelled_waiter_leaves_slots_loading_until_their_own_completion(
    model_path: Path, reference: dict[tuple[int, int], list[bytes]], anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}
    store = aioexperts.open(model_path, slots=8, io=aioexperts.IOOptions(backend=fake_factory(holder, auto=False)))
    await store.start()
    fake, cache = holder["fake"], cache_of(store)
    cancelled = False

    async def want_all() -> None:
        nonlocal cancelled
        try:
            async with store.experts(0, range(8)):
                raise AssertionError("must not get the experts")
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(want_all)
        await settle()
        assert len(fake.pending) == 24 and fake.batches == [24]  # eight experts, one submission
        slot0 = cache.entries[(0, 0)].slot
        for op in fake.ops_for_slot(slot0):
            fake.complete(op)
        await settle()
        tg.cancel_scope.cancel()
    assert cancelled
    assert cache.state_of((0, 0)) is SlotState.READY
    loading = {e: cache.entries[(0, e)].slot for e in range(1, 8)}
    assert all(cache.state_of((0, e)) is SlotState.LOADING for e in loading)
    assert cache.pinned_slots == 0

    # the same slots, requested at once for other experts: only slot0 is reusable, so the request
    # cannot be served now (those LOADING slots are not pinned: it waits for them)
    got: list[list[bytes]] = []

    async def want_other_layer() -> None:
        async with store.experts(1, range(8), wait=True) as views:
            got.extend(as_bytes(v) for v in views)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want_other_layer)
        await settle()
        assert len(fake.pending) == 21  # nothing new was submitted into a loading slot
        for e, slot in loading.items():
            assert cache.state_of((0, e)) is SlotState.LOADING
            for op in fake.ops_for_slot(slot):
                fake.complete(op)
            await settle()
            assert cache.state_of((0, e)) is SlotState.READY or (0, e) not in cache.entries
        await settle()
        fake.complete_all()  # the other layer's reads
        await settle()
    assert got == [reference[(1, e)] for e in range(8)]
    assert fake.violations == []

    # close() waits for every read in flight; the waiter then learns the store was closed
    late: list[BaseException] = []

    async def late_waiter() -> None:
        try:
            await cache_of(store).acquire([(2, 0)])
        except aioexperts.StoreClosedError as exc:
            late.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(late_waiter)
        await settle()
        assert len(fake.pending) == 3
        closed = anyio.Event()

        async def close() -> None:
            await store.aclose()
            closed.set()

        tg.start_soon(close)
        await settle()
        assert not closed.is_set() and not fake.closed
        fake.complete_all()
        with anyio.fail_after(10):  # the release itself runs in a thread
            await closed.wait()
        assert fake.closed
    assert len(late) == 1
    assert fake.violations == []


async def test_out_of_order_and_half_reads_are_completed_at_the_right_offset(
    model_path: Path, reference: dict[tuple[int, int], list[bytes]], anyio_backend: object
) -> None:
    halved: set[int] = set()

    def half_once(op):  # type: ignore[no-untyped-def]
        load, read = op.context  # the first attempt of every planned read comes back half
        if id(read) in halved:
            return None
        halved.add(id(read))
        return op.n_bytes // 2

    holder: dict[str, CheckedFake] = {}
    factory = fake_factory(holder, order="shuffle", fault=half_once, seed=3)
    async with aioexperts.open(model_path, slots=5, io=aioexperts.IOOptions(backend=factory)) as store:
        for layer in store.layout.layers:
            async with store.experts(layer, [0, 3, 5, 7]) as views:
                assert [as_bytes(v) for v in views] == [reference[(layer, e)] for e in (0, 3, 5, 7)]
        st = store.statistics()
        assert st.read_retries == 36  # every read came back half; the rest was read again
        assert st.read_errors == 0
    assert holder["fake"].violations == []


async def test_zero_bytes_before_eof_fails_every_waiter_and_frees_the_slot(
    model_path: Path, reference: dict[tuple[int, int], list[bytes]], anyio_backend: object
) -> None:
    poison = {"on": True}

    def zero_for_expert3(op):  # type: ignore[no-untyped-def]
        load, _read = op.context
        if poison["on"] and load.plan.location.expert == 3:
            return 0
        return None

    async with aioexperts.open(
        model_path, slots=4, io=aioexperts.IOOptions(backend=fake_factory({}, fault=zero_for_expert3))
    ) as store:
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                async with store.experts(0, [3, 1]):
                    pass
            except aioexperts.ExpertReadError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
        # one read's failure, a copy of it for each waiter (one object's traceback grew in every task)
        assert len(errors) == 3 and all(type(e) is type(errors[0]) and str(e) == str(errors[0]) for e in errors)
        assert "unexpected end of file" in str(errors[0])
        assert cache_of(store).state_of((0, 3)) is SlotState.FREE
        assert cache_of(store).state_of((0, 1)) is SlotState.READY  # the other expert is fine
        assert store.statistics().read_errors == 1
        poison["on"] = False
        async with store.experts(0, [3]) as views:  # usable, and the expert can be read again
            assert as_bytes(views[0]) == reference[(0, 3)]
        assert len(cache_of(store).free_slots) + len(cache_of(store).entries) == 4


@pytest.mark.parametrize("backend", ["threads", "auto"])
async def test_a_model_file_cut_short_names_its_size_in_the_read_error(
    model_path: Path, tmp_path: Path, backend: str, anyio_backend: object
) -> None:
    """The file is truncated under an open store (a copy cut short is refused when it is opened): the
    error names the read, its 0 bytes, the file's size when the store opened it and that it is shorter
    now (not its size now: an ``fstat`` on the loop thread can block, tests/blocking.py)."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_path.read_bytes())
    opened = path.stat().st_size
    async with aioexperts.open(path, slots=4, io=aioexperts.IOOptions(backend=backend)) as store:
        os.truncate(path, 1234)
        with pytest.raises(aioexperts.ExpertReadError) as info:
            async with store.experts(1, [3]):
                pass
    text = str(info.value)
    found = re.search(r"the read of (\d+) bytes at offset (\d+) of (\S+) returned 0 bytes", text)
    assert found is not None and found[3] == str(path) and int(found[2]) >= 1234, text
    assert text.endswith(
        f"returned 0 bytes, before the end of the file ({opened} bytes when the store opened it, as its header "
        "says): the file is shorter now (truncated, or being rewritten?)"
    ), text


async def test_os_error_keeps_the_cause(model_path: Path, anyio_backend: object) -> None:
    def eio(op):  # type: ignore[no-untyped-def]
        return OSError(errno.EIO, "Input/output error")

    async with aioexperts.open(
        model_path, slots=4, io=aioexperts.IOOptions(backend=fake_factory({}, fault=eio))
    ) as store:
        with pytest.raises(aioexperts.ExpertReadError, match="Input/output error") as info:
            async with store.experts(0, [2]):
                pass
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
        assert cache_of(store).entries == {}


@pytest.mark.parametrize("backend", ["io_uring", "threads", "fake"])
async def test_1000_tasks_overlapping_experts_through_16_slots(
    model_path: Path, reference: dict[tuple[int, int], list[bytes]], backend: str, anyio_backend: object
) -> None:
    rng = random.Random(7)
    requests = [(rng.randrange(3), rng.sample(range(8), rng.randint(1, 3))) for _ in range(1000)]
    holder: dict[str, CheckedFake] = {}
    chosen = fake_factory(holder, order="shuffle") if backend == "fake" else backend
    ok = 0
    async with aioexperts.open(
        model_path,
        cache=aioexperts.CacheOptions(slots=16, wait_for_slots=True),
        io=aioexperts.IOOptions(backend=chosen),
    ) as store:

        async def one(layer: int, ids: list[int]) -> None:
            nonlocal ok
            async with store.experts(layer, ids) as views:
                await anyio.lowlevel.checkpoint()
                assert [as_bytes(v) for v in views] == [reference[(layer, e)] for e in ids]
                ok += 1

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for layer, ids in requests:
                    tg.start_soon(one, layer, ids)
        st = store.statistics()
        assert ok == 1000
        assert st.requests == sum(len(ids) for _, ids in requests)
        assert st.requests == st.hits + st.inflight_joins + st.misses
        assert st.misses >= 24 and st.evictions == st.misses - len(cache_of(store).entries)
        assert st.read_errors == 0 and st.in_flight == 0
        assert cache_of(store).pinned_slots == 0
    if holder:
        assert holder["fake"].violations == []


async def test_requests_of_one_tick_go_in_one_submission(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, CheckedFake] = {}
    async with aioexperts.open(model_path, slots=16, io=aioexperts.IOOptions(backend=fake_factory(holder))) as store:

        async def one(e: int) -> None:
            async with store.experts(0, [e]):
                pass

        async with anyio.create_task_group() as tg:
            for e in range(5):
                tg.start_soon(one, e)
        assert holder["fake"].batches == [15]
        assert store.statistics().submissions == 1


async def test_demand_goes_before_prefetch_and_depth_is_bounded(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, CheckedFake] = {}
    async with aioexperts.open(
        model_path, slots=16, io=aioexperts.IOOptions(backend=fake_factory(holder), queue_depth=6)
    ) as store:
        cache = cache_of(store)
        assert cache.prefetch([(1, e) for e in range(4)]) == 4
        async with store.experts(2, [0, 1]) as views:
            assert len(views) == 2
        fake = holder["fake"]
        first = fake.submitted[0]
        assert len(first) == 6 and {op.context[0].plan.location.layer for op in first} == {2}
        await settle(20)
        assert max(len(b) for b in fake.submitted) <= 6
        st = store.statistics()
        assert st.prefetch_issued == 4 and st.max_batch <= 6
        async with store.experts(1, [0]):
            pass
        assert store.statistics().prefetch_hits == 1


async def test_bytes_in_flight_are_bounded(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, CheckedFake] = {}
    expert = SMALL.expert_bytes()
    async with aioexperts.open(
        model_path, slots=16, io=aioexperts.IOOptions(backend=fake_factory(holder), max_bytes_in_flight=2 * expert)
    ) as store:
        async with store.experts(0, range(6)):
            pass
        for batch in holder["fake"].submitted:
            assert sum(op.n_bytes for op in batch) <= 2 * expert + 3 * 4096


async def test_stale_prefetch_is_dropped_before_submission(model_path: Path, anyio_backend: object) -> None:
    holder: dict[str, CheckedFake] = {}
    async with aioexperts.open(model_path, slots=16, io=aioexperts.IOOptions(backend=fake_factory(holder))) as store:
        cache = cache_of(store)
        cache.prefetch([(1, 4), (1, 5), (2, 0)])
        dropped = cache.drop_prefetches(keep=lambda key: key[0] == 2)
        assert dropped == 2
        await settle()
        layers = {op.context[0].plan.location.layer for batch in holder["fake"].submitted for op in batch}
        assert layers == {2}
        st = store.statistics()
        assert (st.prefetch_issued, st.prefetch_dropped) == (3, 2)
        assert len(cache.free_slots) == 15


async def test_prefetch_never_evicts_pinned_or_its_own_layer(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4, io=aioexperts.IOOptions(backend=fake_factory({}))) as store:
        cache = cache_of(store)
        async with store.experts(0, [0, 1]):
            async with store.experts(1, [0, 1]):
                pass  # layer 1's experts are now READY and unpinned
            # free slots: none; evictable: layer 1's two. A prefetch for layer 1 may not evict them,
            assert cache.prefetch([(1, 5), (1, 6)]) == 0
            # a prefetch for layer 2 may evict layer 1's, never layer 0's pinned ones.
            assert cache.prefetch([(2, 5), (2, 6), (2, 7)]) == 2
            assert cache.state_of((0, 0)) is not SlotState.FREE and cache.state_of((0, 1)) is not SlotState.FREE
        await settle()


async def test_start_loads_submits_demand_then_prefetch_at_once_and_keeps_the_requests_experts(
    model_path: Path, anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}
    async with aioexperts.open(model_path, slots=5, io=aioexperts.IOOptions(backend=fake_factory(holder))) as store:
        cache = cache_of(store)
        async with store.experts(0, [0, 1, 2, 3, 4]):
            pass  # the slab is full of READY, unpinned layer-0 experts, 0 the least recently used
        fake = holder["fake"]
        before = len(fake.submitted)
        # a request for layer 0's experts 0 and 5 (0 cached): 5 is read as a demand load, then the
        # prefetch of layer 1, in one submission made inside the call (no loop tick in between)
        started = store.start_loads(0, [0, 5, -1], prefetch=[(1, 0), (1, 1), (1, 2)])
        assert len(fake.submitted) == before + 1
        loads = [key for key, _ in itertools.groupby(op.context[0].plan.key for op in fake.submitted[-1])]
        assert loads == [(0, 5), (1, 0), (1, 1), (1, 2)] and started == 4  # demand first, each load's reads together
        # the request's cached expert 0 is never a victim (LRU would have taken it first)
        assert cache.state_of((0, 0)) is SlotState.READY
        s0 = store.statistics()
        async with store.experts(0, [0, 5]):
            pass
        s1 = store.statistics()
        assert (s1.misses - s0.misses, s1.hits - s0.hits, s1.inflight_joins - s0.inflight_joins) == (1, 1, 0)
        await settle()


async def test_trace_is_recorded_and_replayed(model_path: Path, anyio_backend: object) -> None:
    from aioexperts._predict.simulate import replay

    async with aioexperts.open(model_path, slots=6) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"), record_trace=True)
        rng = np.random.default_rng(0)
        for _ in range(5):
            x = rng.standard_normal((1, SMALL.n_embd)).astype(np.float32)
            await runner.run_moe_layers(x)
        trace = runner.routing_trace()
        st = store.statistics()
        run = runner.statistics()
    assert trace.ids.shape == (5, 3, 2) and run.tokens == 5 and run.layer_steps == 15
    assert run.token_latency_p50_ms is not None
    result = replay(trace, 6, ("lru",))["lru"]
    assert result.hits == st.hits and result.misses == st.misses


async def test_close_while_requests_wait_gives_store_closed(model_path: Path, anyio_backend: object) -> None:
    """Waiters woken by close() get StoreClosedError, never an error about the unmapped slab."""
    outcomes: list[str] = []
    for delay_ticks in range(6):
        async with aioexperts.open(model_path, slots=6, io=aioexperts.IOOptions(backend=fake_factory({}))) as store:

            async def user(i: int, store: aioexperts.ExpertStore = store) -> None:
                try:
                    async with store.experts(i % 3, [i % 8, (i + 3) % 8]) as views:
                        assert all(v is not None for v in views)
                    outcomes.append("ok")
                except aioexperts.AioExpertsError as exc:
                    outcomes.append(type(exc).__name__)

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(user, i)
                await settle(delay_ticks)
                await store.aclose()
    assert outcomes and set(outcomes) <= {"ok", "StoreClosedError", "SlabExhaustedError"}
    assert "StoreClosedError" in outcomes


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=32, n_expert_used=4))
    return path


async def test_waiting_requests_are_served_in_order(wide_model: Path, anyio_backend: object) -> None:
    """A request for most of the slab is not starved by a stream of small ones."""
    async with aioexperts.open(wide_model, cache=aioexperts.CacheOptions(slots=16, wait_for_slots=True)) as store:
        stop = False
        small_done = 0

        async def small(i: int) -> None:
            nonlocal small_done
            rng = random.Random(i)
            while not stop:
                async with store.experts(rng.randrange(4), rng.sample(range(32), 4)):
                    await anyio.sleep(0.002)
                small_done += 1

        async with anyio.create_task_group() as tg:
            for i in range(4):  # together they can hold the whole slab
                tg.start_soon(small, i)
            await anyio.sleep(0.1)
            with anyio.fail_after(5):
                async with store.experts(0, range(12)) as views:
                    assert len(views) == 12
            stop = True
        assert small_done > 0
