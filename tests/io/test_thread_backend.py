"""The thread-pool backend's own workers: a read thread that cannot start fails the reads (not the
store), and closing the store ends every worker."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

import aioexperts
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
