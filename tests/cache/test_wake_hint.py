"""The scheduler's wake hint: how many read completions the backend may wait for before it wakes the
loop (the raw ring's batched wake-ups). Too many would delay a waiting request, so it must be the
fewest after which some waiting request can go on."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from cacheutil import CheckedFake, cache_of, fake_factory, settle

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


async def test_the_hint_is_the_fewest_completions_a_waiting_request_needs(
    model_path: Path, anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False), queue_depth=64)
    async with aioexperts.open(model_path, slots=8, io=io) as store:
        fake, cache = holder["fake"], cache_of(store)
        scheduler = cache.scheduler
        reads = len(cache.plan_of(0, 0).reads)  # every expert of this model has as many
        assert scheduler.wake_hint() == 1  # nobody waits: every completion wakes the loop

        async def want(layer: int, ids: list[int]) -> None:
            async with store.experts(layer, ids):
                pass

        def ops_of(key: tuple[int, int]) -> list[object]:
            return [op for op in fake.pending if op.context[0].plan.key == key]

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(want, 0, [0, 1])
                await settle()
                assert scheduler.wake_hint() == 2 * reads  # the request needs every read of both experts
                tg.start_soon(want, 1, [0])
                await settle()
                assert scheduler.wake_hint() == reads  # the second request needs fewer: the least counts
                fake.complete(ops_of((1, 0))[0])
                await settle()
                assert scheduler.wake_hint() == reads - 1
                for op in ops_of((1, 0)):
                    fake.complete(op)
                await settle()
                assert scheduler.wake_hint() == 2 * reads  # the second request went on: the first is left
                for op in ops_of((0, 0)):
                    fake.complete(op)
                await settle()
                assert scheduler.wake_hint() == reads  # one expert of the first request is still due
                await finish(fake)
        finally:
            await finish(fake)  # a failed assertion must not leave the store's close waiting for reads
        assert scheduler.wake_hint() == 1 and not fake.pending


async def finish(fake: CheckedFake) -> None:
    """Complete every read left, until none is queued either."""
    while fake.pending:
        fake.complete_all()
        await settle()


async def test_the_hint_tops_up_reads_queued_behind_the_depth_and_is_one_for_a_slot_waiter(
    model_path: Path, anyio_backend: object
) -> None:
    holder: dict[str, CheckedFake] = {}
    io = aioexperts.IOOptions(backend=fake_factory(holder, auto=False), queue_depth=10, max_bytes_in_flight=1 << 30)
    async with aioexperts.open(model_path, slots=4, io=io) as store:
        fake, cache = holder["fake"], cache_of(store)
        scheduler = cache.scheduler
        reads = len(cache.plan_of(0, 0).reads)
        assert 4 * reads > 10  # the request's reads do not all fit in the depth

        async def want(layer: int, ids: list[int]) -> None:
            async with store.experts(layer, ids, wait=True):
                pass

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(want, 0, [0, 1, 2, 3])
                await settle()
                in_flight = len(fake.pending)
                assert in_flight == 3 * reads and scheduler.wake_hint() == 3 * reads - 7  # down to 3/4 of the depth
                tg.start_soon(want, 1, [0])  # no slot left: it waits for one
                await settle()
                assert scheduler.wake_hint() == 1  # any completion may make room for it
                await finish(fake)
        finally:
            await finish(fake)
        assert scheduler.wake_hint() == 1
