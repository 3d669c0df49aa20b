"""The public engine API: requests, errors that leave the engine usable, closing, statistics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import numpy as np
import pytest
from ioutil import pread_segment

import aioexperts
from aioexperts._cli.synthetic import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff=256, n_expert=8, n_expert_used=2, leading_dense=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


def test_public_names_are_exactly_all() -> None:
    public = {n for n in dir(aioexperts) if not n.startswith("_")}
    assert public - {"testing"} == set(aioexperts.__all__)
    for name in aioexperts.__all__:
        assert getattr(aioexperts, name) is not None


def test_errors_form_one_tree() -> None:
    for name in aioexperts.__all__:
        obj = getattr(aioexperts, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, aioexperts.AioExpertsError)
    assert issubclass(aioexperts.FormatError, ValueError)
    assert issubclass(aioexperts.InvalidRequestError, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slots": 0},
        {"slots": 2.5},
        {"slots": "8"},
        {"slots": True},
        {"queue_depth": 0},
        {"queue_depth": "64"},
        {"cache_bytes": 0},
        {"n_threads": 0},
        {"n_threads": -1},
        {"policy": "fifo"},
        {"policy": 123},
        {"prefetch": 123},
        {"prefetch": "oracle"},
        {"prefetch_depth": -1},
        {"backend": 7},
        {"direct_io": "yes"},
    ],
)
def test_bad_arguments_raise_before_any_io(model_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(aioexperts.ConfigError):
        aioexperts.open(model_path, **kwargs)  # type: ignore[arg-type]


async def test_views_ids_minus_one_and_duplicates(model_path: Path, anyio_backend: object) -> None:
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    assert list(layout.layers) == [1, 2]
    async with aioexperts.open(model_path, slots=4) as engine:
        async with engine.experts(1, [3, -1, 3, np.int64(5)]) as views:
            assert views[1] is None
            assert views[0] is views[2]
            assert [v.expert for v in views if v is not None] == [3, 3, 5]
            for view in (views[0], views[3]):
                assert view is not None
                loc = layout.locate(1, view.expert)
                assert bytes(view.down.data) == pread_segment(model, loc.down)
            held = views[0].gate.data  # type: ignore[union-attr]
        st = engine.statistics()
        assert (st.requests, st.misses) == (2, 2)
        with pytest.raises(ValueError, match="released"):
            bytes(held)  # views are released when the block ends


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
async def test_bad_requests_leave_the_engine_usable(
    model_path: Path, layer: object, ids: list[object], needle: str, anyio_backend: object
) -> None:
    async with aioexperts.open(model_path, slots=4) as engine:
        with pytest.raises(aioexperts.InvalidRequestError, match=needle):
            async with engine.experts(layer, ids):  # type: ignore[arg-type]
                pass
        assert engine.cache.pinned_slots == 0
        async with engine.experts(2, [0, 1]) as views:
            assert len(views) == 2
        assert engine.statistics().requests == 2


async def test_slab_too_small_is_a_clear_error(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=3) as engine:
        with pytest.raises(aioexperts.SlabExhaustedError, match="4 experts requested at once but the slab has 3"):
            async with engine.experts(1, [0, 1, 2, 3]):
                pass
        async with engine.experts(1, [0, 1]):
            with pytest.raises(aioexperts.SlabExhaustedError, match="pinned"):
                async with engine.experts(2, [0, 1]):
                    pass
        async with engine.experts(2, [0, 1, 2]) as views:  # everything unpinned again
            assert len(views) == 3


async def test_closed_engine_refuses_requests(model_path: Path, anyio_backend: object) -> None:
    engine = aioexperts.open(model_path, slots=4)
    with pytest.raises(aioexperts.EngineClosedError, match="not started"):
        engine.statistics()
    async with engine:
        pass
    assert engine.closed
    with pytest.raises(aioexperts.EngineClosedError):
        async with engine.experts(1, [0]):
            pass
    await engine.aclose()  # idempotent
    assert engine.statistics().in_flight == 0


async def test_statistics_are_frozen_and_add_up(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=8) as engine:
        for ids in ([0, 1], [1, 2], [0, 2, 3]):
            async with engine.experts(1, ids):
                pass
        st = engine.statistics()
        with pytest.raises(dataclasses.FrozenInstanceError):
            st.hits = 0  # type: ignore[misc]
        assert st.requests == 7 == st.hits + st.inflight_joins + st.misses
        assert (st.misses, st.hits) == (4, 3)
        assert st.hit_rate == pytest.approx(3 / 7)
        assert st.reads == 12 and st.submissions >= 1
        assert st.payload_bytes == 4 * SMALL.expert_bytes()
        assert st.bytes_read >= st.payload_bytes
        assert st.expert_latency_p50_ms is not None and st.expert_latency_p50_ms > 0
        engine.reset_statistics()
        assert engine.statistics().requests == 0


async def test_missing_model_file(tmp_path: Path, anyio_backend: object) -> None:
    with pytest.raises(FileNotFoundError):
        async with aioexperts.open(tmp_path / "nope.gguf"):
            pass


async def test_expert_map_is_checked_at_open(model_path: Path, tmp_path: Path, anyio_backend: object) -> None:
    import os
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(model_path, path)
    model = aioexperts.open_model(path)
    aioexperts.write_expert_map(model, aioexperts.build_layout(model), tmp_path / "m.weepf")
    async with aioexperts.open(path, slots=2, expert_map=tmp_path / "m.weepf") as engine:
        async with engine.experts(1, [0]) as views:
            assert views[0] is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(aioexperts.StaleMapError, match="regenerate"):
        async with aioexperts.open(path, expert_map=tmp_path / "m.weepf"):
            pass


async def test_ids_may_be_any_iterable(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as engine:
        for ids in ((i for i in [5, 6]), map(int, "56"), iter([5, 6]), range(5, 7)):
            async with engine.experts(1, ids) as views:
                assert [v.expert for v in views if v is not None] == [5, 6]


def test_queue_depth_below_one_expert_is_refused(model_path: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="queue_depth must be in 3..4096"):
        aioexperts.open(model_path, queue_depth=2)


async def test_slots_beyond_the_model_are_lowered(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=10**9) as engine:
        assert engine.statistics().n_slots == engine.layout.n_experts_total == 16


async def test_resident_weights_of_a_replaced_file_are_refused(tmp_path: Path, anyio_backend: object) -> None:
    import os
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(model_path_for(tmp_path), path)
    async with aioexperts.open(path, slots=4) as engine:
        async with engine.experts(1, [0]):
            pass
        other = tmp_path / "other.gguf"
        write_synthetic_model(other, SMALL.with_(seed=7))
        os.replace(other, path)  # the path now names another model of the same geometry
        with pytest.raises(aioexperts.FormatError, match="changed since it was parsed"):
            await engine.moe(1, np.zeros((1, SMALL.n_embd), dtype=np.float32))


def model_path_for(tmp_path: Path) -> Path:
    path = tmp_path / "source.gguf"
    write_synthetic_model(path, SMALL)
    return path


def test_synthetic_split_sets_keep_the_default_alignment(tmp_path: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="default alignment"):
        write_synthetic_model(tmp_path / "s.gguf", SMALL.with_(alignment=4096), shards=2)


async def test_more_bad_requests(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as engine:
        with pytest.raises(aioexperts.InvalidRequestError, match="iterable"):
            async with engine.experts(1, 3):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer True"):
            async with engine.experts(True, [0]):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer 1.0"):
            async with engine.experts(1.0, [0]):  # type: ignore[arg-type]
                pass
        with pytest.raises(aioexperts.InvalidRequestError, match="no MoE layer 99"):
            engine.next_moe_layer(99)
        async with engine.experts(np.int64(1), [0]) as views:  # numpy ints are ints
            assert views[0] is not None and views[0].layer == 1 and type(views[0].layer) is int


async def test_a_directory_is_not_a_model(tmp_path: Path, anyio_backend: object) -> None:
    with pytest.raises(aioexperts.FormatError, match="not a regular file"):
        async with aioexperts.open(tmp_path):
            pass


def test_an_engine_belongs_to_its_event_loop(model_path: Path) -> None:
    import asyncio

    async def start() -> aioexperts.Engine:
        engine = aioexperts.open(model_path, slots=4)
        await engine.start()
        return engine

    engine = asyncio.run(start())

    async def use() -> None:
        with pytest.raises(aioexperts.ConfigError, match="another event loop"):
            async with engine.experts(1, [0]):
                pass

    asyncio.run(use())


async def test_a_faulty_policy_does_not_jam_the_engine(
    model_path: Path, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    from aioexperts._cache.eviction import LRU

    class Faulty(LRU):
        def admit(self, key: tuple[int, int]) -> None:
            raise KeyError(key)

    async with aioexperts.open(model_path, slots=4, policy=Faulty()) as engine:
        with anyio.fail_after(10), pytest.raises(aioexperts.AioExpertsError, match=r"admit\(\)") as info:
            async with engine.experts(1, [0, 1]):
                pass
        # a clear error with the policy's exception as the cause; no pin left, no slot lost
        assert isinstance(info.value.__cause__, KeyError)
        assert engine.cache.pinned_slots == 0
        assert len(engine.cache.free_slots) + len(engine.cache.entries) == 4
