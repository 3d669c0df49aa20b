"""Row reads: a few rows of a large 2-D tensor per call, through the row cache, on every type."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

import aioexperts
from aioexperts.testing import tiny_moe_writer

pytestmark = pytest.mark.anyio

Q = GGMLQuantizationType
TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
]  # fmt: skip
N_ROWS, N_COLS = 300, 256


QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


def _table_bytes(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """``(N_ROWS, row_bytes)`` uint8: float rows, gguf-quantized rows, or random blocks (any bytes are valid)."""
    values = rng.standard_normal((N_ROWS, N_COLS)).astype(np.float32)
    if qtype == Q.F32:
        return values.view(np.uint8)
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype in QUANTIZABLE:
        return np.asarray(gguf.quants.quantize(values, qtype)).reshape(N_ROWS, -1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (N_ROWS, N_COLS // block_size * type_size), dtype=np.uint8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MoE model plus one (300, 256) table per ggml type, named ``table.<TYPE>``."""
    path = tmp_path_factory.mktemp("rows") / "rows.gguf"
    rng = np.random.default_rng(0)
    w = tiny_moe_writer(path, rng)
    for qtype in TYPES:
        raw = _table_bytes(qtype, rng)
        w.add_tensor(f"table.{qtype.name}", raw, raw_shape=(N_ROWS, raw.shape[1]), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(path: Path, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The table's raw rows by a plain pread, ``(n_rows, row_bytes)`` uint8."""
    info = aioexperts.open_model(path).tensor(name)
    with open(path, "rb") as f:
        raw = os.pread(f.fileno(), info.n_bytes, info.data_offset)
    return np.frombuffer(raw, dtype=np.uint8).reshape(N_ROWS, -1), GGMLQuantizationType(info.ggml_type)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
async def test_rows_are_the_file_bytes_and_dequantize_like_gguf(
    model_path: Path, qtype: GGMLQuantizationType, anyio_backend: object
) -> None:
    name = f"table.{qtype.name}"
    raw, got_type = reference(model_path, name)
    assert got_type == qtype
    ids = [0, 299, 47, 48, 47, 150, 1]  # both ends, a window boundary, a duplicate
    async with aioexperts.open(model_path, slots=2) as store:
        async with store.rows(name, ids) as rows:
            assert rows.ggml_type == qtype and rows.n_cols == N_COLS and rows.row_ids == tuple(ids)
            assert [bytes(d) for d in rows.data] == [raw[i].tobytes() for i in ids]
            assert all(d.readonly for d in rows.data)
        values = await store.read_rows(name, ids)
        assert values.dtype == np.float32 and values.shape == (len(ids), N_COLS)
        with np.errstate(all="ignore"):
            want = np.asarray(gguf_dequantize(raw[ids], qtype), dtype=np.float32).reshape(len(ids), N_COLS)
        np.testing.assert_array_equal(values, want)  # bit for bit, NaN positions included
        raw_rows = await store.read_rows(name, ids, dequantize=False)
        np.testing.assert_array_equal(raw_rows, raw[ids])


async def test_rows_sharing_a_window_are_read_once_in_one_submission(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=2) as store:
        row_bytes = reference(model_path, "table.Q2_K")[0].shape[1]  # 84 bytes: 48 rows per 4 KiB window
        assert row_bytes == 84
        ids = list(range(48)) + [100, 101, 299]
        await store.read_rows("table.Q2_K", ids)
        st = store.row_statistics()
        # independently: a row wholly inside page p is read with page p (4 KiB); a row crossing
        # into page p + 1 with both pages (8 KiB)
        offset = aioexperts.open_model(model_path).tensor("table.Q2_K").data_offset
        reads = {}
        for r in ids:
            start, end = offset + r * 84, offset + r * 84 + 83
            reads[(start // 4096, end // 4096)] = 4096 * (1 + end // 4096 - start // 4096)
        assert st is not None and st.calls == 1 and st.rows == len(ids)
        assert st.windows == st.window_misses == len(reads) <= 8
        assert st.useful_bytes == len(ids) * row_bytes
        assert st.bytes_read == sum(reads.values())
        await store.read_rows("table.Q2_K", [5, 100])
        st2 = store.row_statistics()
        assert st2 is not None and st2.window_hits == 2 and st2.window_misses == len(reads)  # cached


async def test_bad_row_requests(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=2) as store:
        for tensor, ids, needle in (
            ("nope", [0], "no tensor 'nope'"),
            ("blk.0.ffn_gate_exps.weight", [0], "2-D tensors only"),
            ("table.F32", [300], "rows 0..299; row 300 does not exist"),
            ("table.F32", [-1], "row -1 does not exist"),
            ("table.F32", [1.0], "row ids must be ints"),
            ("table.F32", 7, "iterable"),
        ):
            with pytest.raises(aioexperts.InvalidRequestError, match=needle):
                await store.read_rows(tensor, ids)  # type: ignore[arg-type]
        cache = aioexperts.CacheOptions(slots=2, row_cache_bytes=1)  # 16 windows at least
    async with aioexperts.open(model_path, cache=cache) as store:
        with pytest.raises(aioexperts.SlabExhaustedError, match="span 20 windows"):
            await store.read_rows("table.F32", range(0, 300, 15))  # F32 rows of 1 KiB: 4 per window
        assert (await store.read_rows("table.F32", [3])).shape == (1, N_COLS)


async def test_rows_in_page_cache_mode(model_path: Path, anyio_backend: object) -> None:
    raw, _ = reference(model_path, "table.Q4_K")
    async with aioexperts.open(model_path, mode="pagecache") as store:
        async with store.rows("table.Q4_K", [7, 8]) as rows:
            assert [bytes(d) for d in rows.data] == [raw[7].tobytes(), raw[8].tobytes()]


async def test_concurrent_row_readers_and_close(model_path: Path, anyio_backend: object) -> None:
    raw, _ = reference(model_path, "table.Q8_0")
    async with aioexperts.open(model_path, slots=2) as store:
        got: list[bool] = []

        async def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                ids = rng.integers(0, N_ROWS, 12).tolist()
                got.append(bool(np.array_equal(await store.read_rows("table.Q8_0", ids, dequantize=False), raw[ids])))

        async with anyio.create_task_group() as tg:
            for seed in range(6):
                tg.start_soon(reader, seed)
    assert len(got) == 120 and all(got)


async def test_the_reads_of_one_call_go_out_in_one_submission(model_path: Path, anyio_backend: object) -> None:
    from aioexperts.testing import FakeBackend

    made: list[FakeBackend] = []

    def factory(files: object, slab: object, loop: object, depth: int) -> FakeBackend:
        made.append(FakeBackend(files, slab, loop, depth))  # type: ignore[arg-type]
        return made[-1]

    async with aioexperts.open(model_path, slots=2, io=aioexperts.IOOptions(backend=factory)) as store:
        await store.read_rows("table.Q6_K", [0, 40, 80, 120, 160, 200, 240])  # 210-byte rows: 19 per window
        rows_backend = made[-1]
        assert len(made) == 2 and rows_backend.batches == [7]  # seven windows, one submit


async def test_a_row_cache_too_large_to_map_names_its_option(model_path: Path, anyio_backend: object) -> None:
    cache = aioexperts.CacheOptions(slots=2, row_cache_bytes=1 << 62)
    async with aioexperts.open(model_path, cache=cache) as store:
        with pytest.raises(aioexperts.ConfigError, match="row_cache_bytes"):
            await store.read_rows("table.F32", [0])
        async with store.experts(0, [0]) as views:  # the store is still usable
            assert views[0] is not None


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
async def test_a_read_rows_cancelled_while_converting_keeps_its_rows_until_the_conversion_ends(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """A plain ``Task.cancel()`` (a ``wait_for`` timeout) while the worker thread converts the pinned
    rows: the rows stay pinned until the thread is done with them, then the cancellation is raised
    (the rows were unpinned under the thread: their slot could be read into again meanwhile)."""
    import asyncio
    import threading
    from contextlib import asynccontextmanager

    from aioexperts._sources.rows import RowsView

    events: list[str] = []
    started, go = threading.Event(), threading.Event()
    plain = RowsView.dequantize

    def slow(self: RowsView) -> np.ndarray:
        started.set()
        go.wait(10)
        events.append("converted")
        return plain(self)

    monkeypatch.setattr(RowsView, "dequantize", slow)
    async with aioexperts.open(model_path, slots=2) as store:
        rows_of = store.rows

        @asynccontextmanager
        async def rows(tensor: str, ids: object):  # type: ignore[no-untyped-def]
            try:
                async with rows_of(tensor, ids) as view:
                    yield view
            finally:
                events.append("released")

        monkeypatch.setattr(store, "rows", rows)
        task = asyncio.get_running_loop().create_task(store.read_rows("table.Q8_0", [1, 2]))
        await anyio.to_thread.run_sync(started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation is delivered while the thread still converts
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert events == ["converted", "released"]
