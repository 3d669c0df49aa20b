"""The speed region of docs/model.md is what bench/model_speed.py renders from the results file it names."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOC = REPO / "docs" / "model.md"


def _model_speed():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("model_speed", REPO / "bench" / "model_speed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _region(text: str, name: str = "model_speed") -> str:
    return text.split(f"<!-- bench:{name} -->", 1)[1].split(f"<!-- /bench:{name} -->", 1)[0]


@pytest.mark.parametrize("name", ["model_speed", "model_speed-xeon"])
def test_the_speed_region_is_rendered_from_its_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Fails when a region (one per CPU kind) was typed or edited by hand, or not rendered again after
    its results changed."""
    monkeypatch.chdir(REPO)  # the results file is named relative to the repository
    text = DOC.read_text()
    found = re.search(r"rendered by bench/model_speed.py --render (\S+) DOC(?: --region (\S+))?;", _region(text, name))
    assert found is not None, f"docs/model.md's region {name} names no results file"
    copy = tmp_path / "model.md"
    shutil.copy(DOC, copy)
    _model_speed().render(Path(found.group(1)), copy, found.group(2))
    assert _region(copy.read_text(), name) == _region(text, name)


def test_the_share_outside_the_kernels_is_judged_against_15_percent() -> None:
    """Issue 33: MoE's time beside kernels and waits, plus other, over the decode token."""
    speed = _model_speed()
    split = {"moe_ms": 80.0, "moe_expert_compute_ms": 60.0, "moe_io_wait_ms": 5.0, "other_ms": 2.0}
    assert speed.outside_kernels(split, 100.0) == pytest.approx(0.17)
    assert speed.outside_kernels(split, 100.0) > speed.OUTSIDE_KERNELS_MAX


def test_a_missed_target_is_rendered_as_missed() -> None:
    speed = _model_speed()
    assert speed.verdict("compute_io_ratio", 0.4) == "met"
    assert speed.verdict("compute_io_ratio", 0.6) == "MISSED"
    assert speed.verdict("prefill_over_decode", 5.0) == "met"
    assert speed.verdict("prefill_over_decode", 4.9) == "MISSED"
