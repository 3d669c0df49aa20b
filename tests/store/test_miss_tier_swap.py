"""The miss tier's two guards (issue 36): it switches itself off when the slab holds every routed
expert at full precision (a low read would only be read again in full), and an upgrade keeps the low
copy serving until the full copy has landed, then swaps them, never reusing a slot a request still
pins; on a scripted backend."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from tierkit import fake_store, settle

import aioexperts
from aioexperts import MissTier, write_miss_tier
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)
N_EXPERTS = SPEC.n_layer * SPEC.n_expert


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tier-swap") / "model.gguf"
    write_synthetic_model(path, SPEC)
    return path


@pytest.fixture(scope="module")
def sidecar(model: Path) -> Path:
    return write_miss_tier(model, model.with_suffix(".q3k.gguf"), "Q3_K")


def tier_store(model: Path, sidecar: Path, slots: int) -> aioexperts.ExpertStore:
    return aioexperts.open(model, slots=slots, miss_tier=MissTier(path=str(sidecar), upgrade=True))


# -- the tier switches itself off when every expert fits ----------------------------------------------


@pytest.mark.anyio
async def test_the_tier_is_off_when_the_slab_holds_every_expert(
    model: Path, sidecar: Path, caplog: pytest.LogCaptureFixture, anyio_backend: object
) -> None:
    x = np.random.default_rng(5).standard_normal((3, SPEC.n_embd)).astype(np.float32)
    caplog.set_level(logging.INFO, logger="aioexperts")
    async with tier_store(model, sidecar, N_EXPERTS) as store:
        st = store.statistics()
        assert st.miss_tier_off_reason is not None and "every routed expert" in st.miss_tier_off_reason
        assert store.miss_tier is None  # nothing asks which reads go low
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        await runner.moe(0, x)
        store.start_loads(1, [0, 1], low_ids=[0, 1])  # asked low all the same: read in full
        async with store.experts(1, [0, 1]) as views:
            full = build_layout(open_model(model)).locate(1, 0).gate.ggml_type
            assert [v.gate.ggml_type for v in views if v is not None] == [full, full]
        st = store.statistics()
        assert st.demand_misses > 0 and st.low_tier_misses == 0 and st.low_tier_prefetches == 0
    offs = [r for r in caplog.records if r.name == "aioexperts" and "miss tier" in r.getMessage()]
    assert len(offs) == 1 and offs[0].levelno == logging.INFO and "every routed expert" in offs[0].getMessage()


@pytest.mark.anyio
async def test_the_tier_serves_when_one_expert_does_not_fit(
    model: Path, sidecar: Path, caplog: pytest.LogCaptureFixture, anyio_backend: object
) -> None:
    caplog.set_level(logging.INFO, logger="aioexperts")
    async with tier_store(model, sidecar, N_EXPERTS - 1) as store:
        assert store.statistics().miss_tier_off_reason is None and store.miss_tier is not None
        store.start_loads(1, [0, 1], low_ids=[1])
        async with store.experts(1, [0, 1]) as views:
            assert views[1] is not None and views[1].gate.ggml_type == T.Q3_K
        assert store.statistics().low_tier_misses == 1
    assert not [r for r in caplog.records if "miss tier" in r.getMessage()]
    async with aioexperts.open(model, slots=N_EXPERTS) as store:  # no tier given: nothing to switch off
        assert store.statistics().miss_tier_off_reason is None


# -- an upgrade swaps only once the full copy has landed -----------------------------------------------


async def gate_types(store: aioexperts.ExpertStore, ids: list[int]) -> list[T]:
    with anyio.fail_after(5):  # a request that waited for a read the fake does not deliver would hang
        async with store.experts(0, ids) as views:
            return [v.gate.ggml_type for v in views if v is not None]


async def upgrade_in_flight(store: aioexperts.ExpertStore, fake: FakeBackend) -> None:
    """Expert 0/2 read low (a demand miss), hit once (its upgrade due), released: the full read of
    the upgrade submitted and not delivered."""
    store.start_loads(0, [2], low_ids=[2])
    await settle()
    fake.complete_all()
    assert await gate_types(store, [2]) == [T.Q3_K]  # the demand miss
    assert await gate_types(store, [2]) == [T.Q3_K]  # a hit on the low copy: upgraded on release
    await settle()
    assert store.statistics().tier_upgrades == 1 and fake.pending


@pytest.mark.anyio
async def test_the_low_copy_serves_while_its_full_copy_is_read(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    holder: dict[str, FakeBackend] = {}
    full = build_layout(open_model(model)).locate(0, 2).gate.ggml_type
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=True), auto=False) as store:
        fake = holder["fake"]
        try:
            await upgrade_in_flight(store, fake)
            for _ in range(2):  # served at once, by the low copy, while the full read is out
                assert await gate_types(store, [2]) == [T.Q3_K]
            assert fake.pending
            before = store.statistics()
            fake.complete_all()  # the full copy lands: the swap
            await settle()
            assert await gate_types(store, [2]) == [full]
            st = store.statistics()
            assert st.tier_upgrades == 1 and st.reads == before.reads  # no read of its own for the swap
            assert st.cached_hits == before.cached_hits + 1 and st.demand_misses == before.demand_misses
        finally:
            fake.complete_all()  # the store's close waits for every read in flight


@pytest.mark.anyio
async def test_a_pinned_low_copy_keeps_its_slot_through_the_swap(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    holder: dict[str, FakeBackend] = {}
    full = build_layout(open_model(model)).locate(0, 2).gate.ggml_type
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=True), auto=False) as store:
        fake = holder["fake"]
        cache = store._source.cache  # type: ignore[attr-defined]
        try:
            await upgrade_in_flight(store, fake)
            low_slot = cache.entries[0, 2].slot
            async with store.experts(0, [2]) as views:  # a compute holds the low copy ...
                assert views[0] is not None and views[0].gate.ggml_type == T.Q3_K
                held = bytes(views[0].gate.data)
                fake.complete_all()  # ... while its full copy lands
                await settle()
                assert cache.entries[0, 2].slot != low_slot  # the key is the full copy's now
                assert low_slot not in cache.free_slots  # the pinned slot is not free for reuse ...
                free = len(cache.free_slots)  # 8 slots: the full copy, the pinned low copy, these
                assert store.prefetch([(1, e) for e in range(free)]) == free  # ... when every other slot is taken
                await settle()
                assert not cache.free_slots and all(e.slot != low_slot for e in cache.entries.values())
                assert bytes(views[0].gate.data) == held and views[0].gate.ggml_type == T.Q3_K
                assert store.statistics().pinned_slots == 1
            assert cache.free_slots == [low_slot]  # freed by the last release
            fake.complete_all()
            await settle()
            assert await gate_types(store, [2]) == [full]
        finally:
            fake.complete_all()
