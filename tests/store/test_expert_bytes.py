"""Every expert's bytes, through every backend, equal a plain ``pread`` of the file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest
from conftest import shared_fixture_paths
from ioutil import pread_segment

import aioexperts
from aioexperts.testing import FakeBackend

pytestmark = pytest.mark.anyio

FIXTURES = shared_fixture_paths()


def fake(**kwargs: object):  # type: ignore[no-untyped-def]
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        return FakeBackend(files, slab, loop, depth, **kwargs)

    return factory


BACKENDS = {
    "io_uring": "io_uring",
    "threads": "threads",
    "fake-reverse": fake(order="reverse"),
}


async def check_every_expert(
    path: Path, backend: object, slots: int = 3, chunk: int = 2, split_bytes: int | None = None
) -> int:
    """Read every expert of every layer in chunks through a small slab; compare with pread."""
    checked = 0
    io = aioexperts.IOOptions(backend=backend, split_bytes=split_bytes)  # type: ignore[arg-type]
    async with aioexperts.open(path, slots=slots, io=io) as store:
        model, layout = store.model, store.layout
        for layer, moe in layout.layers.items():
            ids = list(range(moe.n_experts))
            for start in range(0, len(ids), chunk):
                async with store.experts(layer, ids[start : start + chunk]) as views:
                    for view in views:
                        assert view is not None
                        loc = layout.locate(layer, view.expert)
                        assert view.bank == loc.bank
                        for seg, proj in zip(loc.segments, (view.gate, view.up, view.down), strict=True):
                            assert proj.ggml_type == seg.ggml_type and proj.shape == seg.shape
                            assert proj.data.readonly
                            assert bytes(proj.data) == pread_segment(model, seg), (layer, view.expert)
                            checked += 1
        st = store.statistics()
        assert st.misses == layout.n_experts_total  # the slab is too small to keep them: all read
        assert st.requests == st.hits + st.inflight_joins + st.misses
        assert st.evictions == layout.n_experts_total - slots
    return checked


@pytest.mark.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
async def test_every_fixture_expert_matches_pread(path: Path, backend: str, anyio_backend: object) -> None:
    checked = await check_every_expert(path, BACKENDS[backend])
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    assert checked == 3 * layout.n_experts_total


@pytest.mark.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
@pytest.mark.parametrize("path", FIXTURES[:3], ids=[p.stem for p in FIXTURES[:3]])
async def test_experts_read_in_split_chunks_match_pread(path: Path, backend: str, anyio_backend: object) -> None:
    checked = await check_every_expert(path, BACKENDS[backend], split_bytes=8192)
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    assert checked == 3 * layout.n_experts_total


@pytest.fixture(scope="module")
def split_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mixed-tier fixture re-split into 3 shards by llama.cpp's naming (copied bytes)."""
    if not FIXTURES:
        pytest.skip("shared fixtures not found")
    import gguf

    src = next(p for p in FIXTURES if p.stem == "qwen3moe-mixed")
    reader = gguf.GGUFReader(src)
    out = tmp_path_factory.mktemp("split") / "mixed.gguf"
    writer = gguf.GGUFWriter(os.fspath(out), "qwen3moe", split_max_tensors=25)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    second = out.parent / "mixed-00002-of-00003.gguf"
    assert second.exists()
    return second


@pytest.mark.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
async def test_split_copy_experts_match_pread(split_copy: Path, backend: str, anyio_backend: object) -> None:
    model = aioexperts.open_model(split_copy)
    assert len(model.shards) == 3
    layout = aioexperts.build_layout(model)
    assert len({loc.gate.shard for loc in layout} | {loc.down.shard for loc in layout}) > 1
    checked = await check_every_expert(split_copy, BACKENDS[backend])
    assert checked == 3 * layout.n_experts_total
    # and the bytes equal the original single file's
    original = aioexperts.open_model(next(p for p in FIXTURES if p.stem == "qwen3moe-mixed"))
    orig_layout = aioexperts.build_layout(original)
    for loc, orig in zip(layout, orig_layout, strict=True):
        for a, b in zip(loc.segments, orig.segments, strict=True):
            assert pread_segment(model, a) == pread_segment(original, b)


