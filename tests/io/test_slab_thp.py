"""The slab on transparent huge pages: a 2 MiB-aligned start, ``MADV_HUGEPAGE`` before the pre-fault,
and every access path (reads of each backend, views, writable views) on the same bytes.

Issue 36: a direct read into 4 KiB pages is one DMA segment per page, walked and split by the block
layer; into huge pages it is a few. The slab keeps its slots where they were relative to its start,
so only the start moves: these tests guard that every path adds the same start.
"""

from __future__ import annotations

import ctypes
import os
import random
from pathlib import Path

import anyio
import pytest
from ioutil import open_files

from aioexperts._io.backends.base import ReadOp, ReadResult
from aioexperts._io.loop import current_loop
from aioexperts._io.select import create_backend
from aioexperts._io.slab import HUGE_PAGE_SIZE, THP_MIN_BYTES, Slab

MIB = 1 << 20
SLOT_BYTES = 3 * MIB // 2  # not a multiple of 2 MiB: slots straddle huge pages
N_SLOTS = 6
FILE_BYTES = 8 * MIB


def _thp_mode() -> str | None:
    """The bracketed mode of ``/sys/kernel/mm/transparent_hugepage/enabled``, or None without THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _anon_huge_bytes(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address`` (bytes)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_large_slab_starts_on_a_huge_page_boundary_and_a_small_one_is_left_alone() -> None:
    """At least THP_MIN_BYTES: laid out for huge pages (2 MiB-aligned start); smaller, or with
    ``thp=False``: a plain page-aligned mapping of exactly the slab's bytes."""
    large = Slab(N_SLOTS, SLOT_BYTES)
    small = Slab(2, 64 * 1024)
    plain = Slab(N_SLOTS, SLOT_BYTES, thp=False)
    try:
        assert large.n_bytes >= THP_MIN_BYTES and large.thp
        assert large.address % HUGE_PAGE_SIZE == 0
        assert 0 <= large._offset < HUGE_PAGE_SIZE  # the start moved inside the mapping, by less than 2 MiB
        assert large.slot_bytes == SLOT_BYTES  # the slots keep their size: only the start moves
        assert not small.thp and not plain.thp
        assert plain.slot_bytes == SLOT_BYTES and plain.n_bytes == N_SLOTS * SLOT_BYTES
    finally:
        for slab in (large, small, plain):
            slab.close()


@pytest.mark.parametrize("thp", [True, False])
def test_every_access_path_reaches_the_same_bytes(thp: bool) -> None:
    """Bytes written through the writable view (the thread pool's reads) are what the raw buffer
    (the rings' reads), the exporter views and the shared views show, at the slot's address."""
    slab = Slab(N_SLOTS, SLOT_BYTES, thp=thp)
    try:
        assert slab.thp is thp
        if thp and not slab._offset:  # the paths would agree even if one forgot the start: not a test
            pytest.skip("the kernel put the mapping on a 2 MiB boundary itself")
        for slot in (0, 3, N_SLOTS - 1):
            start, n = 4096 * (slot + 1), 8192
            pattern = bytes(random.Random(slot).randrange(256) for _ in range(n))
            view = slab.writable_view(slot, start, n)
            view[:] = pattern
            view.release()
            raw = slab.raw_buffer(slot, start, n)
            assert bytes(raw) == pattern
            assert ctypes.addressof(ctypes.c_char.from_buffer(raw)) == slab.address + slot * slab.slot_bytes + start
            assert bytes(slab.view(slot, start, n)) == pattern
            assert bytes(slab.shared_views(slot, ((start, n),))[0]) == pattern
    finally:
        slab.close()


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="transparent huge pages are off on this kernel")
def test_the_slab_is_on_huge_pages() -> None:
    """Advised before the pre-fault, the slab's memory comes in huge pages (checked in smaps);
    without the advice (``thp=False``) this kernel's ``madvise`` mode gives it none."""
    slab = Slab(N_SLOTS, SLOT_BYTES)
    try:
        assert _anon_huge_bytes(slab.address) >= 2 * HUGE_PAGE_SIZE
    finally:
        slab.close()
    if _thp_mode() == "madvise":
        plain = Slab(N_SLOTS, SLOT_BYTES, thp=False)
        try:
            assert _anon_huge_bytes(plain.address) == 0
        finally:
            plain.close()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["io_uring", "io_uring_raw", "threads"])
async def test_direct_reads_into_a_huge_page_slab_equal_pread(direct_tmp_path: Path, backend: str) -> None:
    """Reads of 1 MiB and more that cross huge-page boundaries of the slab, through each backend
    (registered buffers on the rings), land where the slab's views show them."""
    path = direct_tmp_path / "data.bin"
    data = os.urandom(FILE_BYTES)
    path.write_bytes(data)
    files = open_files([path], direct=True)
    slab = Slab(N_SLOTS, SLOT_BYTES)
    assert slab.thp
    built, _ = create_backend(backend, files, slab, current_loop(), 8, attach=True)
    results: dict[int, ReadResult] = {}

    def sink(op: ReadOp, result: ReadResult) -> None:
        results[id(op)] = result

    built.set_sink(sink)
    rng = random.Random(36)
    ops = []
    for slot in range(N_SLOTS):
        slot_offset = rng.choice((0, 256 * 1024, 512 * 1024))
        n = rng.choice((MIB, MIB - 64 * 1024, 5 * MIB // 4))
        n = min(n, SLOT_BYTES - slot_offset)
        ops.append(ReadOp(0, rng.randrange(0, (FILE_BYTES - n) // 4096) * 4096, n, slot, slot_offset))
    try:
        built.submit(ops)
        with anyio.fail_after(10):
            while len(results) < len(ops):
                await anyio.sleep(0.001)
        for op in ops:
            assert results[id(op)] == op.n_bytes
            got = bytes(slab.view(op.slot, op.slot_offset, op.n_bytes))
            assert got == data[op.file_offset : op.file_offset + op.n_bytes], op
    finally:
        built.detach()
        await anyio.to_thread.run_sync(built.close)
        slab.close()
        files.close()
