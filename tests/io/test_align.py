"""The alignment rule: widening, and the statx probe on real file systems."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

import aioexperts
from aioexperts._format.layout import ExpertLocation, Segment
from aioexperts._io import align, files
from aioexperts._io.align import align_down, align_up, probe_alignment, widen
from aioexperts._io.files import open_shards
from aioexperts._io.plan import plan_expert


@given(
    offset=st.integers(0, 1 << 40),
    n_bytes=st.integers(0, 1 << 24),
    shift=st.integers(0, 13),
)
def test_widen_covers_the_range_with_aligned_bounds(offset: int, n_bytes: int, shift: int) -> None:
    a = 1 << shift
    start, length, payload = widen(offset, n_bytes, a)
    assert start % a == 0 and length % a == 0
    assert start <= offset and offset + n_bytes <= start + length
    assert payload == offset - start < a
    assert length - n_bytes - payload < a  # never a whole extra block


def test_widen_examples() -> None:
    assert widen(10, 4097, 4096) == (0, 8192, 10)
    assert widen(4096 + 1152, 100, 4096) == (4096, 4096, 1152)
    assert widen(8192, 4096, 4096) == (8192, 4096, 0)
    assert align_down(4097, 512) == 4096 and align_up(4097, 512) == 4608


def test_probe_on_this_checkout_reports_direct_io(direct_tmp_path: Path) -> None:
    path = direct_tmp_path / "f.bin"
    path.write_bytes(b"x" * 10000)
    a = probe_alignment(path)
    assert a.direct_io_supported
    assert a.unit & (a.unit - 1) == 0 and 1 <= a.unit <= 65536


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_probe_on_tmpfs_reports_no_real_direct_io() -> None:
    path = Path("/dev/shm") / f"aioexperts-test-{os.getpid()}"
    path.write_bytes(b"x" * 100)
    try:
        assert not probe_alignment(path).direct_io_supported
    finally:
        path.unlink()


def test_probe_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        probe_alignment(tmp_path / "missing")


# -- direct I/O on kernels without STATX_DIOALIGN, tmpfs, probe reads that fail ------------------

STATX_BASIC_STATS = 0x7FF


def _old_kernel_statx(dirfd: int, path: bytes, flags: int, mask: int, buf: ctypes.Array[ctypes.c_char]) -> int:
    """``statx`` as Linux < 6.1 answers it: the basic fields, never the STATX_DIOALIGN bit."""
    ctypes.memset(buf, 0, ctypes.sizeof(buf))
    raw = struct.pack("<I", STATX_BASIC_STATS)
    ctypes.memmove(buf, raw, len(raw))
    return 0


@pytest.fixture
def old_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(align, "_STATX", _old_kernel_statx)


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_a_kernel_without_statx_dioalign_still_gets_direct_io(small_model: Path, old_kernel: None) -> None:
    a = probe_alignment(small_model)
    assert (a.direct_io_supported, a.source, a.unit, a.reason) == (True, "default", 4096, None)
    shards = open_shards(aioexperts.open_model(small_model))
    try:
        assert shards.direct_io and shards.buffered_reason is None
        assert (shards.alignment, shards.dio_alignment) == (4096, 4096)
        assert all(_is_direct(fd) for fd in shards.fds)
    finally:
        shards.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("kernel", ["this kernel", "a kernel before 6.1"])
def test_tmpfs_is_recognised_by_its_file_system_type(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    if kernel != "this kernel":
        monkeypatch.setattr(align, "_STATX", _old_kernel_statx)
    path = Path("/dev/shm") / f"aioexperts-align-{os.getpid()}.gguf"
    path.write_bytes(small_model.read_bytes())
    try:
        assert align.filesystem_type(path) == align.TMPFS_MAGIC
        a = probe_alignment(path)
        assert not a.direct_io_supported
        assert a.reason is not None and "tmpfs" in a.reason and "f_type" in a.reason
        shards = open_shards(aioexperts.open_model(path))
        try:
            assert not shards.direct_io and not any(_is_direct(fd) for fd in shards.fds)
            assert shards.buffered_reason == a.reason
        finally:
            shards.close()
    finally:
        path.unlink()


@pytest.mark.parametrize("err", [errno.EIO, errno.EINVAL, errno.ENOMEM], ids=["EIO", "EINVAL", "ENOMEM"])
def test_a_failing_probe_read_falls_back_and_names_the_error(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    def failing_probe(fd: int, unit: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files, "_probe_read", failing_probe)
    baseline = len(os.listdir("/proc/self/fd"))
    model = aioexperts.open_model(small_model)
    shards = open_shards(model)
    try:
        assert not shards.direct_io
        assert shards.buffered_reason is not None and errno.errorcode[err] in shards.buffered_reason
    finally:
        shards.close()
    with pytest.raises(aioexperts.BackendUnavailableError, match=errno.errorcode[err]):
        open_shards(model, direct_io=True)
    assert len(os.listdir("/proc/self/fd")) == baseline  # the O_DIRECT descriptor was closed


def test_statx_missing_from_the_kernel_is_an_old_kernel(small_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def enosys(*args: object) -> int:
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(align, "_STATX", enosys)
    a = probe_alignment(small_model)
    assert (a.direct_io_supported, a.source, a.unit) == (True, "default", 4096)


def _location(sizes: tuple[int, int, int], offsets: tuple[int, int, int]) -> ExpertLocation:
    segs = [Segment(0, off, n, GGMLQuantizationType.F32, (1, n // 4)) for off, n in zip(offsets, sizes, strict=True)]
    return ExpertLocation(0, 0, 0, 0, *segs)


def test_split_plans_cut_long_runs_into_aligned_chunks() -> None:
    mib = 1 << 20
    loc = _location((4 * mib, 4 * mib, 4 * mib + 100), (1000, 1000 + 4 * mib, 1000 + 8 * mib))  # one 12 MiB run
    whole = plan_expert(loc, 4096)
    assert len(whole.reads) == 1
    split = plan_expert(loc, 4096, split_bytes=mib)
    assert split.slot_bytes == whole.slot_bytes and split.payload_offsets == whole.payload_offsets
    assert len(split.reads) == 13 and all(r.n_bytes == mib for r in split.reads[:-1])
    ends = [(r.file_offset, r.file_offset + r.n_bytes) for r in split.reads]
    assert (
        ends[0][0] == whole.reads[0].file_offset and ends[-1][1] == whole.reads[0].file_offset + whole.reads[0].n_bytes
    )
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # contiguous, no overlap
    for r in split.reads:
        assert r.file_offset % 4096 == r.n_bytes % 4096 == r.slot_offset % 4096 == 0
        assert r.slot_offset == r.file_offset - whole.reads[0].file_offset
    payload_end = 1000 + 12 * mib + 100
    assert [r.needed for r in split.reads] == [min(r.n_bytes, payload_end - r.file_offset) for r in split.reads]
    assert split.reads[-1].needed < split.reads[-1].n_bytes  # the tail: payload, then padding
    assert len(plan_expert(loc, 4096, split_bytes=mib, max_reads=5).reads) <= 5  # chunks grow to fit the depth
    assert plan_expert(loc, 4096, split_bytes=16 * mib).reads == whole.reads  # nothing longer than a chunk
