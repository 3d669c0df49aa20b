"""The miss tier on prefetches (issue 36, item 1): the layers-ahead prefetch goes low under the same
rules as the demand misses (predicted weight, else the backlog rule), a late low prefetch counts as
prefetched late, the statistics' sources still sum to the requests, and the upgrade of a low copy hit
again waits while the reads are behind; on a scripted backend."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from tierkit import fake_store, settle

import aioexperts
from aioexperts import MissTier, write_miss_tier
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._tier_policy import low_tier_prefetches
from aioexperts.predictors import Predictor
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tier-prefetch") / "model.gguf"
    write_synthetic_model(path, SPEC)
    return path


@pytest.fixture(scope="module")
def sidecar(model: Path) -> Path:
    return write_miss_tier(model, model.with_suffix(".q3k.gguf"), "Q3_K")


def sources_sum(st: aioexperts.StoreStatistics) -> bool:
    return st.requests == st.cached_hits + st.prefetched_in_time + st.prefetched_late + st.demand_misses


# -- the rule ----------------------------------------------------------------------------------------


def test_the_prefetch_rule_reads_the_predicted_weight_else_the_backlog() -> None:
    keys = [(1, 0), (1, 1), (1, 2)]
    predicted = {(1, 0): 0.9, (1, 1): 0.05}  # (1, 2): no predicted weight
    weight = MissTier(path="x", max_gate_weight=0.3)
    assert low_tier_prefetches(weight, keys, predicted, 10.0) == [(1, 1)]  # unknown weight: not by the weight rule
    backlog = MissTier(path="x", behind_seconds=0.05)
    assert low_tier_prefetches(backlog, keys, predicted, None) == []  # no rate measured yet
    assert low_tier_prefetches(backlog, keys, predicted, 0.01) == []
    assert low_tier_prefetches(backlog, keys, predicted, 0.2) == keys  # behind: every prefetch low
    both = MissTier(path="x", max_gate_weight=0.3, behind_seconds=0.05)
    assert low_tier_prefetches(both, keys, predicted, 0.01) == [(1, 1)]
    assert low_tier_prefetches(both, keys, {}, 0.2) == keys
    assert low_tier_prefetches(MissTier(path="x"), keys, {}, None) == keys  # no rule: every read low
    demand_only = MissTier(path="x", behind_seconds=0.05, prefetches=False)
    assert low_tier_prefetches(demand_only, keys, {}, 0.2) == []


def test_reads_are_behind_by_the_backlog_rule_else_while_anything_is_read() -> None:
    backlog = MissTier(path="x", behind_seconds=0.05)
    assert not backlog.reads_behind(0, 1.0)  # nothing queued nor in flight
    assert not backlog.reads_behind(1 << 20, 0.01)
    assert backlog.reads_behind(1 << 20, 0.2)
    assert backlog.reads_behind(1 << 20, None)  # no rate yet: reading counts as behind
    no_rule = MissTier(path="x", max_gate_weight=0.3)
    assert no_rule.reads_behind(4096, 0.0) and not no_rule.reads_behind(0, None)


# -- the runner's prefetch ---------------------------------------------------------------------------


class Unweighted(Predictor):
    """Predicts experts 5 and 6 of every layer, with no weight."""

    name = "unweighted"

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        pass

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        return [5, 6][:budget]


async def layer0_prefetch(
    model: Path, tier: MissTier, backlog: float | None, predictor: str | Predictor = "router"
) -> aioexperts.StoreStatistics:
    """Layer 0 of one token through a runner (its prefetch: layer 1's predicted experts), with the
    store's backlog scripted to ``backlog``; the statistics once layer 1 ran too."""
    holder: dict[str, FakeBackend] = {}
    x = np.random.default_rng(3).standard_normal((1, SPEC.n_embd)).astype(np.float32)
    async with fake_store(model, holder, tier) as store:
        store.read_backlog_seconds = lambda: backlog  # type: ignore[method-assign]
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor=predictor))
        await runner.warmup()
        await runner.moe(0, x)
        st = store.statistics()
        assert st.prefetch_issued > 0
        await settle()
        await runner.moe(1, x)
        return store.statistics()


