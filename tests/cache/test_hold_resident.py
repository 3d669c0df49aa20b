"""Holding resident experts without pins (``hold_resident``): nothing leaves, waiters wait, views stay right."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from cacheutil import cache_of, settle
from gguf import GGMLQuantizationType
from ioutil import pread_segment

import aioexperts
from aioexperts._format.views import layout_key
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


async def load_layers(store: aioexperts.ExpertStore, layers: range) -> None:
    for layer in layers:
        async with store.experts(layer, range(SMALL.n_expert)):
            pass


async def test_a_request_that_must_evict_waits_for_the_hold_to_end(model_path: Path, anyio_backend: object) -> None:
    """While layer 0 is held, a request that needs its slots waits; the held slots keep their expert."""
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=10, wait_for_slots=True)) as store:
        await load_layers(store, range(1))
        cache = cache_of(store)
        slots = {key: cache.entries[key].slot for key in cache.entries}
        assert not cache.held
        cache.hold()
        assert cache.held
        done = anyio.Event()

        async def want_layer_1() -> None:
            async with store.experts(1, range(4)):  # 2 free slots: 2 of layer 0's must go
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(want_layer_1)
            await anyio.sleep(0.05)
            await settle(20)
            assert not done.is_set(), "a held slot was evicted"
            assert {key: cache.entries[key].slot for key in slots} == slots
            cache.end_hold()
            with anyio.fail_after(5):
                await done.wait()
        assert not cache.held
        assert sum(1 for key in slots if key in cache.entries) == SMALL.n_expert - 2


async def test_held_views_are_the_experts_bytes_and_count_as_hits(
    model_path: Path, reference: dict[tuple[int, int], list[bytes]], anyio_backend: object
) -> None:
    n_total = SMALL.n_layer * SMALL.n_expert
    async with aioexperts.open(model_path, slots=n_total - 1) as store:
        with store.hold_resident() as held:
            assert held is None  # the slab may have to evict: no hold
    async with aioexperts.open(model_path, slots=n_total) as store:
        with store.hold_resident() as held:
            assert held is not None
            assert held.views(0, [0]) is None  # nothing read yet
        await load_layers(store, range(SMALL.n_layer - 1))
        before = store.statistics()
        with store.hold_resident() as held:
            assert held is not None
            assert cache_of(store).held
            assert held.views(SMALL.n_layer - 1, [1]) is None  # the last layer is not read
            assert held.views(0, [1, 2]) is not None
            for layer in range(SMALL.n_layer - 1):
                views = held.views(layer, [5, 0, 3])
                assert views is not None
                assert [(v.layer, v.expert) for v in views] == [(layer, 5), (layer, 0), (layer, 3)]
                for v in views:
                    assert [bytes(p.data) for p in (v.gate, v.up, v.down)] == reference[(layer, v.expert)]
            with pytest.raises(aioexperts.InvalidRequestError):
                held.views(0, [SMALL.n_expert])
            for bad in ([True], [1.0], ["1"], "1", None):  # never served as some other expert
                with pytest.raises(aioexperts.InvalidRequestError):
                    held.views(0, bad)  # type: ignore[arg-type]
            assert [v.expert for v in held.views(0, [np.int64(2)]) or []] == [2]
            async with store.experts(SMALL.n_layer - 1, [1]):  # a read into a free slot goes on
                pass
            assert held.views(SMALL.n_layer - 1, [1]) is not None
        assert not cache_of(store).held
        after = store.statistics()
        n_served = 2 + 3 * (SMALL.n_layer - 1) + 1 + 1  # the np.int64 id's too
        assert after.requests - before.requests == n_served + 1  # the experts() block's own request
        assert after.cached_hits - before.cached_hits == n_served
    with pytest.raises(aioexperts.StoreClosedError), store.hold_resident():
        pass


async def test_the_page_cache_mode_never_holds(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, mode="pagecache") as store:
        await load_layers(store, range(SMALL.n_layer))
        with store.hold_resident() as held:
            assert held is None


async def test_a_held_layers_table_locates_every_expert_and_is_kept_until_a_placement_changes(
    model_path: Path, anyio_backend: object
) -> None:
    n_total = SMALL.n_layer * SMALL.n_expert
    async with aioexperts.open(model_path, slots=n_total) as store:
        cache = cache_of(store)
        await load_layers(store, range(SMALL.n_layer - 1))
        async with store.experts(SMALL.n_layer - 1, [0, 1]):  # the last layer half read
            pass
        with store.hold_resident() as held:
            assert held is not None
            assert held.table(SMALL.n_layer - 1) is None  # not every expert in memory
            table = held.table(0)
            assert table is not None
            assert table.addresses.shape == (3, SMALL.n_expert) and table.addresses.dtype == np.int64
            assert not table.addresses.flags.writeable
            views = held.views(0, list(range(SMALL.n_expert)))
            assert views is not None
            want = [[v.gate.address for v in views], [v.up.address for v in views], [v.down.address for v in views]]
            assert table.addresses.tolist() == want
            assert {layout_key(v) for v in views} == {table.layout}
            assert held.table(0) is table  # kept: no placement changed
            with pytest.raises(aioexperts.InvalidRequestError):
                held.table(SMALL.n_layer)
        with store.hold_resident() as held:
            assert held is not None
            assert held.table(0) is table  # kept across holds
        last = SMALL.n_layer - 1
        before = cache.placements(0), cache.placements(last)
        await load_layers(store, range(last, SMALL.n_layer))  # loads into free slots of another layer
        assert cache.placements(0) == before[0] and cache.placements(last) > before[1]
        with store.hold_resident() as held:
            assert held is not None
            assert held.table(0) is table  # a load elsewhere leaves layer 0's table
            assert held.table(last) is not None
        cache._evict([(0, 3)])  # layer 0's placement changes: its expert 3 leaves, then is read again
        async with store.experts(0, [3]):
            pass
        assert cache.placements(0) > before[0]
        with store.hold_resident() as held:
            assert held is not None
            again = held.table(0)
            assert again is not None and again is not table  # made again
            views = held.views(0, list(range(SMALL.n_expert)))
            assert views is not None
            assert again.addresses.tolist() == [
                [v.gate.address for v in views],
                [v.up.address for v in views],
                [v.down.address for v in views],
            ]
        with pytest.raises(RuntimeError, match="hold has ended"):
            held.table(0)


async def test_an_eviction_changes_the_placements(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=SMALL.n_expert) as store:
        cache = cache_of(store)
        await load_layers(store, range(1))
        before = cache.placements(0)
        cache._evict([(0, 3)])  # a slot made free, no load after it
        assert cache.placements(0) > before
        assert (0, 3) not in cache.entries
        before = cache.placements(0), cache.placements(1)
        async with store.experts(1, [0]):  # a load into the free slot: layer 1's placement, not layer 0's
            pass
        assert cache.placements(0) == before[0] and cache.placements(1) > before[1]


async def test_a_layer_of_mixed_layouts_has_no_table(tmp_path: Path, anyio_backend: object) -> None:
    spec = SMALL.with_(tiers=((2, GGMLQuantizationType.Q8_0),))
    path = tmp_path / "mixed.gguf"
    write_synthetic_model(path, spec)
    async with aioexperts.open(path, slots=spec.n_layer * 8) as store:
        await load_layers(store, range(spec.n_layer))
        with store.hold_resident() as held:
            assert held is not None
            views = held.views(0, list(range(8)))
            assert views is not None and len({layout_key(v) for v in views}) == 2
            assert held.table(0) is None
            assert held.table(0) is None  # kept as None


async def test_a_store_closed_during_a_hold_says_so(model_path: Path, anyio_backend: object) -> None:
    n_total = SMALL.n_layer * SMALL.n_expert
    store = aioexperts.open(model_path, slots=n_total)
    await store.__aenter__()
    await load_layers(store, range(SMALL.n_layer))
    with store.hold_resident() as held:
        assert held is not None
        table = held.table(0)
        assert table is not None
        await store.aclose()
        with pytest.raises(aioexperts.StoreClosedError):
            held.table(0)
        with pytest.raises(aioexperts.StoreClosedError):
            held.views(0, [0])
        assert table.keep is not None  # what keeps its memory mapped (tests/model/test_forward_held.py reads it)
