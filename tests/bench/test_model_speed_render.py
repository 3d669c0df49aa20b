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


def _region(text: str) -> str:
    return text.split("<!-- bench:model_speed -->", 1)[1].split("<!-- /bench:model_speed -->", 1)[0]


def test_the_speed_region_is_rendered_from_its_results_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails when the region was typed or edited by hand, or not rendered again after its results changed."""
    monkeypatch.chdir(REPO)  # the results file is named relative to the repository
    text = DOC.read_text()
    found = re.search(r"rendered by bench/model_speed.py --render (\S+) DOC;", _region(text))
    assert found is not None, "docs/model.md's speed region names no results file"
    copy = tmp_path / "model.md"
    shutil.copy(DOC, copy)
    _model_speed().render(Path(found.group(1)), copy)
    assert _region(copy.read_text()) == _region(text)


def test_a_missed_target_is_rendered_as_missed() -> None:
    speed = _model_speed()
    assert speed.verdict("compute_io_ratio", 0.4) == "met"
    assert speed.verdict("compute_io_ratio", 0.6) == "MISSED"
    assert speed.verdict("prefill_over_decode", 5.0) == "met"
    assert speed.verdict("prefill_over_decode", 4.9) == "MISSED"
