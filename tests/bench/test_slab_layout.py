"""bench/slab_layout.py: each layout it names is the slab the store then builds (issue 36, item 4)."""

from __future__ import annotations

from types import ModuleType

import pytest
from benchkit import load_bench

from aioexperts._io.slab import HUGE_PAGE_SIZE
from aioexperts._sources import stack


@pytest.fixture(scope="module")
def slab_layout() -> ModuleType:
    return load_bench("slab_layout")


@pytest.mark.parametrize(
    ("layout", "thp", "stride"),
    [("4k", False, 3 << 19), ("thp", True, 3 << 19), ("2mib-slots", True, HUGE_PAGE_SIZE)],
)
def test_each_layout_is_the_slab_the_store_builds(
    slab_layout: ModuleType, monkeypatch: pytest.MonkeyPatch, layout: str, thp: bool, stride: int
) -> None:
    monkeypatch.setattr(stack, "Slab", stack.Slab)  # put back after the test
    slab_layout.use_layout(layout)
    built = stack.ReadStack().build_slab(4, 3 << 19)  # 1.5 MiB slots, 6 MiB in all
    try:
        assert (built.thp, built.slot_bytes) == (thp, stride)
        assert (built.address % HUGE_PAGE_SIZE == 0) or not thp
    finally:
        built.close()