async def test_copy_of_a_fixture_with_every_backend_on_a_big_slab(tmp_path: Path, anyio_backend: object) -> None:
    """A slab that holds everything: the second pass is all hits and reads nothing."""
    if not FIXTURES:
        pytest.skip("shared fixtures not found")
    path = tmp_path / "m.gguf"
    shutil.copy(FIXTURES[0], path)
    async with aioexperts.open(path, slots=64) as store:
        layer = next(iter(store.layout.layers))
        ids = list(range(store.layout.layers[layer].n_experts))
        for _ in range(2):
            async with store.experts(layer, ids) as views:
                assert [v.expert for v in views if v is not None] == ids
        st = store.statistics()
        assert (st.misses, st.hits, st.requests) == (len(ids), len(ids), 2 * len(ids))
        assert st.reads == 3 * len(ids)


@pytest.mark.parametrize("backend", ["io_uring", "io_uring_raw", "threads"])
async def test_reads_queued_beyond_the_depth_go_out_as_completions_make_room(
    backend: str, anyio_backend: object
) -> None:
    """A request of more reads than the queue depth: the rest are submitted at the end of the batch
    of completions that made room for them (the raw ring, the thread pool) or at the end of that
    loop tick (the liburing backend: ``flush_at_batch_end`` False), none stranded."""
    if not FIXTURES:
        pytest.skip("shared fixtures not found")
    path = FIXTURES[0]
    io = aioexperts.IOOptions(backend=backend, queue_depth=3)
    async with aioexperts.open(path, slots=8, io=io) as store:
        model, layout = store.model, store.layout
        layer, moe = next(iter(layout.layers.items()))
        ids = list(range(min(4, moe.n_experts)))
        with anyio.fail_after(20):
            async with store.experts(layer, ids) as views:
                for e, view in zip(ids, views, strict=True):
                    assert view is not None
                    assert bytes(view.down.data) == pread_segment(model, layout.locate(layer, e).down)
        st = store.statistics()
        assert st.reads >= 3 * len(ids) and st.submissions >= st.reads // 3  # at most 3 reads a submission


async def test_a_fake_backend_that_does_not_read_delivers_full_reads_and_leaves_slots(anyio_backend: object) -> None:
    """``FakeBackend(read=False)`` (``bench/read_cpu.py``'s ``store-null``): every read is counted as
    complete, nothing of the file reaches the slab, a ``fault`` still sets the result."""
    if not FIXTURES:
        pytest.skip("shared fixtures not found")
    path = FIXTURES[0]
    async with aioexperts.open(path, slots=4, io=aioexperts.IOOptions(backend=fake(read=False))) as store:
        model, layout = store.model, store.layout
        layer, moe = next(iter(layout.layers.items()))
        ids = list(range(min(2, moe.n_experts)))
        with anyio.fail_after(20):
            async with store.experts(layer, ids) as views:
                for e, view in zip(ids, views, strict=True):
                    seg = layout.locate(layer, e).gate
                    assert any(pread_segment(model, seg))  # the file holds bytes the slab does not
                    assert not any(bytes(view.gate.data)), "a fake backend with read=False read the file"
        st = store.statistics()
        assert st.misses == len(ids) and st.bytes_read >= st.payload_bytes > 0  # the aligned reads, all "read"
        assert st.backend_features["read"] is False

    def short(op: object) -> int:
        return 0  # every read returns nothing: the load fails, as with a real backend

    backend = fake(read=False, fault=short)
    async with aioexperts.open(path, slots=4, io=aioexperts.IOOptions(backend=backend)) as store:
        layer = next(iter(store.layout.layers))
        with anyio.fail_after(20), pytest.raises(aioexperts.ExpertReadError):
            async with store.experts(layer, [0]):
                pass
