"""The page-cache mode's I/O pieces: range merging, read-only mappings, residency, warming."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from ioutil import drop_cache, resident_pages

from aioexperts._errors import ConfigError
from aioexperts._io.mapping import (
    MappedShards,
    ResidencyFacts,
    WarmRange,
    cachestat_verdict,
    merge_ranges,
    residency_facts,
    residency_trusted,
    warm_advice,
    warm_read,
)

PAGE = mmap.PAGESIZE
GAP = 64 << 10


def test_ranges_are_page_aligned_sorted_and_merged() -> None:
    sizes = [10 * GAP, 10 * GAP]
    got = merge_ranges(
        [
            (0, 5 * GAP + 10, 100),  # -> [5 GAP, 5 GAP + PAGE)
            (0, 10, 4097),  # -> [0, 2 PAGE)
            (1, 0, PAGE),
            (0, 2 * PAGE + GAP, 1),  # gap of exactly GAP after [0, 2 PAGE): merged
            (0, 3 * GAP, PAGE),  # gap above GAP: separate
            (0, 7, 0),  # empty: dropped
            (1, 10 * GAP - 100, 5000),  # clipped at the end of the file
        ],
        sizes,
    )
    assert got == [
        WarmRange(0, 0, 3 * PAGE + GAP),
        WarmRange(0, 3 * GAP, PAGE),
        WarmRange(0, 5 * GAP, PAGE),
        WarmRange(1, 0, PAGE),
        WarmRange(1, 10 * GAP - PAGE, PAGE),
    ]
    assert merge_ranges([(0, 0, PAGE), (0, 2 * PAGE + GAP, 1)], sizes, max_gap=GAP) == [
        WarmRange(0, 0, PAGE),  # the gap is GAP + 1 page
        WarmRange(0, 2 * PAGE + GAP, PAGE),
    ]
    assert merge_ranges([(0, 0, PAGE), (0, 5 * PAGE, PAGE)], sizes, max_gap=0) == [
        WarmRange(0, 0, PAGE),
        WarmRange(0, 5 * PAGE, PAGE),
    ]
    with pytest.raises(ConfigError, match="max_gap"):
        merge_ranges([], sizes, max_gap=-1)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 1024 * PAGE + 123, dtype=np.uint8).tobytes())
    return path


def test_views_are_the_file_bytes_and_outlive_close(data_file: Path) -> None:
    want = data_file.read_bytes()
    fd = os.open(data_file, os.O_RDONLY)
    try:
        shards = MappedShards([fd], [len(want)])
    finally:
        os.close(fd)  # the mapping does not need the descriptor
    view = shards.view(0, 1000, 9000)
    assert view.readonly and bytes(view) == want[1000:10000]
    tail = shards.view(0, len(want) - 123, 123)
    array = np.frombuffer(tail, dtype=np.uint8)
    tail.release()
    assert shards.views_alive >= 1
    shards.close()
    assert bytes(view) == want[1000:10000]  # still mapped: a view of it lives
    assert array.tobytes() == want[-123:]
    with pytest.raises(ValueError, match="closed"):
        shards.view(0, 0, 1)
    with pytest.raises(IndexError):
        MappedShards([], []).view(0, 0, 1)


def test_out_of_range_views_are_refused(data_file: Path) -> None:
    fd = os.open(data_file, os.O_RDONLY)
    try:
        shards = MappedShards([fd], [os.fstat(fd).st_size])
        size = shards.sizes[0]
        for offset, n in ((-1, 1), (size - 1, 2), (0, size + 1)):
            with pytest.raises(IndexError, match="outside"):
                shards.view(0, offset, n)
        shards.close()
    finally:
        os.close(fd)


def test_residency_follows_drops_and_warming(data_file: Path) -> None:
    size = data_file.stat().st_size
    fd = os.open(data_file, os.O_RDONLY)
    try:
        shards = MappedShards([fd], [size])
        drop_cache(data_file)
        if resident_pages(data_file, 0, size) != 0:
            pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
        assert shards.residency(0, 0, size) == (0, 1025)
        scratch = memoryview(bytearray(3 * PAGE))
        assert warm_read(fd, 8 * PAGE, 10 * PAGE + 5, scratch) == 10 * PAGE + 5
        resident, total = shards.residency(0, 8 * PAGE, 10 * PAGE + 5)
        assert (resident, total) == (11, 11) == (resident_pages(data_file, 8 * PAGE, 10 * PAGE + 5), 11)
        assert shards.residency(0, 900 * PAGE, PAGE) == (0, 1)  # far past the warming and its readahead
        assert warm_read(fd, size - 10, 100, scratch) == 10  # end of file
        assert warm_advice(fd, 40 * PAGE, 4 * PAGE) == 4 * PAGE
        shards.close()
    finally:
        os.close(fd)


# -- whether mincore can be believed (issue 24) ------------------------------------------------


def _facts(**changes: object) -> ResidencyFacts:
    """A service user (uid 1000) reading a file owned by root, which it may not write: Linux 5.0+'s
    mincore then reports every page resident."""
    base: dict[str, object] = {
        "owner_uid": 0,
        "euid": 1000,
        "may_write": False,
        "cap_fowner": False,
        "cachestat": "unavailable",
    }
    return ResidencyFacts(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "trusted"),
    [
        ({}, False),  # the common deployment: root's model, a service user
        ({"owner_uid": 1000}, True),  # the owner
        ({"may_write": True}, True),  # write access
        ({"cap_fowner": True}, True),  # CAP_FOWNER (root)
        ({"cachestat": "refused"}, False),  # the kernel says it will not tell
        ({"cachestat": "refused", "owner_uid": 1000}, False),  # ... and its verdict wins
        ({"cachestat": "ok"}, True),
    ],
)
def test_residency_is_trusted_only_where_the_kernel_tells_the_truth(changes: dict[str, object], trusted: bool) -> None:
    assert residency_trusted(_facts(**changes)) is trusted


def test_residency_facts_of_a_file_owned_by_another_user(data_file: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(data_file, 12345, 12345)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        facts = residency_facts(fd, str(data_file))
    finally:
        os.close(fd)
    assert facts.owner_uid == 12345 and facts.euid == 0
    assert facts.may_write and facts.cap_fowner  # root may write anything and has CAP_FOWNER
    assert facts.cachestat in ("ok", "unavailable")  # root is never refused
    assert residency_trusted(facts)


@pytest.mark.parametrize(
    ("result", "err", "verdict"),
    [(0, 0, "ok"), (-1, errno.EPERM, "refused"), (-1, errno.ENOSYS, "unavailable"), (-1, errno.EBADF, "unavailable")],
)
def test_the_cachestat_verdict(monkeypatch: pytest.MonkeyPatch, result: int, err: int, verdict: str) -> None:
    from aioexperts._io import mapping

    class FakeLibc:
        @staticmethod
        def syscall(number: ctypes.c_long, *args: object) -> int:
            assert number.value == 451
            ctypes.set_errno(err)
            return result

    monkeypatch.setattr(mapping, "_libc", FakeLibc())
    assert cachestat_verdict(0) == verdict
