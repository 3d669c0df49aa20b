"""The public store API: requests, errors that leave the store usable, closing, statistics."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from ioutil import pread_segment

import aioexperts
from aioexperts.predictors import NullPredictor
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2, leading_dense=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


#: public modules of names (each with a tuple ``__all__``), then the package of user commands
API_MODULES = ("backends", "policies", "predictors", "testing", "traces", "serve")  # serve: the server extra
PUBLIC_MODULES = (*API_MODULES, "cli", "distributed")  # distributed: tests/distributed/test_placement.py


def test_public_names_are_exactly_all() -> None:
    public = {n for n in dir(aioexperts) if not n.startswith("_")}
    assert public - set(PUBLIC_MODULES) == set(aioexperts.__all__)  # cli: the commands' package
    for name in aioexperts.__all__:
        assert getattr(aioexperts, name) is not None


def test_installed_version_is_the_package_version() -> None:
    """pyproject.toml's version (what pip installed) and ``aioexperts.__version__`` are one number."""
    import importlib.metadata

    assert importlib.metadata.version("aioexperts") == aioexperts.__version__


@pytest.mark.parametrize("name", API_MODULES)
def test_public_modules_export_exactly_all(name: str) -> None:
    import importlib

    module = importlib.import_module(f"aioexperts.{name}")
    public = {n for n in dir(module) if not n.startswith("_")} - {"annotations"}
    assert isinstance(module.__all__, tuple) and public == set(module.__all__)
    for export in module.__all__:
        assert getattr(module, export) is not None


def test_errors_form_one_tree() -> None:
    for name in aioexperts.__all__:
        obj = getattr(aioexperts, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, aioexperts.AioExpertsError)
    assert issubclass(aioexperts.FormatError, ValueError)
    assert issubclass(aioexperts.InvalidRequestError, ValueError)
    assert issubclass(aioexperts.TokenizerError, ValueError)
    assert issubclass(aioexperts.VocabularyError, aioexperts.TokenizerError)
    assert issubclass(aioexperts.VocabularyError, aioexperts.FormatError)
    assert issubclass(aioexperts.OptionalDependencyError, ImportError)


