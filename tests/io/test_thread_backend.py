"""The thread-pool backend's own workers: a read thread that cannot start fails the reads (not the
store), and closing the store ends every worker."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioexperts
from aioexperts._cache.scheduler import ReadScheduler
from aioexperts._io.backends import threads as threads_module
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("threads") / "m.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    return path


def read_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioexperts-read-")]


async def test_no_read_thread_fails_the_reads_then_the_store_recovers(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    before = set(read_threads())  # another store's workers, if any, are not this test's
    async with aioexperts.open(model_path, slots=4, io=aioexperts.IOOptions(backend="threads")) as store:

        def refuse(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        with monkeypatch.context() as patch:
            patch.setattr(threads_module.threading.Thread, "start", refuse)
            with pytest.raises(aioexperts.ExpertReadError, match="can't start new thread"):
                async with store.experts(0, [0]):
                    pass
        async with store.experts(0, [0, 1]) as views:  # the threads start now
            assert all(v is not None and len(v.gate.data) for v in views)
        ours = set(read_threads()) - before
        assert ours
    for _ in range(200):  # aclose queued one stop per worker
        if not any(t.is_alive() for t in ours):
            break
        await anyio.sleep(0.01)
    assert not any(t.is_alive() for t in ours)


async def test_a_wake_up_hands_its_completions_to_the_scheduler_in_one_call(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """The completions a wake-up of the loop drains reach the scheduler's batch sink in one call,
    not one sink call per read (the batch sink hands only the reads that are not full-length, such
    as one that ends at the end of the file, to the per-read sink), and the experts read are the file's bytes."""
    calls = {"batches": 0, "ops": 0, "single": 0}
    on_reads, on_read = ReadScheduler._on_reads, ReadScheduler._on_read

    def counting_on_reads(self: ReadScheduler, ops: list[Any], results: list[Any]) -> None:
        calls["batches"] += 1
        calls["ops"] += len(ops)
        on_reads(self, ops, results)

    def counting_on_read(self: ReadScheduler, op: Any, result: Any) -> None:
        calls["single"] += 1
        on_read(self, op, result)

    monkeypatch.setattr(ReadScheduler, "_on_reads", counting_on_reads)
    monkeypatch.setattr(ReadScheduler, "_on_read", counting_on_read)
    async with aioexperts.open(model_path, slots=4, io=aioexperts.IOOptions(backend="threads")) as store:
        async with store.experts(0, [0, 1, 2, 3]) as views:
            for view in views:
                assert view is not None
                for projection, name in ((view.gate, "gate"), (view.up, "up"), (view.down, "down")):
                    assert bytes(projection.data) == read_projection(store, view.layer, view.expert, name)
        reads = store.statistics().reads
    assert calls["ops"] == reads > 0  # every completion through the batch sink
    assert calls["single"] < reads
    assert 1 <= calls["batches"] <= reads


def read_projection(store: aioexperts.ExpertStore, layer: int, expert: int, name: str) -> bytes:
    """A projection's bytes read from the file with a plain pread."""
    loc = store.layout.locate(layer, expert)
    seg = getattr(loc, name)
    path = store.model.shards[seg.shard].path
    with open(path, "rb") as f:
        return os.pread(f.fileno(), seg.n_bytes, seg.offset)
