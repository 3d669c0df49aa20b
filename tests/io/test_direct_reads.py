"""The direct-I/O read path: unaligned payloads, end-of-file short reads, O_DIRECT really used."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from faults.guard import CheckedRawUring, CheckedUring
from faults.ringproxy import RingFaults
from faults.script import FaultyFake, ReadFault
from ioutil import (
    F32,
    drop_cache,
    fd_flags_of,
    open_files,
    pread_segment,
    read_segments,
    resident_pages,
    write_shifted_moe,
)

import aioexperts
from aioexperts._cache.scheduler import Load, Priority, ReadScheduler
from aioexperts._cache.stats import Counters
from aioexperts._format.layout import ExpertLocation, Segment
from aioexperts._io.loop import current_loop
from aioexperts._io.plan import plan_expert
from aioexperts._io.slab import Slab

pytestmark = pytest.mark.anyio
BACKENDS = ["io_uring", "threads"]


@pytest.fixture
def data_file(direct_tmp_path: Path) -> Path:
    path = direct_tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * 1024))
    return path


@pytest.mark.parametrize("backend", BACKENDS)
async def test_read_4097_bytes_at_offset_10_through_the_direct_path(data_file: Path, backend: str) -> None:
    want = data_file.read_bytes()
    segments = [(0, 10, 4097), (0, 20000, 1), (0, 40000 + 3, 5000)]
    got, counters, files = await read_segments([data_file], segments, backend=backend, direct=True)
    assert files.direct_io
    assert got[0] == want[10 : 10 + 4097]
    assert got[1] == want[20000:20001]
    assert got[2] == want[40003:45003]
    assert counters.read_retries == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_short_read_ending_exactly_at_eof_is_accepted(direct_tmp_path: Path, backend: str) -> None:
    path = direct_tmp_path / "small.bin"
    path.write_bytes(os.urandom(4864))
    want = path.read_bytes()
    # alignment 4096: the read of [4096, 8192) comes back with the 768 bytes left in the file
    got, counters, _ = await read_segments(
        [path], [(0, 4096, 768), (0, 0, 10), (0, 100, 10)], backend=backend, direct=True, alignment=4096
    )
    assert got[0] == want[4096:4864]
    assert counters.bytes_read == 4096 + 768  # the merged read of [0, 4096) and the short one
    assert counters.read_retries == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_payload_past_the_end_of_the_file_is_an_error(direct_tmp_path: Path, backend: str) -> None:
    path = direct_tmp_path / "small.bin"
    path.write_bytes(os.urandom(4864))
    with pytest.raises(aioexperts.ExpertReadError, match="file ends at byte 4864"):
        await read_segments([path], [(0, 4096, 1000), (0, 0, 10), (0, 100, 10)], backend=backend, direct=True)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_expert_1152_bytes_past_a_page_boundary_reads_right_with_direct_io(
    direct_tmp_path: Path, backend: str
) -> None:
    path = write_shifted_moe(direct_tmp_path / "shifted.gguf", target_mod=1152)
    model = aioexperts.open_model(path)
    loc = aioexperts.build_layout(model).locate(0, 1)
    assert model.tensor("blk.0.ffn_gate_exps.weight").data_offset % 4096 == 1152
    async with aioexperts.open(path, slots=2, io=aioexperts.IOOptions(backend=backend)) as store:
        drop_cache(path)  # parsing the header may have read ahead into the experts
        assert resident_pages(path, loc.gate.offset, loc.gate.n_bytes) == 0
        assert store.statistics().direct_io
        flags = fd_flags_of(path)
        assert flags and all(f & os.O_DIRECT for f in flags)  # every descriptor of the model is direct
        async with store.experts(0, [0, 1]) as views:
            got = {
                view.expert: [bytes(p.data) for p in (view.gate, view.up, view.down)]
                for view in views
                if view is not None
            }
        # the reads bypassed the page cache: none of the experts' pages became resident
        for e in (0, 1):
            for seg in store.layout.locate(0, e).segments:
                assert resident_pages(path, seg.offset, seg.n_bytes) == 0
    for e in (0, 1):
        want = [pread_segment(model, seg) for seg in model_layout(model).locate(0, e).segments]
        assert got[e] == want


def model_layout(model: aioexperts.GGUFModel) -> aioexperts.ExpertLayout:
    return aioexperts.build_layout(model)


# -- a short direct read continues at the kernel's alignment, not the plan's -----------------------


async def _read_with_a_short_answer(data_file: Path, backend_kind: str) -> tuple[list[tuple[int, int, int]], bytes]:
    """Plan an expert whose middle read is 4096 bytes at 8192 (plan alignment 4096, kernel rule
    512); that read first comes back with 2048 bytes. Returns every read taken, as
    ``(file_offset, n_bytes, slot_offset)``, and the payload of the middle segment."""
    files = open_files([data_file], direct=True, alignment=4096)
    files.dio_alignment = 512  # what statx reports on this machine's ext4
    segs = [Segment(0, off, n, F32, (1, n)) for off, n in ((0, 10), (8192, 4096), (40000, 10))]
    plan = plan_expert(ExpertLocation(0, 0, 0, 0, *segs), files.alignment)
    assert [(r.file_offset, r.n_bytes, r.slot_offset) for r in plan.reads] == [
        (0, 4096, 0),
        (8192, 4096, 4096),
        (36864, 4096, 8192),
    ]
    slab = Slab(1, plan.slot_bytes)
    loop = current_loop()
    fault = ReadFault("half", at="middle")  # half of 4096: 2048
    ring = RingFaults()
    with ring.installed():
        backend: CheckedUring | CheckedRawUring | FaultyFake
        if backend_kind == "io_uring":
            backend = CheckedUring(files, slab, loop, 8)
            ring.watch(backend)
            ring.rewrite = ring.read_fault(fault)
        elif backend_kind == "io_uring_raw":
            backend = CheckedRawUring(files, slab, loop, 8)
            _halve_the_first_read_at(backend, 8192, fault)
        else:
            backend = FaultyFake(files, slab, loop, 8, read_fault=fault)
        backend.attach()
        scheduler = ReadScheduler(backend, loop, Counters(), files.sizes, files.dio_alignment, 1 << 30)
        done = anyio.Event()
        load = Load(plan, 0, Priority.DEMAND, lambda _load: done.set())
        try:
            scheduler.enqueue(load)
            with anyio.fail_after(10):
                await done.wait()
            assert load.error is None and fault.hits == 1 and backend.violations == [] and ring.violations == []
            payload = bytes(slab.view(0, plan.payload_offsets[1], 4096))
        finally:
            with anyio.CancelScope(shield=True):
                await scheduler.wait_idle()
            backend.close()
            files.close()
            slab.close()
    taken = [(op.file_offset, op.n_bytes, op.slot_offset) for batch in backend.submitted for op in batch]
    return taken, payload


def _halve_the_first_read_at(backend: CheckedRawUring, file_offset: int, fault: ReadFault) -> None:
    """Make the raw ring's first completion of the read at ``file_offset`` report half its bytes."""
    ring, reap = backend.ring, backend.ring.reap

    def reap_with_a_short_read() -> tuple[list[int], list[int]]:
        users, results = reap()
        for i, user_data in enumerate(users):
            op = backend._ops.get(user_data)
            if op is not None and op.file_offset == file_offset and not fault.hits and results[i] == op.n_bytes:
                results[i] //= 2
                fault.hits += 1
        return users, results

    ring.reap = reap_with_a_short_read  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "backend", [pytest.param("io_uring", marks=pytest.mark.liburing, id="liburing"), "io_uring_raw", "fake"]
)
async def test_a_short_direct_read_continues_at_the_kernels_alignment(data_file: Path, backend: str) -> None:
    taken, payload = await _read_with_a_short_answer(data_file, backend)
    # 2048 bytes of the 4096-byte read at 8192 arrived: the rest is read at 10240 for 2048 bytes,
    # landing 2048 bytes further into the slot, not the whole window again
    assert taken == [(0, 4096, 0), (8192, 4096, 4096), (36864, 4096, 8192), (10240, 2048, 6144)]
    assert payload == data_file.read_bytes()[8192 : 8192 + 4096]