@pytest.mark.anyio
async def test_prefetches_go_low_while_behind_and_stay_full_when_not(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    tier = MissTier(path=str(sidecar), behind_seconds=0.05)
    behind = await layer0_prefetch(model, tier, 0.5)
    assert behind.low_tier_prefetches == behind.prefetch_issued > 0
    assert 0 < behind.low_tier_prefetch_hits <= behind.prefetched_in_time + behind.prefetched_late
    assert behind.low_tier_misses == behind.demand_misses > 0  # behind: the demand misses went low too
    assert sources_sum(behind)
    on_time = await layer0_prefetch(model, tier, 0.01)
    assert on_time.prefetch_issued > 0 and on_time.low_tier_prefetches == 0 == on_time.low_tier_prefetch_hits
    assert on_time.low_tier_misses == 0 and sources_sum(on_time)
    demand_only = MissTier(path=str(sidecar), behind_seconds=0.05, prefetches=False)
    st = await layer0_prefetch(model, demand_only, 0.5)
    assert st.low_tier_prefetches == 0 and st.low_tier_misses == st.demand_misses > 0


@pytest.mark.anyio
async def test_a_prefetch_goes_low_by_its_predicted_weight_only_if_the_predictor_gives_one(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    every = MissTier(path=str(sidecar), max_gate_weight=1.01)  # every known weight is below it
    st = await layer0_prefetch(model, every, None)
    assert st.low_tier_prefetches == st.prefetch_issued > 0  # the router predictor gives the weights
    st = await layer0_prefetch(model, MissTier(path=str(sidecar), max_gate_weight=0.0), None)
    assert st.low_tier_prefetches == 0
    # a predictor that gives no weight: unknown, and without a backlog rule the prefetch stays full
    st = await layer0_prefetch(model, every, None, predictor=Unweighted())
    assert st.low_tier_prefetches == 0 and sources_sum(st)


# -- the store: late low prefetches, upgrades -------------------------------------------------------


@pytest.mark.anyio
async def test_a_late_low_prefetch_counts_as_prefetched_late(model: Path, sidecar: Path, anyio_backend: object) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model, holder, MissTier(path=str(sidecar)), auto=False) as store:
        fake = holder["fake"]
        assert store.prefetch([(1, 3), (1, 4)], low=[(1, 4)]) == 2
        await settle()

        async def pin() -> list[T]:
            async with store.experts(1, [3, 4]) as views:
                return [v.gate.ggml_type for v in views if v is not None]

        async with anyio.create_task_group() as tg:
            got: list[list[T]] = []

            async def run() -> None:
                got.append(await pin())

            tg.start_soon(run)
            await settle()
            assert not got  # the pass waits for the reads
            fake.complete_all()
        full = build_layout(open_model(model)).locate(1, 3).gate.ggml_type
        assert got == [[full, T.Q3_K]]
        st = store.statistics()
        assert st.prefetched_late == 2 and st.low_tier_prefetches == 1 and st.low_tier_prefetch_hits == 1
        assert st.low_tier_misses == 0 and sources_sum(st) and st.requests == 2


@pytest.mark.anyio
async def test_an_upgrade_waits_while_the_reads_are_behind(model: Path, sidecar: Path, anyio_backend: object) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=True), auto=False) as store:
        fake = holder["fake"]
        try:
            await upgrade_put_off(store, fake, build_layout(open_model(model)).locate(0, 2).gate.ggml_type)
        finally:
            fake.complete_all()  # the store's close waits for every read in flight


async def upgrade_put_off(store: aioexperts.ExpertStore, fake: FakeBackend, full: T) -> None:
    async def gate_type() -> T:
        with anyio.fail_after(5):  # an upgrade started while behind would wait for a read not delivered
            async with store.experts(0, [2]) as views:
                assert views[0] is not None
                return views[0].gate.ggml_type

    store.start_loads(0, [2], low_ids=[2])
    await settle()
    fake.complete_all()
    assert await gate_type() == T.Q3_K  # the demand miss, low
    store.prefetch([(1, 6)])  # a read under way: with no backlog rule, the reads are behind
    await settle()
    assert fake.pending
    assert await gate_type() == T.Q3_K  # a hit on the low copy: its upgrade is due, but waits
    await settle()
    st = store.statistics()
    assert st.tier_upgrades == 0 and st.tier_upgrades_deferred == 1
    assert await gate_type() == T.Q3_K  # still the low copy, put off once only
    assert store.statistics().tier_upgrades_deferred == 1
    fake.complete_all()  # the reads caught up
    await settle()
    async with store.experts(1, [6]):  # any later release starts the upgrade put off
        pass
    st = store.statistics()
    assert st.tier_upgrades == 1 and st.tier_upgrades_deferred == 1
    await settle()
    fake.complete_all()
    await settle()
    assert await gate_type() == full
    assert sources_sum(store.statistics())


@pytest.mark.anyio
async def test_upgrades_do_not_start_in_a_burst(model: Path, sidecar: Path, anyio_backend: object) -> None:
    """Without a backlog rule, an upgrade's own read makes the reads behind: one at a time."""
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=True), auto=False) as store:
        fake = holder["fake"]
        try:
            store.start_loads(0, [2, 3], low_ids=[2, 3])
            await settle()
            fake.complete_all()
            for _ in range(2):  # the demand misses, then a hit on both low copies (released together)
                async with store.experts(0, [2, 3]):
                    pass
            st = store.statistics()
            assert st.tier_upgrades == 1 and st.tier_upgrades_deferred == 1
            await settle()
            fake.complete_all()  # the first upgrade's read done: the next release starts the other
            await settle()
            async with store.experts(0, [2]):
                pass
            assert store.statistics().tier_upgrades == 2
        finally:
            fake.complete_all()
