"""The alignment rule: widening, and the statx probe on real file systems."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioexperts._io.align import align_down, align_up, probe_alignment, widen


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
