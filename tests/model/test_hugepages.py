"""Resident dense weights on transparent huge pages (``huge_empty``), read in place
(``GGUFModel.read_tensor_into``): aligned, advised, read-only once loaded, and the same bytes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from aioexperts._errors import FormatError
from aioexperts._format.model import open_model
from aioexperts._io.slab import HUGE_PAGE_SIZE
from aioexperts._model.hugepages import MIN_BYTES, huge_empty
from aioexperts._model.weights import DenseMatrix, TensorReader, stack_rows

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_advisable() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def smaps_kib(address: int, field: str = "AnonHugePages") -> int:
    """``field`` (KiB) of ``/proc/self/smaps`` for the mapping of this process that holds ``address``."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(v, 16) for v in block.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            m = re.search(rf"^{field}:\s+(\d+) kB", block, re.M)
            return int(m[1]) if m else 0
    raise AssertionError(f"no mapping holds {address:#x}")


def anon_huge_kib(address: int) -> int:
    return smaps_kib(address)


def test_a_large_buffer_starts_on_a_huge_page_and_gets_huge_pages() -> None:
    if not thp_advisable():
        pytest.skip("transparent huge pages are off on this kernel")
    buf = huge_empty(3 * HUGE_PAGE_SIZE + 123)
    assert buf.dtype == np.uint8 and buf.shape == (3 * HUGE_PAGE_SIZE + 123,) and buf.flags.writeable
    assert buf.ctypes.data % HUGE_PAGE_SIZE == 0
    buf[:] = 7  # fault the pages in
    assert (buf == 7).all()
    assert anon_huge_kib(buf.ctypes.data) == 3 * HUGE_PAGE_SIZE // 1024  # the whole huge pages
    # the part page past them stays small: the buffer takes its own size, not a fourth huge page
    assert smaps_kib(buf.ctypes.data, "Rss") <= (3 * HUGE_PAGE_SIZE + 4096) // 1024


def test_a_small_buffer_is_plain_numpy_memory() -> None:
    buf = huge_empty(MIN_BYTES - 1)
    assert buf.shape == (MIN_BYTES - 1,) and buf.flags.writeable and buf.flags.owndata


def test_the_buffer_outlives_its_mapping_s_other_references() -> None:
    view = huge_empty(2 * HUGE_PAGE_SIZE)[HUGE_PAGE_SIZE:]
    view[:] = 3
    del view  # the mapping is freed with its last view: nothing to assert but no crash on reuse
    again = huge_empty(2 * HUGE_PAGE_SIZE)
    again[-1] = 1
    assert again[-1] == 1


def test_read_into_gives_the_tensor_s_bytes_and_refuses_a_wrong_buffer(small_model: Path) -> None:
    model = open_model(small_model)
    name = next(n for n, t in model.tensors.items() if t.n_bytes >= 1024)
    want = model.read_tensor_bytes(name)
    out = huge_empty(len(want))
    model.read_tensor_into(name, out)
    assert out.tobytes() == want
    with pytest.raises(ValueError, match="writable buffer of"):
        model.read_tensor_into(name, np.empty(len(want) + 1, np.uint8))
    frozen = np.empty(len(want), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable buffer of"):
        model.read_tensor_into(name, frozen)


def test_read_into_refuses_a_file_cut_short_after_open(small_model: Path) -> None:
    model = open_model(small_model)
    last = max(model.tensors.values(), key=lambda t: t.data_offset)
    with open(small_model, "r+b") as f:
        f.truncate(last.data_offset + 1)
    with pytest.raises(FormatError):
        model.read_tensor_into(last.name, np.empty(last.n_bytes, np.uint8))


def test_matrices_read_and_stacked_are_read_only_and_on_huge_pages(small_model: Path) -> None:
    if not thp_advisable():
        pytest.skip("transparent huge pages are off on this kernel")
    model = open_model(small_model)
    reader = TensorReader(model)
    name = next(n for n, t in model.tensors.items() if len(t.shape) == 2)
    m = reader.matrix(name)
    assert not m.raw.flags.writeable
    assert m.raw.tobytes() == model.read_tensor_bytes(name)
    # three large matrices stacked: one buffer on huge pages, still read-only
    rows, cols = 2048, 1024
    big = [
        DenseMatrix(f"w{i}", np.full(rows * cols, i, np.uint8), GGMLQuantizationType.I8, (rows, cols)) for i in range(3)
    ]
    stacked, views = stack_rows("w", big) or pytest.fail("same type and width: stacked")
    assert not stacked.raw.flags.writeable
    assert stacked.raw.ctypes.data % HUGE_PAGE_SIZE == 0
    assert anon_huge_kib(stacked.raw.ctypes.data) >= HUGE_PAGE_SIZE // 1024
    for i, v in enumerate(views):
        assert (v.raw == i).all()
