"""Regression tests of the cache: a faulty eviction policy, wait=False, short reads through the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from faults.guard import CheckedFake, checked_factory
from faults.policy import OnceFaulty
from faults.script import FaultyFake, ReadFault
from faults.stack import Key, open_stack, reference_bytes

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts._cache.eviction import LRU
from aioexperts._errors import EvictionPolicyError
from aioexperts._io.align import align_down, probe_alignment
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


@pytest.fixture(scope="module")
def reference(model_path: Path) -> dict[Key, list[bytes]]:
    return reference_bytes(model_path)


async def settle(ticks: int = 10) -> None:
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()


# -- 6. a faulty eviction policy -------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["victim", "remove", "access", "admit"])
async def test_a_policy_hook_that_raises_leaves_no_pin_and_no_lost_slot(
    model_path: Path, reference: dict[Key, list[bytes]], hook: str, anyio_backend: object
) -> None:
    policy = OnceFaulty(hook)
    stack = open_stack(model_path, CheckedFake, reference=reference, slots=4, policy=policy)
    assert await stack.request([(0, 0), (0, 1), (0, 2), (0, 3)]) == "ok"  # full: READY, unpinned
    policy.armed = True
    # (0, 0) is a hit (access), (1, 0) needs an eviction (victim, remove) and a load (admit)
    assert await stack.request([(0, 0), (1, 0)]) == "EvictionPolicyError"
    assert policy.raised == 1
    error = stack.errors[-1]
    assert isinstance(error, EvictionPolicyError) and isinstance(error.__cause__, RuntimeError)
    assert hook in str(error)
    await stack.quiesce()
    assert stack.problems() == []
    assert await stack.verify_all() == []  # the slab is still usable, every byte right
    assert stack.problems() == []
    await stack.aclose()


@pytest.mark.parametrize("answer", [None, 3, [[0, 0]], ["0"], "00"], ids=["none", "int", "list-key", "str-key", "str"])
async def test_victims_that_are_not_keys_are_the_policys_error(
    model_path: Path, reference: dict[Key, list[bytes]], answer: object, anyio_backend: object
) -> None:
    """A custom policy whose ``victims()`` returns no list of keys gets an EvictionPolicyError
    naming it (never a bare TypeError from inside the cache), and the store stays usable."""

    class Broken(LRU):
        broken = True

        def victims(self, n: int, can_evict: Any) -> Any:
            return answer if self.broken else super().victims(n, can_evict)

    policy = Broken()
    stack = open_stack(model_path, CheckedFake, reference=reference, slots=4, policy=policy)
    assert await stack.request([(0, 0), (0, 1), (0, 2), (0, 3)]) == "ok"
    assert await stack.request([(1, 0)]) == "EvictionPolicyError"
    assert "Broken" in str(stack.errors[-1])
    policy.broken = False
    assert await stack.request([(1, 0)]) == "ok"
    await stack.quiesce()
    assert stack.problems() == []
    assert await stack.verify_all() == []
    await stack.aclose()


async def test_a_key_the_policy_lost_is_evicted_by_the_cache(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    class Forgetful(LRU):
        forget = True

        def access(self, key: Key) -> None:
            if self.forget:
                self.forget = False
                self._order.pop(key, None)  # the policy loses track of a resident key
                raise KeyError(key)
            super().access(key)

    stack = open_stack(model_path, CheckedFake, reference=reference, slots=4, policy=Forgetful())
    assert await stack.request([(0, 0), (0, 1), (0, 2), (0, 3)]) == "ok"
    assert await stack.request([(0, 0)]) == "EvictionPolicyError"
    # four new experts need all four slots, the lost key's included
    assert await stack.request([(1, 0), (1, 1), (1, 2), (1, 3)]) == "ok"
    assert stack.cache.state_of((0, 0)) is SlotState.FREE
    assert stack.problems() == []
    await stack.aclose()


# -- 7. wait=False never queues behind waiting requests ----------------------------------------------


async def test_wait_false_waits_only_for_the_loads_it_needs_not_for_queued_requests(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    holder: dict[str, Any] = {}
    stack = open_stack(model_path, checked_factory(CheckedFake, holder, auto=False), reference=reference, slots=4)
    fake: CheckedFake = holder["backend"]
    cache = stack.cache
    release_a = anyio.Event()
    results: dict[str, str] = {}

    async def holder_a() -> None:  # pins three slots until told to let go
        entries = await cache.acquire([(0, 0), (0, 1), (0, 2)])
        await release_a.wait()
        cache.release(entries)

    async def request(name: str, keys: list[Key], wait: bool) -> None:
        results[name] = await stack.request(keys, wait=wait)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder_a)
        await settle()
        fake.complete_all()
        await settle()
        assert cache.pinned_slots == 3
        assert cache.prefetch([(1, 0)]) == 1  # the last slot: LOADING, unpinned
        await settle()
        prefetch_ops = list(fake.pending)
        tg.start_soon(request, "waiter", [(2, 0), (2, 1)], True)  # needs two slots: queues
        await settle()
        tg.start_soon(request, "no-wait", [(2, 5)], False)  # needs one: the prefetch's, soon
        await settle()
        assert results == {}
        for op in prefetch_ops:
            fake.complete(op)
        await settle()
        fake.complete_all()  # the no-wait request's read, in the prefetch's slot
        with anyio.fail_after(5):
            while "no-wait" not in results:
                await settle(1)
        assert results == {"no-wait": "ok"}  # served while the waiting request still waits
        release_a.set()
        with anyio.fail_after(5):
            while "waiter" not in results:
                await settle(1)
                fake.complete_all()
    assert results == {"no-wait": "ok", "waiter": "ok"}
    assert stack.problems() == []
    await stack.aclose()


async def test_wait_false_with_every_slot_pinned_fails_at_once_even_with_waiters_queued(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    stack = open_stack(model_path, CheckedFake, reference=reference, slots=2)
    cache = stack.cache
    entries = await cache.acquire([(0, 0), (0, 1)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: stack.request([(1, 0)], wait=True))  # waits in line
        await settle()
        with anyio.fail_after(5):
            assert await stack.request([(1, 1)]) == "SlabExhaustedError"
        cache.release(entries)
    assert stack.outcomes == ["SlabExhaustedError", "ok"]
    await stack.aclose()


# -- 5. the store restarts a short direct read at the kernel's alignment ---------------------------


async def test_the_store_restarts_a_short_direct_read_at_the_kernels_alignment(
    model_path: Path, reference: dict[Key, list[bytes]], anyio_backend: object
) -> None:
    kernel_unit = probe_alignment(model_path).unit
    if kernel_unit >= 4096:
        pytest.skip("needs a file system whose direct-I/O alignment is finer than a page")
    fault = ReadFault("all_but_one", at="first")
    holder: dict[str, Any] = {}
    async with aioexperts.open(
        model_path, slots=4, io=aioexperts.IOOptions(backend=checked_factory(FaultyFake, holder, read_fault=fault))
    ) as e:
        st = e.statistics()
        assert st.direct_io and st.alignment == 4096  # reads are planned page-aligned
        async with e.experts(0, [0]) as (view,):
            assert view is not None
            assert [bytes(p.data) for p in (view.gate, view.up, view.down)] == reference[(0, 0)]
    fake: FaultyFake = holder["backend"]
    first, retry = fake.submitted[0][0], fake.submitted[1][0]
    advance = align_down(first.n_bytes - 1, kernel_unit)
    assert advance % 4096  # the example is only telling when the page rule would differ
    assert (retry.file_offset, retry.n_bytes, retry.slot_offset) == (
        first.file_offset + advance,
        first.n_bytes - advance,
        first.slot_offset + advance,
    )
    assert fake.violations == []


# -- a fault while a submission is being built -----------------------------------------------------


async def test_a_fault_while_building_a_batch_fails_its_loads_and_keeps_the_counts(
    model_path: Path, reference: dict[Key, list[bytes]], monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """The scheduler counts a load's reads in flight once all of them are built: a fault halfway
    through a load (here its second read) must leave nothing counted that was never submitted."""
    from aioexperts._cache import scheduler as scheduler_module

    real = scheduler_module.ReadOp
    built = [0]

    def failing_read_op(*args: Any) -> Any:
        built[0] += 1
        if built[0] == 5:  # the second read of the second load of the batch
            raise MemoryError("no memory for the read")
        return real(*args)

    stack = open_stack(model_path, CheckedFake, reference=reference, slots=4)
    monkeypatch.setattr(scheduler_module, "ReadOp", failing_read_op)
    assert await stack.request([(0, 0), (0, 1)]) == "ExpertReadError"
    assert "queuing the read failed" in str(stack.errors[-1]) and isinstance(stack.errors[-1].__cause__, MemoryError)
    assert stack.scheduler.reads_in_flight == 0 and stack.scheduler.bytes_in_flight == 0
    monkeypatch.setattr(scheduler_module, "ReadOp", real)
    await stack.quiesce()
    assert stack.problems() == []
    assert await stack.request([(0, 0), (0, 1)]) == "ok"  # both read again, every byte right
    assert await stack.verify_all() == []
    assert stack.problems() == []
    await stack.aclose()