def test_text_names_are_exported() -> None:
    """The tokenizer (issue 19) is public: the class, its stream decoder, its errors."""
    assert {"Tokenizer", "IncrementalDecoder", "TokenizerError", "VocabularyError"} <= set(aioexperts.__all__)
    assert aioexperts.Tokenizer.__module__ == "aioexperts._text.tokenizer"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: aioexperts.CacheOptions(slots=0), "slots must be >= 1"),
        (lambda: aioexperts.CacheOptions(slots=2.5), "slots must be an int"),
        (lambda: aioexperts.CacheOptions(slots="8"), "slots must be an int"),
        (lambda: aioexperts.CacheOptions(slots=True), "slots must be an int"),
        (lambda: aioexperts.CacheOptions(bytes=0), "bytes must be >= 1"),
        (lambda: aioexperts.CacheOptions(slots=4, bytes=1 << 20), "not both"),
        (lambda: aioexperts.CacheOptions(policy="fifo"), "policy must be one of lru, lfu, lfuda"),
        (lambda: aioexperts.CacheOptions(policy=123), "policy must be a policy name"),
        (lambda: aioexperts.CacheOptions(wait_for_slots="yes"), "wait_for_slots must be True or False"),
        (lambda: aioexperts.IOOptions(queue_depth=0), "queue_depth must be in 3..4096"),
        (lambda: aioexperts.IOOptions(queue_depth="64"), "queue_depth must be an int"),
        (lambda: aioexperts.IOOptions(n_threads=0), "n_threads must be in 1..256"),
        (lambda: aioexperts.IOOptions(n_threads=-1), "n_threads must be in 1..256"),
        (lambda: aioexperts.IOOptions(backend=7), "backend must be a name or a factory"),
        (lambda: aioexperts.IOOptions(backend="spdk"), "backend must be one of auto, io_uring, threads"),
        (lambda: aioexperts.IOOptions(direct_io="yes"), "direct_io must be True or False or None"),
        (lambda: aioexperts.IOOptions(max_bytes_in_flight=0), "max_bytes_in_flight must be >= 1"),
        (lambda: aioexperts.PrefetchOptions(predictor=123), "predictor must be a predictor name"),
        (lambda: aioexperts.PrefetchOptions(predictor="oracle"), "predictor must be one of"),
        (lambda: aioexperts.PrefetchOptions(depth=-1), "depth must be >= 0"),
        (lambda: aioexperts.PrefetchOptions(budget=-1), "budget must be >= 0"),
    ],
)
def test_bad_options_raise_when_built(make: object, needle: str) -> None:
    with pytest.raises(aioexperts.ConfigError, match=needle):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"slots": 0}, "slots must be >= 1"),
        ({"cache_bytes": 0}, "bytes must be >= 1"),
        ({"slots": 4, "cache_bytes": 1 << 20}, "not both"),
        ({"slots": 4, "cache": aioexperts.CacheOptions()}, "not both"),
        ({"cache": {"slots": 4}}, "cache must be a CacheOptions"),
        ({"io": "io_uring"}, "io must be an IOOptions"),
        ({"expert_map": 3}, "expert_map must be"),
    ],
)
def test_bad_arguments_raise_before_any_io(model_path: Path, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(aioexperts.ConfigError, match=needle):
        aioexperts.open(model_path, **kwargs)  # type: ignore[arg-type]


def test_options_are_frozen_records() -> None:
    options = aioexperts.IOOptions(queue_depth=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.queue_depth = 9  # type: ignore[misc]
    with pytest.raises(aioexperts.ConfigError, match="queue_depth"):
        dataclasses.replace(options, queue_depth=1)  # replace() checks again


def test_numpy_integers_are_accepted_as_ints() -> None:
    """Ids accept numpy integers; so do the options (stored as plain ints)."""
    cache = aioexperts.CacheOptions(slots=np.int64(4), slot_timeout=np.int32(2))
    io = aioexperts.IOOptions(queue_depth=np.int32(16), n_threads=np.uint8(2))
    prefetch = aioexperts.PrefetchOptions(budget=np.int16(3), depth=np.int64(1))
    pagecache = aioexperts.PageCacheOptions(n_threads=np.int64(2), max_gap=np.int64(0))
    values = [cache.slots, io.queue_depth, io.n_threads, prefetch.budget, prefetch.depth, pagecache.n_threads]
    assert values == [4, 16, 2, 3, 1, 2]
    assert all(type(v) is int for v in values)
    with pytest.raises(aioexperts.ConfigError, match="slots"):
        aioexperts.CacheOptions(slots=np.float64(4))


async def test_the_cache_size_given_either_way(model_path: Path, anyio_backend: object) -> None:
    slot_bytes = None
    async with aioexperts.open(model_path, slots=5) as store:
        st = store.statistics()
        assert st.n_slots == store.n_slots == 5
        slot_bytes = st.slot_bytes
    async with aioexperts.open(model_path, cache_bytes=7 * slot_bytes + 1) as store:
        assert store.n_slots == 7  # whole slots within the byte budget
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(bytes=7 * slot_bytes)) as store:
        assert store.n_slots == 7


async def test_a_byte_budget_below_the_minimum_is_raised_and_said(
    model_path: Path, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    async with aioexperts.open(model_path, slots=1) as store:
        least, slot_bytes = store.n_slots, store.statistics().slot_bytes  # slots= is capped, never raised
        assert least == 1
        top_k = store.layout.n_expert_used
    caplog.set_level("WARNING", logger="aioexperts.slab")
    async with aioexperts.open(model_path, cache_bytes=slot_bytes) as store:
        assert store.n_slots == 2 * top_k
    said = [r.getMessage() for r in caplog.records if "raised to the minimum" in r.getMessage()]
    assert len(said) == 1 and f"cache_bytes={slot_bytes} holds 1 slots" in said[0], said
    caplog.clear()
    async with aioexperts.open(model_path, cache_bytes=2 * top_k * slot_bytes) as store:
        assert store.n_slots == 2 * top_k
    assert not [r for r in caplog.records if "raised to the minimum" in r.getMessage()]


async def test_a_byte_budget_is_a_ceiling_with_hugepages(model_path: Path, anyio_backend: object) -> None:
    """With hugepages every slot maps 2 MiB: the slot count is the budget over that, not over the
    expert's bytes (16 MiB once mapped 2.6x its budget)."""
    budget = 16 << 20
    cache = aioexperts.CacheOptions(bytes=budget, hugepages=True)
    io = aioexperts.IOOptions(backend="threads")  # the slab's size does not depend on the backend
    async with aioexperts.open(model_path, cache=cache, io=io) as store:
        st = store.statistics()
        assert st.slot_bytes == 2 << 20
        assert st.n_slots * st.slot_bytes <= budget
        assert st.n_slots == budget // (2 << 20)  # rounded down to whole slots, no fewer
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(bytes=budget), io=io) as store:
        st = store.statistics()
        assert st.n_slots * st.slot_bytes <= budget and st.n_slots == 16  # every expert fits


def test_the_mlock_error_names_the_public_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioexperts._io import slab as slab_module

    class RefusingLibc:
        def __getattr__(self, name: str) -> Any:
            return getattr(slab_module.ctypes.CDLL(None, use_errno=True), name)

        @staticmethod
        def mlock(address: object, n_bytes: object) -> int:
            return -1

    monkeypatch.setattr(slab_module, "_libc", RefusingLibc())
    with pytest.raises(aioexperts.ConfigError, match=r"RLIMIT_MEMLOCK .*lock_memory=True") as info:
        slab_module.Slab(1, 4096, lock=True)
    assert "lock=True" not in str(info.value).replace("lock_memory=True", "")


async def test_views_ids_minus_one_and_duplicates(model_path: Path, anyio_backend: object) -> None:
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    assert list(layout.layers) == [1, 2]
    async with aioexperts.open(model_path, slots=4) as store:
        async with store.experts(1, [3, -1, 3, np.int64(5)]) as views:
            assert views[1] is None
            assert views[0] is views[2]
            assert [v.expert for v in views if v is not None] == [3, 3, 5]
            for view in (views[0], views[3]):
                assert view is not None
                loc = layout.locate(1, view.expert)
                assert bytes(view.down.data) == pread_segment(model, loc.down)
            held = views[0].gate.data  # type: ignore[union-attr]
        st = store.statistics()
        assert (st.requests, st.misses) == (2, 2)
        assert bytes(held) == pread_segment(model, layout.locate(1, 3).gate)  # shared views live with the slot
        async with store.experts(1, [0, 1, 2, 4]):  # the slots of 3 and 5 are reused
            pass
        with pytest.raises(ValueError, match="released"):
            bytes(held)  # a view is released when its slot shows another expert


@pytest.mark.parametrize(
    ("layer", "ids", "needle"),
    [
        (0, [1], "no MoE layer 0"),
        (7, [1], "no MoE layer 7"),
        (1, [8], "expert 8 does not exist"),
        (1, [-2], "expert -2 does not exist"),
        (1, [1.5], "must be ints"),
        (1, [True], "must be ints"),
        ("1", [1], "no MoE layer"),
    ],
)
async def test_bad_requests_leave_the_store_usable(
    model_path: Path, layer: object, ids: list[object], needle: str, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        with pytest.raises(aioexperts.InvalidRequestError, match=needle):
            async with store.experts(layer, ids):  # type: ignore[arg-type]
                pass
        assert store.statistics().pinned_slots == 0
        async with store.experts(2, [0, 1]) as views:
            assert len(views) == 2
        assert store.statistics().requests == 2


async def test_slab_too_small_is_a_clear_error(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=3) as store:
        with pytest.raises(aioexperts.SlabExhaustedError, match="4 experts requested at once but the slab has 3"):
            async with store.experts(1, [0, 1, 2, 3]):
                pass
        async with store.experts(1, [0, 1]):
            with pytest.raises(aioexperts.SlabExhaustedError, match="pinned"):
                async with store.experts(2, [0, 1]):
                    pass
        async with store.experts(2, [0, 1, 2]) as views:  # everything unpinned again
            assert len(views) == 3


async def test_closed_store_refuses_requests(model_path: Path, anyio_backend: object) -> None:
    store = aioexperts.open(model_path, slots=4)
    with pytest.raises(aioexperts.StoreClosedError, match="not started"):
        store.statistics()
    async with store:
        pass
    assert store.closed
    with pytest.raises(aioexperts.StoreClosedError):
        async with store.experts(1, [0]):
            pass
    await store.aclose()  # idempotent
    assert store.statistics().in_flight == 0


async def test_statistics_are_frozen_and_add_up(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=8) as store:
        for ids in ([0, 1], [1, 2], [0, 2, 3]):
            async with store.experts(1, ids):
                pass
        st = store.statistics()
        with pytest.raises(dataclasses.FrozenInstanceError):
            st.hits = 0  # type: ignore[misc]
        assert st.requests == 7 == st.hits + st.inflight_joins + st.misses
        assert (st.misses, st.hits) == (4, 3)
        assert st.hit_rate == pytest.approx(3 / 7)
        assert st.reads == 12 and st.submissions >= 1
        assert st.payload_bytes == 4 * SMALL.expert_bytes()
        assert st.bytes_read >= st.payload_bytes
        assert st.expert_latency_p50_ms is not None and st.expert_latency_p50_ms > 0
        store.reset_statistics()
        assert store.statistics().requests == 0


async def test_missing_model_file(tmp_path: Path, anyio_backend: object) -> None:
    with pytest.raises(FileNotFoundError):
        async with aioexperts.open(tmp_path / "nope.gguf"):
            pass


async def test_expert_map_is_checked_at_open(tmp_path: Path, anyio_backend: object) -> None:
    import os

    path = tmp_path / "m.gguf"
    # a WEEPF001 map describes blocks 0..n-1 (docs/notes/FORMATS.md section 3): a model without a dense lead
    write_synthetic_model(path, SMALL.with_(leading_dense=0))
    model = aioexperts.open_model(path)
    aioexperts.write_expert_map(model, aioexperts.build_layout(model), tmp_path / "m.weepf")
    async with aioexperts.open(path, slots=2, expert_map=tmp_path / "m.weepf") as store:
        async with store.experts(0, [0]) as views:
            assert views[0] is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(aioexperts.StaleMapError, match="write it again"):
        async with aioexperts.open(path, expert_map=tmp_path / "m.weepf"):
            pass


async def test_ids_may_be_any_iterable(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        for ids in ((i for i in [5, 6]), map(int, "56"), iter([5, 6]), range(5, 7)):
            async with store.experts(1, ids) as views:
                assert [v.expert for v in views if v is not None] == [5, 6]


def test_queue_depth_below_one_expert_is_refused(model_path: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="queue_depth must be in 3..4096"):
        aioexperts.open(model_path, io=aioexperts.IOOptions(queue_depth=2))


async def test_slots_beyond_the_model_are_lowered(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=10**9) as store:
        assert store.statistics().n_slots == store.layout.n_experts_total == 16


async def test_resident_weights_of_a_replaced_file_are_refused(tmp_path: Path, anyio_backend: object) -> None:
    import os
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(model_path_for(tmp_path), path)
    async with aioexperts.open(path, slots=4) as store:
        async with store.experts(1, [0]):
            pass
        other = tmp_path / "other.gguf"
        write_synthetic_model(other, SMALL.with_(seed=7))
        os.replace(other, path)  # the path now names another model of the same geometry
        with pytest.raises(aioexperts.FormatError, match="changed since it was parsed"):
            await aioexperts.MoERunner(store).moe(1, np.zeros((1, SMALL.n_embd), dtype=np.float32))


def model_path_for(tmp_path: Path) -> Path:
    path = tmp_path / "source.gguf"
    write_synthetic_model(path, SMALL)
    return path


def test_synthetic_split_sets_keep_the_default_alignment(tmp_path: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="default alignment"):
        write_synthetic_model(tmp_path / "s.gguf", SMALL.with_(alignment=4096), shards=2)


async def test_more_bad_requests(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        with pytest.raises(aioexperts.InvalidRequestError, match="iterable"):
            async with store.experts(1, 3):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer True"):
            async with store.experts(True, [0]):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer 1.0"):
            async with store.experts(1.0, [0]):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer 99"):
            aioexperts.MoERunner(store).upcoming_layers(99)
        async with store.experts(np.int64(1), [0]) as views:  # numpy ints are ints
            assert views[0] is not None and views[0].layer == 1 and type(views[0].layer) is int


async def test_a_directory_is_not_a_model(tmp_path: Path, anyio_backend: object) -> None:
    with pytest.raises(aioexperts.FormatError, match="not a regular file"):
        async with aioexperts.open(tmp_path):
            pass


def test_a_store_belongs_to_its_event_loop(model_path: Path) -> None:
    import asyncio
    import threading

    errors: list[BaseException] = []

    async def use(store: aioexperts.ExpertStore) -> None:
        try:
            async with store.experts(1, [0]):
                pass
        except aioexperts.ConfigError as exc:
            errors.append(exc)

    async def main() -> None:
        async with aioexperts.open(model_path, slots=4) as store:
            other = threading.Thread(target=lambda: asyncio.run(use(store)))  # another loop, another thread
            other.start()
            await asyncio.to_thread(other.join)
            async with store.experts(1, [0]) as views:  # still fine from its own loop
                assert views[0] is not None

    asyncio.run(main())
    assert len(errors) == 1 and "another event loop" in str(errors[0])


def test_an_unclosed_store_warns_when_collected(model_path: Path) -> None:
    import asyncio
    import gc

    async def leak() -> None:
        store = aioexperts.open(model_path, slots=4)
        await store.start()
        try:
            with pytest.warns(ResourceWarning, match="was not closed"):
                store.__del__()  # what the garbage collector calls
        finally:
            await store.aclose()
        gc.collect()

    asyncio.run(leak())


async def test_a_faulty_policy_does_not_jam_the_store(
    model_path: Path, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    from aioexperts._cache.eviction import LRU

    class Faulty(LRU):
        def admit(self, key: tuple[int, int]) -> None:
            raise KeyError(key)

    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=4, policy=Faulty())) as store:
        with anyio.fail_after(10), pytest.raises(aioexperts.AioExpertsError, match=r"admit\(\)") as info:
            async with store.experts(1, [0, 1]):
                pass
        # a clear error with the policy's exception as the cause; no pin left, no slot lost
        assert isinstance(info.value.__cause__, KeyError)
        assert store.statistics().pinned_slots == 0
        for first in range(0, 16, 4):  # every slot is still there: each request gets its 4 slots
            with anyio.fail_after(10), pytest.raises(aioexperts.AioExpertsError, match=r"admit\(\)"):
                async with store.experts(2, range(first % 8, first % 8 + 4)):
                    pass
        assert store.statistics().pinned_slots == 0


async def test_paths_as_bytes_and_with_a_tilde(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    async with aioexperts.open(os.fsencode(model_path), slots=4) as store:
        assert store.path == str(model_path)
    monkeypatch.setenv("HOME", str(model_path.parent))
    async with aioexperts.open(f"~/{model_path.name}", slots=4) as store:
        assert store.path == str(model_path)
        async with store.experts(1, [0]) as views:
            assert views[0] is not None


async def test_non_finite_input_is_refused_before_any_read(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        x = np.zeros((5, SMALL.n_embd), dtype=np.float32)
        x[1, 3] = np.nan
        x[4, 0] = -np.inf
        with pytest.raises(aioexperts.InvalidRequestError, match=r"NaN or inf values in token rows 1, 4"):
            await runner.moe(1, x)
        huge = np.full((2, SMALL.n_embd), 3e38, dtype=np.float32)  # finite, but the logits overflow
        with pytest.raises(aioexperts.InvalidRequestError, match="not finite for token rows 0, 1"):
            await runner.moe(1, huge)  # and no RuntimeWarning escapes (warnings are errors here)
        assert store.statistics().requests == 0  # refused before any expert was asked for
        y = await runner.moe(1, np.ones((1, SMALL.n_embd), dtype=np.float32))
        assert np.isfinite(y).all()


async def test_finite_input_that_overflows_in_the_experts_is_refused_not_returned_as_nan(
    model_path: Path, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        x = np.random.default_rng(0).standard_normal((3, SMALL.n_embd)).astype(np.float32)
        x[1] *= np.float32(1e30)  # the router copes (softmax); the experts' products overflow
        with pytest.raises(aioexperts.InvalidRequestError, match=r"overflowed float32 .* token rows 1;"):
            await runner.moe(1, x)  # and no RuntimeWarning escapes (warnings are errors here)
        assert store.statistics().pinned_slots == 0
        x[1] /= np.float32(1e30)
        assert np.isfinite(await runner.moe(1, x)).all()


@pytest.mark.parametrize(
    ("ids", "weights", "needle"),
    [
        (np.array([[0.0, 1.0]]), np.ones((1, 2), np.float32), "ids must be ints"),
        (np.array([[0, 1]]), np.ones((1, 2), np.float64), "weights must be float32"),
        (np.array([[0, 8]]), np.ones((1, 2), np.float32), r"ids must be in -1..7"),
        (np.array([[0, -2]]), np.ones((1, 2), np.float32), r"ids must be in -1..7"),
        ([[0.0, 1.0]], np.ones((1, 2), np.float32), "ids must be ints"),
        ([0, 1], np.ones((1, 2), np.float32), "ids must be ints"),
        (np.array([[0, 1], [1, 2]]), np.ones((2, 2), np.float32), r"shape \(1, k\)"),
    ],
)
async def test_a_custom_route_step_is_checked(
    model_path: Path, ids: object, weights: object, needle: str, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        with pytest.raises(aioexperts.InvalidRequestError, match=needle):
            await runner.run_moe_layers(
                np.zeros((1, SMALL.n_embd), dtype=np.float32), route_step=lambda layer, x: (ids, weights)
            )
        assert store.statistics().pinned_slots == 0


async def test_a_custom_route_step_may_return_ids_as_a_list(model_path: Path, anyio_backend: object) -> None:
    """Integer ids as any array-like (a nested list), as numpy APIs take them; the same result as an array."""
    x = np.zeros((1, SMALL.n_embd), dtype=np.float32)
    weights = np.full((1, 2), 0.5, np.float32)
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        as_list = await runner.run_moe_layers(x, route_step=lambda layer, x: ([[0, 1]], weights))
        as_array = await runner.run_moe_layers(x, route_step=lambda layer, x: (np.array([[0, 1]], np.int32), weights))
    np.testing.assert_array_equal(as_list.output, as_array.output)
    assert [s.ids.tolist() for s in as_list.steps] == [[[0, 1]]] * len(as_list.steps)


async def test_a_closed_store_says_so(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        await runner.moe(1, np.zeros((1, SMALL.n_embd), dtype=np.float32))
    for call in (
        lambda: runner.moe(1, np.zeros((1, SMALL.n_embd), dtype=np.float32)),
        lambda: runner.run_moe_layers(np.zeros((1, SMALL.n_embd), dtype=np.float32)),
    ):
        with pytest.raises(aioexperts.StoreClosedError, match="closed"):
            await call()
    with pytest.raises(aioexperts.StoreClosedError, match="closed"):
        store.prefetch([(1, 0)])


async def _keep_past_the_pin(
    store: aioexperts.ExpertStore, projection: str
) -> tuple[np.ndarray, aioexperts.ExpertView]:
    """A numpy array over one projection's slot memory that outlives the block, and a copy of the expert."""
    async with store.experts(1, [2]) as (view,):
        assert view is not None
        kept = np.frombuffer(getattr(view, projection).data, dtype=np.uint8)
        return kept, view.copy()


async def test_views_kept_past_the_pin_warn_and_copies_stay_valid(model_path: Path, anyio_backend: object) -> None:
    model = aioexperts.open_model(model_path)
    want = pread_segment(model, aioexperts.build_layout(model).locate(1, 2).gate)
    async with aioexperts.open(model_path, slots=4) as store:
        with pytest.warns(ResourceWarning, match="the gate bytes are still exported"):
            kept, copy = await _keep_past_the_pin(store, "gate")
        assert kept.base is not None
        del kept
        assert bytes(copy.gate.data) == want and copy.gate.shape == (SMALL.n_ff_exp, SMALL.n_embd)
        async with store.experts(1, [3, 4, 5, 6]):  # the slot is reused
            pass
        assert bytes(copy.gate.data) == want
        with pytest.warns(ResourceWarning, match="the down bytes are still exported"):
            survivor, _ = await _keep_past_the_pin(store, "down")
    # the store closed with an array over slab memory alive: the mapping stays until it is dropped
    assert survivor.sum() >= 0 and len(survivor) == SMALL.expert_bytes() // 3


def test_a_path_behind_an_unsearchable_directory_is_a_permission_error(model_path: Path, tmp_path: Path) -> None:
    import shutil

    locked = tmp_path / "locked"
    locked.mkdir()
    shutil.copy(model_path, locked / "m.gguf")
    locked.chmod(0o600)  # a readable listing, no search (x) permission
    tmp_path.chmod(0o755)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: as 'nobody' when we are root (root may search any directory)
        outcome = "other"
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            aioexperts.open_model(locked / "m.gguf")
        except PermissionError:
            outcome = "PermissionError"
        except FileNotFoundError:
            outcome = "FileNotFoundError"
        except BaseException as exc:  # anything else is reported, not raised, in a forked child
            outcome = type(exc).__name__
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    try:
        outcome = os.read(read_end, 100).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
        locked.chmod(0o700)
    assert outcome == "PermissionError"


def test_a_failed_open_closes_its_descriptors_at_once(model_path: Path, tmp_path: Path) -> None:
    import asyncio
    import gc

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model_path.read_bytes()[: model_path.stat().st_size // 2])
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGUF" + bytes(100))

    def n_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def fail(path: Path, **kwargs: object) -> None:
        with pytest.raises(aioexperts.AioExpertsError):
            async with aioexperts.open(path, slots=4, **kwargs):  # type: ignore[arg-type]
                pass

    def refuse(*args: object) -> None:
        raise aioexperts.BackendUnavailableError("no backend in this test")

    gc.disable()  # nothing may wait for the collector
    try:
        before = n_fds()
        for _ in range(3):
            asyncio.run(fail(truncated))
            asyncio.run(fail(not_gguf))
            asyncio.run(fail(model_path, io=aioexperts.IOOptions(backend=refuse)))  # fails after opening
        assert n_fds() == before
    finally:
        gc.enable()


async def test_requests_wait_for_slots_by_default_like_a_pool(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        assert store.cache_options.wait_for_slots
        released = anyio.Event()
        got: list[int] = []

        async def holder() -> None:
            async with store.experts(1, [0, 1, 2, 3]):
                await released.wait()

        async def waiter() -> None:
            async with store.experts(2, [0, 1]) as views:  # needs two of the four pinned slots
                got.extend(v.expert for v in views if v is not None)

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert got == []  # still waiting: every slot is pinned by the holder
            released.set()
        assert got == [0, 1]


async def test_a_slot_timeout_raises_a_timeout(model_path: Path, anyio_backend: object) -> None:
    cache = aioexperts.CacheOptions(slots=4, slot_timeout=0.05)
    async with aioexperts.open(model_path, cache=cache) as store:
        release = anyio.Event()

        async def holder() -> None:
            async with store.experts(1, [0, 1, 2, 3]):
                await release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await anyio.wait_all_tasks_blocked()
            with anyio.fail_after(10), pytest.raises(aioexperts.SlotTimeoutError, match="within 0.05 s") as info:
                async with store.experts(2, [0]):
                    pass
            release.set()
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, aioexperts.SlabExhaustedError)
        assert store.statistics().pinned_slots == 0


async def test_a_task_holding_pins_gets_an_error_instead_of_a_deadlock(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        async with store.experts(1, [0, 1, 2]):
            async with store.experts(2, [0]) as views:  # one slot is free: no waiting, fine
                assert views[0] is not None
            with anyio.fail_after(10), pytest.raises(aioexperts.SlabExhaustedError, match="holds 3 pinned experts"):
                async with store.experts(2, [1, 2]):  # needs one more slot than is free: would wait on itself
                    pass
        async with store.experts(2, [1, 2, 3, 4]) as views:  # released: everything usable again
            assert len(views) == 4


def test_renamed_names_still_work_for_one_release_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="StoreClosedError"):
        assert aioexperts.EngineClosedError is aioexperts.StoreClosedError  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="StoreStatistics"):
        assert aioexperts.EngineStatistics is aioexperts.StoreStatistics  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="MoELayersResult"):
        assert aioexperts.TokenResult is aioexperts.MoELayersResult  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="split in 0.2"):
        aioexperts.Engine  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aioexperts.nope  # type: ignore[attr-defined]  # noqa: B018


def test_closing_from_another_loop_is_refused(model_path: Path) -> None:
    import asyncio
    import threading

    errors: list[BaseException] = []

    async def close_elsewhere(store: aioexperts.ExpertStore) -> None:
        try:
            await store.aclose()
        except aioexperts.ConfigError as exc:
            errors.append(exc)

    async def main() -> None:
        async with aioexperts.open(model_path, slots=4) as store:
            other = threading.Thread(target=lambda: asyncio.run(close_elsewhere(store)))
            other.start()
            await asyncio.to_thread(other.join)
            assert not store.closed  # still open and usable
            async with store.experts(1, [0]) as views:
                assert views[0] is not None
        assert store.closed

    asyncio.run(main())
    assert len(errors) == 1 and "its own loop" in str(errors[0])


async def test_a_policy_that_offers_no_victim_is_an_error_not_a_hang(model_path: Path, anyio_backend: object) -> None:
    from aioexperts.policies import LRU

    class NoVictim(LRU):
        def victim(self, can_evict):  # type: ignore[no-untyped-def]
            return None  # allowed when nothing is evictable; here plenty is

    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=4, policy=NoVictim())) as store:
        async with store.experts(1, [0, 1, 2, 3]):
            pass
        with anyio.fail_after(10), pytest.raises(aioexperts.EvictionPolicyError, match="offered no victim"):
            async with store.experts(2, [0, 1]):
                pass
        assert store.statistics().pinned_slots == 0


async def test_one_policy_instance_serves_one_store(model_path: Path, anyio_backend: object) -> None:
    from aioexperts.policies import LRU

    policy = LRU()
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=4, policy=policy)) as first:
        with pytest.raises(aioexperts.ConfigError, match="already serves another open store"):
            async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=4, policy=policy)):
                pass
        async with first.experts(1, [0]) as views:
            assert views[0] is not None
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=4, policy=policy)) as again:
        async with again.experts(1, [0, 1, 2, 3]):  # free again once the first store closed, and empty
            pass
        async with again.experts(2, [0, 1]) as views:  # evictions work: the policy knows this store's keys only
            assert len(views) == 2


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s, r: s.prefetch([1, 2]), "pairs of ints"),
        (lambda s, r: s.prefetch([(1, 2, 3)]), "pairs of ints"),
        (lambda s, r: s.prefetch([(1.0, 2)]), "pairs of ints"),
        (lambda s, r: s.prefetch(None), "iterable of"),
        (lambda s, r: s.drop_prefetches(5), "keep must be a callable"),
    ],
)
async def test_store_arguments_are_checked(model_path: Path, call: object, needle: str, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        with pytest.raises(aioexperts.InvalidRequestError, match=needle):
            call(store, None)  # type: ignore[operator]
        with pytest.raises(aioexperts.InvalidRequestError, match="pairs of ints"):
            async with store.experts(1, [0], prefetch=[5]):  # type: ignore[list-item]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="wait must be"):
            async with store.experts(1, [0], wait="no"):  # type: ignore[arg-type]
                pass
        assert store.statistics().pinned_slots == 0


def _x() -> np.ndarray:
    return np.zeros((2, SMALL.n_embd), dtype=np.float32)


class _NonePredictor(NullPredictor):
    def predict(self, layer, next_layer, x, budget):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"compute": "abc"}, "compute must be a ComputeStep"),
        ({"predictor": "router"}, "predictor must be an aioexperts.predictors.Predictor"),
        ({"route_step": lambda layer, x: None}, "route_step must return"),
        ({"prefetch": "no"}, "prefetch must be True or False"),
        ({"compute": lambda layer, x, v, i, w: x[:1]}, r"must return a float32 array of shape \(2, 256\)"),
        ({"compute": lambda layer, x, v, i, w: 0}, "must return a float32 array"),
        ({"compute": lambda layer, x, v, i, w: x.astype(np.float64)}, "must return a float32 array"),
        ({"compute": lambda layer, x, v, i, w: x + np.float32("nan")}, "returned NaN or inf in token rows 0, 1"),
        (
            {"route_step": lambda layer, x: (np.zeros((2, 2), np.int32), np.full((2, 2), np.nan, np.float32))},
            "weights are NaN or inf",
        ),
        ({"predictor": _NonePredictor()}, "predict must return a list of expert ids"),
    ],
)
async def test_runner_arguments_and_custom_steps_are_checked(
    model_path: Path, kwargs: dict[str, object], needle: str, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        with pytest.raises(aioexperts.InvalidRequestError, match=needle):
            await runner.run_moe_layers(_x(), **kwargs)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.InvalidRequestError, match="prefetch must be True or False"):
            await runner.moe_result(1, _x(), prefetch="no")  # type: ignore[arg-type]
        assert store.statistics().pinned_slots == 0
        assert (await runner.run_moe_layers(_x())).output.shape == (2, SMALL.n_embd)  # still usable


