"""bench/slab_layout.py: each layout it names is the slab the store then builds (issue 36, item 4)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aioexperts._io.slab import HUGE_PAGE_SIZE
from aioexperts._sources import stack

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def slab_layout() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its sibling modules _results and read_cpu
    try:
        spec = importlib.util.spec_from_file_location("slab_layout", BENCH / "slab_layout.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


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
