"""io_uring set-up faults: no probe (Linux 5.1-5.5), refused registration, anything else the wrapper raises."""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from faults.ringproxy import RingFaults
from faults.stack import open_fds

import aioexperts
from aioexperts._cache.scheduler import Load, Priority, ReadScheduler
from aioexperts._cache.stats import Counters
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._io.backends.base import IOBackend
from aioexperts._io.backends.uring import UringBackend
from aioexperts._io.files import ShardFiles, open_shards
from aioexperts._io.loop import current_loop
from aioexperts._io.plan import max_plan_bytes, plan_expert
from aioexperts._io.select import create_backend
from aioexperts._io.slab import Slab
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    return path


@pytest.fixture
def ring() -> Iterator[RingFaults]:
    faults = RingFaults()
    with faults.installed():
        yield faults


async def read_expert(backend: IOBackend, files: ShardFiles, slab: Slab, model_path: Path) -> None:
    """Read expert (0, 1) into slot 0 through the scheduler and compare with a plain pread."""
    model = open_model(model_path)
    plan = plan_expert(build_layout(model).locate(0, 1), files.alignment)
    scheduler = ReadScheduler(backend, current_loop(), Counters(), files.sizes, files.dio_alignment, 1 << 30)
    done = anyio.Event()
    load = Load(plan, 0, Priority.DEMAND, lambda _load: done.set())
    scheduler.enqueue(load)
    with anyio.fail_after(5):
        await done.wait()
    assert load.error is None
    data = model_path.read_bytes()
    for seg, off in zip(plan.location.segments, plan.payload_offsets, strict=True):
        assert bytes(slab.view(0, off, seg.n_bytes)) == data[seg.offset : seg.offset + seg.n_bytes]


def parts(model_path: Path) -> tuple[ShardFiles, Slab]:
    model = open_model(model_path)
    files = open_shards(model)
    return files, Slab(2, max_plan_bytes(build_layout(model), files.alignment))


@pytest.mark.parametrize(
    "fault",
    ["no probe (RuntimeError)", "no probe (OSError)", "registration ENOMEM", "registration RuntimeError"],
)
async def test_io_uring_without_probe_or_registration_reads_with_plain_readv(
    model_path: Path, ring: RingFaults, fault: str, anyio_backend: object
) -> None:
    if fault == "no probe (RuntimeError)":  # what the wrapper does on 5.1-5.5 kernels
        ring.probe_error = RuntimeError("io_uring_get_probe_ring failed")
    elif fault == "no probe (OSError)":
        ring.probe_error = OSError(errno.EINVAL, "Invalid argument")
    elif fault == "registration ENOMEM":
        ring.register_buffers_error = OSError(errno.ENOMEM, "Cannot allocate memory")
    else:
        ring.register_buffers_error = RuntimeError("registration failed")
    baseline = open_fds()
    files, slab = parts(model_path)
    backend, reason = create_backend("io_uring", files, slab, current_loop(), 8)
    try:
        assert isinstance(backend, UringBackend) and reason is None
        features = backend.features()
        assert features["fixed_buffers"] is False
        assert features["fixed_buffers_reason"] and ("probe" in fault) == ("probe" in features["fixed_buffers_reason"])
        await read_expert(backend, files, slab, model_path)
    finally:
        # as the store closes: detach on the loop, close off it (which waits for the batched
        # wake-ups' waiter thread to end and close its duplicates of the descriptors)
        backend.detach()
        await anyio.to_thread.run_sync(backend.close)
        files.close()
        slab.close()
    assert open_fds() == baseline


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("io_uring_register_eventfd", RuntimeError("unexpected wrapper error")),
        ("io_uring_queue_init", RuntimeError("the wrapper broke")),
        ("io_uring_register_eventfd", OSError(errno.EINVAL, "Invalid argument")),
    ],
    ids=["eventfd-RuntimeError", "init-RuntimeError", "eventfd-EINVAL"],
)
async def test_any_ring_set_up_failure_falls_back_or_is_reported(
    model_path: Path,
    ring: RingFaults,
    call: str,
    exc: Exception,
    anyio_backend: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    baseline = open_fds()
    files, slab = parts(model_path)
    try:
        ring.fail_call(call, exc)
        with pytest.raises(aioexperts.BackendUnavailableError, match="io_uring was requested") as info:
            create_backend("io_uring", files, slab, current_loop(), 8)
        assert info.value.__cause__ is exc
        assert open_fds() == baseline + len(files.fds)  # the failed ring left nothing open

        ring.fail_call(call, exc)
        caplog.set_level(logging.WARNING, logger="aioexperts")
        backend, reason = create_backend("auto", files, slab, current_loop(), 8)
        try:
            assert backend.name == "threads"
            assert reason is not None and (type(exc).__name__ in reason or "EINVAL" in reason)
            assert reason in caplog.text
            await read_expert(backend, files, slab, model_path)
        finally:
            backend.close()
    finally:
        files.close()
        slab.close()
    assert open_fds() == baseline
