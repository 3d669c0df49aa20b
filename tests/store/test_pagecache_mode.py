"""The page-cache mode: views from a read-only mapping, residency checks, warming, statistics."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from conftest import shared_fixture_paths
from ioutil import drop_cache, pread_segment, resident_pages

import aioexperts
import aioexperts._sources.mapped
from aioexperts._io.mapping import ResidencyFacts
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SPEC = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=2)
METHODS = ["read", "advice", "parallel-advice", "uring"]


@pytest.fixture(scope="module")
def source_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pc") / "m.gguf"
    write_synthetic_model(path, SPEC)
    return path


@pytest.fixture
def model_path(source_model: Path, tmp_path: Path) -> Path:
    """A fresh copy per test: page-cache state does not leak between tests."""
    path = tmp_path / "m.gguf"
    path.write_bytes(source_model.read_bytes())
    return path


def cold(path: Path) -> bool:
    drop_cache(path)
    return resident_pages(path, 0, path.stat().st_size) == 0


def expert_pages_resident(path: Path, loc: aioexperts.ExpertLocation) -> bool:
    return all(
        resident_pages(path, s.offset, s.n_bytes) == -(-(s.offset % 4096 + s.n_bytes) // 4096) for s in loc.segments
    )


@pytest.mark.parametrize("method", METHODS)
async def test_views_are_the_file_bytes(model_path: Path, method: str, anyio_backend: object) -> None:
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    options = aioexperts.PageCacheOptions(method=method, n_threads=2)
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        assert store.mode == "pagecache" and store.n_slots == layout.n_experts_total
        for layer in layout.layers:
            async with store.experts(layer, [3, -1, 7, 3]) as views:
                assert views[1] is None and views[0] is views[3]
                for view in (views[0], views[2]):
                    assert view is not None
                    loc = layout.locate(layer, view.expert)
                    assert [bytes(p.data) for p in (view.gate, view.up, view.down)] == [
                        pread_segment(model, s) for s in loc.segments
                    ]
                    assert view.gate.data.readonly
        st = store.statistics()
        assert st.backend == f"pagecache ({method})" and not st.direct_io and st.pinned_slots == 0
        assert st.pagecache is not None and st.pagecache.method == method
        assert st.requests == 6 == st.hits + st.misses
        threads = {"read": 2, "parallel-advice": 2, "advice": 1, "uring": 0}[method]  # io_uring: the ring reads
        assert st.backend_features["threads"] == threads
        assert st.backend_features["ranges_at_once"] >= max(threads, 1)


@pytest.mark.parametrize("method", ["read", "uring"])
async def test_read_warming_makes_experts_resident_and_skips_what_is(
    model_path: Path, method: str, anyio_backend: object
) -> None:
    layout = aioexperts.build_layout(aioexperts.open_model(model_path))
    loc = layout.locate(1, 5)
    options = aioexperts.PageCacheOptions(method=method)
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        if not cold(model_path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
        async with store.experts(1, [5]):
            assert expert_pages_resident(model_path, loc)  # "read" waits until the bytes are in
        st = store.statistics()
        assert (st.misses, st.hits) == (1, 0) and st.pagecache is not None and st.pagecache.ranges_issued >= 1
        assert st.pagecache.bytes_warmed > 0
        async with store.experts(1, [5]):  # now resident: a hit, nothing warmed
            pass
        st2 = store.statistics()
        assert st2.hits == 1 and st2.pagecache is not None
        assert st2.pagecache.ranges_issued == st.pagecache.ranges_issued
        assert st2.pagecache.resident_skipped > st.pagecache.resident_skipped


async def test_prefetch_warms_in_the_background_and_is_counted(model_path: Path, anyio_backend: object) -> None:
    layout = aioexperts.build_layout(aioexperts.open_model(model_path))
    async with aioexperts.open(model_path, mode="pagecache") as store:
        if not cold(model_path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
        assert store.prefetch([(2, e) for e in range(4)]) >= 1
        with anyio.fail_after(10):
            while store.statistics().in_flight:
                await anyio.sleep(0.01)
        st = store.statistics()
        assert st.pagecache is not None and st.pagecache.prefetch_calls == {2: 1}
        assert st.pagecache.bytes_warmed >= sum(layout.locate(2, e).n_bytes for e in range(4))
        async with store.experts(2, [0, 1, 2, 3]):
            pass
        assert store.statistics().hits == 4  # the prefetch made them resident
        assert all(expert_pages_resident(model_path, layout.locate(2, e)) for e in range(4))


async def test_queued_prefetches_are_dropped(model_path: Path, anyio_backend: object) -> None:
    options = aioexperts.PageCacheOptions(method="read", n_threads=1, max_gap=0)
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        if not cold(model_path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
        queued = store.prefetch([(2, e) for e in range(0, 16, 2)])  # gaps: one range per expert
        dropped = store.drop_prefetches(keep=lambda key: key[1] == 0)
        assert queued >= 2 and dropped >= 1
        assert store.statistics().prefetch_dropped == dropped


async def test_moe_through_the_page_cache_matches_the_slab_mode(anyio_backend: object) -> None:
    fixtures = [p for p in shared_fixture_paths() if p.stem == "qwen3moe-q4_k_m"]
    if not fixtures:
        pytest.skip("shared fixtures not found")
    path = fixtures[0]
    golden = np.load(path.with_suffix(".golden.npz"))
    x = np.atleast_2d(golden["moe_in-0"]).astype(np.float32)
    async with aioexperts.open(path, mode="pagecache") as store:
        got = await aioexperts.MoERunner(store).moe_result(0, x)
    async with aioexperts.open(path, slots=8) as store:
        want = await aioexperts.MoERunner(store).moe_result(0, x)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.ffn_out, want.ffn_out)  # the same bytes, the same arithmetic


def test_bad_mode_arguments(model_path: Path) -> None:
    with pytest.raises(aioexperts.ConfigError, match="mode must be one of slab, pagecache"):
        aioexperts.open(model_path, mode="mmap")
    with pytest.raises(aioexperts.ConfigError, match='need mode="pagecache"'):
        aioexperts.open(model_path, pagecache=aioexperts.PageCacheOptions())
    with pytest.raises(aioexperts.ConfigError, match="method must be one of read, advice, parallel-advice, uring"):
        aioexperts.PageCacheOptions(method="mmap")
    with pytest.raises(aioexperts.ConfigError, match="n_threads"):
        aioexperts.PageCacheOptions(n_threads=0)


async def test_close_while_a_request_waits_for_warming(model_path: Path, anyio_backend: object) -> None:
    options = aioexperts.PageCacheOptions(method="read", n_threads=1, max_gap=0)
    outcomes: list[str] = []
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:

        async def user(layer: int) -> None:
            try:
                async with store.experts(layer, range(16)):
                    outcomes.append("ok")
            except aioexperts.StoreClosedError:
                outcomes.append("closed")

        cold(model_path)
        async with anyio.create_task_group() as tg:
            for layer in range(3):
                tg.start_soon(user, layer)
            await anyio.lowlevel.checkpoint()
            await store.aclose()
    assert len(outcomes) == 3 and set(outcomes) <= {"ok", "closed"}
    assert store.statistics().in_flight == 0


async def test_uring_warming_falls_back_to_reads_without_io_uring(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, anyio_backend: object
) -> None:
    import errno

    import liburing

    def refuse(entries: int, ring: object, *args: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(liburing, "io_uring_queue_init", refuse)
    caplog.set_level(logging.WARNING, logger="aioexperts")  # an earlier test may have raised its level
    options = aioexperts.PageCacheOptions(method="uring")
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        async with store.experts(0, [1, 2]) as views:
            assert all(v is not None for v in views)
        st = store.statistics()
        assert st.pagecache is not None and st.pagecache.method == "read"  # what really warms
    assert "worker-thread reads instead" in caplog.text


@pytest.mark.parametrize("method", ["read", "advice"])  # advice reads nothing: only the size check guards it
async def test_a_model_file_that_shrinks_is_an_error_not_a_crash(
    model_path: Path, method: str, anyio_backend: object
) -> None:
    """Touching a mapped page past the end of the file kills the process (SIGBUS): the mode checks first."""
    import os

    layout = aioexperts.build_layout(aioexperts.open_model(model_path))
    last = layout.locate(2, 15)
    options = aioexperts.PageCacheOptions(method=method)
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        async with store.experts(2, [15]) as (view,):
            assert view is not None and view.gate.n_bytes > 0
        os.truncate(model_path, last.gate.offset)  # every byte of layer 2's last experts is gone
        with pytest.raises(aioexperts.ExpertReadError, match="shrank"):
            async with store.experts(2, [15]):
                pass
        with pytest.raises(aioexperts.AioExpertsError, match="shrank|changed since it was parsed"):
            await aioexperts.MoERunner(store).moe(2, np.zeros((1, SPEC.n_embd), dtype=np.float32))
        async with store.experts(0, [0]) as (view,):  # what is still in the file still serves
            assert view is not None and bytes(view.gate.data[:4])


def test_slab_options_are_refused_in_page_cache_mode(model_path: Path) -> None:
    for kwargs in ({"slots": 4}, {"cache_bytes": 1 << 20}, {"cache": aioexperts.CacheOptions()}):
        with pytest.raises(aioexperts.ConfigError, match="no slab"):
            aioexperts.open(model_path, mode="pagecache", **kwargs)  # type: ignore[arg-type]


async def test_prefetch_statistics_count_ranges_in_page_cache_mode(model_path: Path, anyio_backend: object) -> None:
    options = aioexperts.PageCacheOptions(method="read", n_threads=1, max_gap=0)
    async with aioexperts.open(model_path, mode="pagecache", pagecache=options) as store:
        if not cold(model_path):
            pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
        queued = store.prefetch([(2, e) for e in range(0, 16, 2)])
        st = store.statistics()
        assert st.prefetch_issued == queued and st.pagecache is not None  # ranges, like prefetch_dropped


def _untrusted_facts(fd: int, path: str) -> ResidencyFacts:
    """What a service user sees for a model owned by root (mincore would say: all resident)."""
    return ResidencyFacts(owner_uid=0, euid=1000, may_write=False, cap_fowner=False, cachestat="refused")


@pytest.mark.parametrize("trusted", [True, False])
async def test_untrusted_residency_warms_everything_and_says_so(
    model_path: Path,
    trusted: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    anyio_backend: object,
) -> None:
    """Where mincore lies (every page 'resident'), nothing may be skipped: every request is warmed."""
    if not trusted:
        monkeypatch.setattr(aioexperts._sources.mapped, "residency_facts", _untrusted_facts)
    model_path.read_bytes()  # every page resident: mincore's answer is the same either way here
    with caplog.at_level("WARNING", logger="aioexperts"):
        async with aioexperts.open(model_path, mode="pagecache") as store:
            for _ in range(2):
                async with store.experts(1, [5, 6]):
                    pass
            st = store.statistics()
    assert st.pagecache is not None
    warned = [r for r in caplog.records if "mincore would report" in r.getMessage()]
    if trusted:
        assert st.pagecache.residency == "mincore"
        assert st.pagecache.resident_skipped >= 2 and st.pagecache.ranges_issued == 0 and st.hits == 4
        assert not warned
    else:
        assert st.pagecache.residency == "untrusted"
        assert st.pagecache.resident_skipped == 0 and st.pagecache.ranges_issued >= 2
        assert (st.hits, st.misses) == (0, 4) and st.pagecache.bytes_warmed > 0
        assert len(warned) == 1 and str(model_path) in warned[0].getMessage()


async def test_an_array_kept_past_the_block_warns_and_only_then(model_path: Path, anyio_backend: object) -> None:
    """Page-cache views are released on exit; one whose bytes an array still uses warns (its mapping
    exporter does not count its views: the view's managed buffer tells)."""
    async with aioexperts.open(model_path, mode="pagecache") as store:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with store.experts(0, [1, 2]):
                pass
            assert not [w for w in caught if w.category is ResourceWarning]
            async with store.experts(0, [1, 2]) as views:
                assert views[1] is not None
                kept = np.frombuffer(views[1].down.data, dtype=np.uint8)
        messages = [str(w.message) for w in caught if w.category is ResourceWarning]
        assert len(messages) == 1 and "expert 2: the down bytes are still exported" in messages[0]
        assert kept.size > 0
