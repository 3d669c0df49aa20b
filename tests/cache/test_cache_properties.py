"""Property test: random interleavings of requests, cancellations, completions (full, short,
failed), prefetches and drops never break the cache invariants (docs/notes/DESIGN.md)."""

from __future__ import annotations

import errno

import anyio
import pytest
from cacheutil import CheckedFake, cache_of, fake_factory, settle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ioutil import pread_segment

import aioexperts
from aioexperts._cache.cache import SlotState
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=6, n_expert_used=2)
N_SLOTS = 5


class Model(tuple):  # type: ignore[type-arg]
    """``(path, reference bytes)`` with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return f"Model({self[0].name})"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("model") / "p.gguf"
    write_synthetic_model(path, SPEC)
    m = aioexperts.open_model(path)
    ref = {(loc.layer, loc.expert): [pread_segment(m, s) for s in loc.segments] for loc in aioexperts.build_layout(m)}
    return Model((path, ref))


ids_st = st.lists(st.integers(0, SPEC.n_expert - 1), min_size=1, max_size=3)
op_st = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 1), ids_st, st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("complete"), st.integers(0, 50), st.sampled_from(["full", "full", "half", "zero", "eio"])),
    st.tuples(st.just("prefetch"), st.integers(0, 1), ids_st),
    st.tuples(st.just("drop"), st.integers(0, 1)),
)


def check_invariants(store: aioexperts.ExpertStore, fake: CheckedFake, held: dict[int, dict[str, object]]) -> None:
    cache = cache_of(store)
    assert fake.violations == []
    slots = [e.slot for e in cache.entries.values()]
    assert len(slots) == len(set(slots))
    assert len(cache.free_slots) == len(set(cache.free_slots))
    assert not set(slots) & set(cache.free_slots)
    assert len(slots) + len(cache.free_slots) == N_SLOTS
    by_slot = {e.slot: e for e in cache.entries.values()}
    for op in fake.pending:
        entry = by_slot.get(op.slot)
        assert entry is not None and entry.state is SlotState.LOADING and entry.load is op.context[0]
    for task in held.values():
        if task["views"] is None:
            continue
        for entry in task["entries"]:  # type: ignore[union-attr]
            assert cache.entries.get(entry.key) is entry and entry.state is SlotState.READY and entry.pins >= 1
    for key, entry in cache.entries.items():
        assert entry.key == key
        if entry.state is SlotState.READY:
            assert key in cache.policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=5, max_size=40))
def test_random_interleavings_keep_the_invariants(
    model: Model,
    ops: list[tuple],  # type: ignore[type-arg]
) -> None:
    path, ref = model

    async def main() -> None:
        holder: dict[str, CheckedFake] = {}
        store = aioexperts.open(path, slots=N_SLOTS, io=aioexperts.IOOptions(backend=fake_factory(holder, auto=False)))
        await store.start()
        fake = holder["fake"]
        tasks: dict[int, dict[str, object]] = {}
        errors: list[BaseException] = []

        async def request(tid: int, layer: int, ids: list[int], wait: bool) -> None:
            info = tasks[tid]
            with info["scope"]:  # type: ignore[attr-defined]
                try:
                    entries = await cache_of(store).acquire([(layer, e) for e in ids], wait=wait)
                except (
                    aioexperts.SlabExhaustedError,
                    aioexperts.ExpertReadError,
                    aioexperts.StoreClosedError,
                ) as exc:
                    errors.append(exc)
                else:
                    try:
                        info["entries"] = entries
                        info["views"] = [store._source.view(e) for e in entries]
                        await info["release"].wait()  # type: ignore[attr-defined]
                        for e, v in zip(entries, info["views"], strict=True):  # type: ignore[arg-type]
                            assert [bytes(p.data) for p in (v.gate, v.up, v.down)] == ref[e.key]
                    finally:
                        info["views"] = None
                        cache_of(store).release(entries)
            info["done"] = True

        async with anyio.create_task_group() as tg:
            for op in ops:
                kind = op[0]
                if kind == "request":
                    tid = len(tasks)
                    tasks[tid] = {
                        "scope": anyio.CancelScope(),
                        "release": anyio.Event(),
                        "views": None,
                        "entries": [],
                        "done": False,
                    }
                    tg.start_soon(request, tid, op[1], op[2], op[3])
                elif kind in ("release", "cancel") and tasks:
                    info = tasks[op[1] % len(tasks)]
                    if kind == "release":
                        info["release"].set()  # type: ignore[attr-defined]
                    else:
                        info["scope"].cancel()  # type: ignore[attr-defined]
                elif kind == "complete" and fake.pending:
                    target = fake.pending[op[1] % len(fake.pending)]
                    mode = op[2]
                    result = {
                        "full": None,
                        "half": target.n_bytes // 2,
                        "zero": 0,
                        "eio": OSError(errno.EIO, "Input/output error"),
                    }[mode]
                    fake.complete(target, result)
                elif kind == "prefetch":
                    cache_of(store).prefetch([(op[1], e) for e in op[2]])
                elif kind == "drop":
                    cache_of(store).drop_prefetches(keep=lambda key, layer=op[1]: key[0] != layer)
                await settle(3)
                check_invariants(store, fake, tasks)
            # wind down: release everything, complete every read until every request has finished
            for info in tasks.values():
                info["release"].set()  # type: ignore[attr-defined]
            for _ in range(200):
                await settle(3)
                if not fake.pending and cache_of(store).scheduler.idle and all(info["done"] for info in tasks.values()):
                    break
                fake.complete_all()
            # every request must have finished on its own: nothing is pinned, nothing is in flight,
            # so one still waiting was never woken (a lost wake-up). Checked before anything is
            # cancelled: the cancellation below would otherwise end it and hide the hang.
            unfinished = sorted(tid for tid, info in tasks.items() if not info["done"])
            assert not unfinished, (
                f"requests {unfinished} never finished although every pin was released and every read completed"
            )
            assert not fake.pending and cache_of(store).scheduler.idle
            tg.cancel_scope.cancel()
        check_invariants(store, fake, tasks)
        assert not fake.pending, f"{len(fake.pending)} reads still pending at close"
        await store.aclose()
        assert fake.closed
        stats = store.statistics()
        assert stats.requests == stats.hits + stats.inflight_joins + stats.misses
        assert all(isinstance(e, aioexperts.AioExpertsError) for e in errors)

    async def bounded() -> None:
        with anyio.fail_after(20):  # a hang is a failure, with the example that caused it
            await main()

    anyio.run(bounded)