#: (mode, module, name): a blocking step of start() and the module it is looked up in
START_STEPS = [
    ("slab", "_store", "open_model"),
    ("slab", "_sources.slab", "open_shards"),
    ("slab", "_sources.slab", "plan_all_experts"),
    ("slab", "_sources.stack", "Slab"),
    ("slab", "_sources.stack", "create_backend"),
    ("pagecache", "_sources.mapped", "MappedShards"),
    ("pagecache", "_sources.mapped", "create_backend"),
    ("rows", "_sources.slab", "RowReader"),
]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(("mode", "module", "step"), START_STEPS, ids=[f"{m}-{s}" for m, _, s in START_STEPS])
def test_task_cancel_while_start_works_in_a_thread_leaks_nothing(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, module: str, step: str, loop: str
) -> None:
    # A plain Task.cancel() is not held off by anyio's thread shield: start() used to release what
    # it had opened while its worker thread went on opening the rest (files, a ring, an eventfd).
    import asyncio
    import gc
    import importlib
    import threading

    store_module = importlib.import_module(f"aioexperts.{module}")
    running, go = threading.Event(), threading.Event()
    original = getattr(store_module, step)

    def gated(*args: object, **kwargs: object) -> object:
        running.set()
        go.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(store_module, step, gated)

    def n_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def cancel_in_the_thread() -> None:
        pagecache = aioexperts.PageCacheOptions(method="uring") if mode == "pagecache" else None
        if mode == "pagecache":
            store = aioexperts.open(model_path, mode="pagecache", pagecache=pagecache)
        else:
            store = aioexperts.open(model_path, slots=4)
        try:
            if mode == "rows":
                await store.start()
                work = store.read_rows("token_embd.weight", [0, 1])
            else:
                work = store.start()
            task = asyncio.get_running_loop().create_task(work)
            while not running.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.sleep(0.01)  # the cancellation is in while the thread still works
            go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            go.set()
            await store.aclose()

    def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if loop == "uvloop":
            import uvloop

            uvloop.run(main())
        else:
            asyncio.run(main())

    async def nothing() -> None:
        pass

    run(nothing)  # what the first run of a loop keeps open (uvloop's own descriptors)
    before = n_fds()
    gc.disable()  # nothing may wait for the collector
    try:
        run(cancel_in_the_thread)
        assert running.is_set()
        assert n_fds() == before, "descriptors left open after the cancelled start and aclose()"
    finally:
        gc.enable()


async def test_only_a_large_model_is_collected_once_at_open(
    model_path: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection at open only where the open made enough objects to matter (a small model's
    open must not pay for the host's whole heap)."""
    import gc

    from aioexperts._sources import slab

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    async with aioexperts.open(model_path, slots=4):
        pass
    assert calls == []
    monkeypatch.setattr(slab, "SETTLE_MIN_EXPERTS", 1)
    async with aioexperts.open(model_path, slots=4):
        pass
    assert len(calls) == 1


def _open_descriptors() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


async def test_a_store_closed_before_or_while_it_starts_releases_everything(
    model_path: Path, anyio_backend: object
) -> None:
    """A close before start() made start() open everything for a closed store (never released); a
    close from another task while start() ran released the slab under it and left its ring,
    eventfds and file open."""
    before = _open_descriptors()
    store = aioexperts.open(model_path, slots=4)
    await store.aclose()
    with pytest.raises(aioexperts.StoreClosedError, match="closed before it started"):
        await store.start()
    outcomes = []
    for delay in (0.0, 0.001, 0.005, 0.02):
        store = aioexperts.open(model_path, slots=4)

        async def start(store: aioexperts.ExpertStore = store) -> None:
            try:
                await store.start()
                outcomes.append("started")
            except aioexperts.StoreClosedError:
                outcomes.append("refused")

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await anyio.sleep(delay)
            await store.aclose()
        assert store.closed
        with pytest.raises(aioexperts.StoreClosedError):
            async with store.experts(1, [0]):
                pass
    assert "refused" in outcomes, outcomes  # a close during the start was met at least once
    assert _open_descriptors() - before == set()


async def test_a_warm_hit_is_a_checkpoint(model_path: Path, anyio_backend: object) -> None:
    """Every expert resident: the block was entered with no await, so a cancelled scope was entered
    anyway and a loop of warm hits never let a deadline (or any other task) in."""
    import time

    async with aioexperts.open(model_path, slots=4) as store:
        async with store.experts(1, [0]):
            pass  # resident from now on
        entered = False
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with store.experts(1, [0]):
                entered = True
        assert not entered and scope.cancelled_caught
        t0 = time.monotonic()
        with anyio.move_on_after(0.05) as deadline:
            while time.monotonic() - t0 < 2:
                async with store.experts(1, [0]):
                    pass
        assert deadline.cancelled_caught and time.monotonic() - t0 < 1
        assert store.statistics().pinned_slots == 0


async def test_bad_id_lists_of_start_loads_and_resident_are_request_errors(
    model_path: Path, anyio_backend: object
) -> None:
    """They were bare TypeErrors (``list(None)``), and a string was taken as its characters."""
    async with aioexperts.open(model_path, slots=4) as store:
        calls: list[Callable[[], object]] = [
            lambda: store.start_loads(1, None),  # type: ignore[arg-type]
            lambda: store.start_loads(1, 5),  # type: ignore[arg-type]
            lambda: store.start_loads(1, [1], low_ids=None),  # type: ignore[arg-type]
            lambda: store.resident(1, None),  # type: ignore[arg-type]
            lambda: store.resident(1, "12"),
        ]
        for call in calls:
            with pytest.raises(aioexperts.InvalidRequestError, match="must be an iterable of expert ids"):
                call()
        assert store.resident(1, [1, 2]) == [False, False]  # still usable


def test_read_threads_are_bounded() -> None:
    """100,000 was accepted: a request of 8 experts started about 22,000 threads and the store
    could not be closed (``can't start new thread``)."""
    with pytest.raises(aioexperts.ConfigError, match=r"n_threads must be in 1\.\.256, got 100000"):
        aioexperts.IOOptions(n_threads=100_000)
    assert aioexperts.IOOptions(n_threads=256).n_threads == 256


async def test_each_request_waiting_for_a_failed_read_gets_its_own_error(
    model_path: Path, tmp_path: Path, anyio_backend: object
) -> None:
    """One exception object was raised in all of them: its traceback grew by every task's frames."""
    import shutil
    import traceback

    path = tmp_path / "trunc.gguf"
    shutil.copyfile(model_path, path)
    async with aioexperts.open(path, slots=4) as store:
        os.truncate(path, 4096 * 4)  # every expert now lies past the end of the file
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                async with store.experts(1, [7]):
                    pass
            except aioexperts.ExpertReadError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(one)
        assert len(errors) == 50 and len({id(e) for e in errors}) == 50
        assert len({str(e) for e in errors}) == 1 and "layer 1 expert 7" in str(errors[0])
        assert all(len(traceback.extract_tb(e.__traceback__)) < 10 for e in errors)


@pytest.mark.parametrize("made", ["raises", None, "object"])
async def test_a_backend_factory_that_fails_is_a_config_error_and_releases_the_store(
    model_path: Path, anyio_backend: object, made: object
) -> None:
    """Its own exception (or an AttributeError for None) came out, and a non-backend leaked the
    model's descriptor and made every later aclose() raise."""

    def factory(*args: object) -> object:
        if made == "raises":
            raise RuntimeError("factory failed")
        return object() if made == "object" else None

    before = _open_descriptors()
    store = aioexperts.open(model_path, slots=4, io=aioexperts.IOOptions(backend=factory))  # type: ignore[arg-type]
    with pytest.raises(aioexperts.ConfigError, match="the backend factory .* (failed: RuntimeError|returned)"):
        await store.start()
    await store.aclose()
    assert store.closed and _open_descriptors() - before == set()


async def test_a_block_closed_in_another_task_unpins_for_the_task_that_pinned(
    model_path: Path, anyio_backend: tuple[str, dict[str, object]]
) -> None:
    """An abandoned async generator's block is closed by the loop in a task of its own: the pins
    stayed counted on the first task, which then got SlabExhaustedError ("this task holds 2
    pinned experts") whenever it had to wait for a slot, holding nothing."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio's asyncgen finalizer closes a generator in a task of its own; trio's does not")
    import asyncio
    import gc

    async with aioexperts.open(model_path, slots=4) as store:

        async def layer_views() -> Any:
            async with store.experts(1, [0, 1]) as views:
                yield views

        async for _ in layer_views():
            break  # abandoned inside its block
        gc.collect()
        await asyncio.sleep(0.05)  # the loop's finalizer closes it
        assert store.statistics().pinned_slots == 0
        filled = asyncio.Event()

        async def hog() -> None:
            async with store.experts(1, [4, 5, 6, 7]):
                filled.set()
                await asyncio.sleep(0.1)

        other = asyncio.create_task(hog())
        await filled.wait()
        async with store.experts(1, [3]) as (view,):  # waits for a slot: this task holds nothing
            assert view is not None
        await other


async def test_releasing_a_store_view_leaves_the_expert_readable_for_later_requests(
    model_path: Path, anyio_backend: object
) -> None:
    """The slab mode's views are shared by every request of one slot load: a host's ``release()``
    of one must not break that expert for every later hit (it did, until its eviction)."""
    model = aioexperts.open_model(model_path)
    loc = aioexperts.build_layout(model).locate(1, 3)
    want = [pread_segment(model, s) for s in loc.segments]
    async with aioexperts.open(model_path) as store:
        async with store.experts(1, [3]) as (view,):
            view.release()
            assert [bytes(p.data) for p in (view.gate, view.up, view.down)] == want
        async with store.experts(1, [3]) as (again,):
            assert [bytes(p.data) for p in (again.gate, again.up, again.down)] == want
