"""bench/serve_speed.py judges its targets (the region test comes with the first results file)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def _serve_speed():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("serve_speed", REPO / "bench" / "serve_speed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_missed_target_is_rendered_as_missed() -> None:
    speed = _serve_speed()
    assert speed.verdict("batching_speedup_4", 1.4) == "met"
    assert speed.verdict("batching_speedup_4", 1.39) == "MISSED"
    assert speed.verdict("hits_first_speedup", 1.04) == "MISSED"
    assert speed.verdict("p99_4_over_1", 2.0) == "met"
    assert speed.verdict("p99_4_over_1", 2.1) == "MISSED"


@pytest.mark.parametrize("routing", ["spread", "skewed"])
def test_the_region_is_rendered_from_its_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, routing: str
) -> None:
    """Fails when a region of docs/serving.md was typed or edited by hand, or not rendered again after a run."""
    monkeypatch.chdir(REPO)  # the results file is named relative to the repository
    doc = REPO / "docs" / "serving.md"
    start, end = _serve_speed().REGIONS[routing]
    text = doc.read_text()
    region = text.split(start, 1)[1].split(end, 1)[0]
    found = re.search(r"rendered by bench/serve_speed.py --render (\S+) DOC;", region)
    assert found is not None, "docs/serving.md's region names no results file"
    assert _serve_speed().region_of(Path(found.group(1))) == (start, end), "the file is of another routing"
    copy = tmp_path / "serving.md"
    shutil.copy(doc, copy)
    _serve_speed().render(Path(found.group(1)), copy)
    assert copy.read_text().split(start, 1)[1].split(end, 1)[0] == region


def test_the_rendering_names_the_commit_that_ran(tmp_path: Path) -> None:
    """Issue 31 item 14: a serve_speed result says which aioexperts ran it, as the generate results do."""
    import json

    results = json.loads((REPO / "docs" / "results" / "serve_speed-48l-skewed.json").read_text())
    path = tmp_path / "r.json"
    results["machine"]["aioexperts_commit"] = "0123456789abcdef0123+dirty"
    path.write_text(json.dumps(results))
    assert "min, aioexperts 0123456789+dirty. Model" in _serve_speed().render_lines(path)[1]
    results["machine"].pop("aioexperts_commit")
    path.write_text(json.dumps(results))
    assert "aioexperts commit unknown" in _serve_speed().render_lines(path)[1]


def test_every_bench_results_file_records_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/_results.write_results (serve_speed's and every bench script's writer) records the git commit."""
    import json
    import subprocess

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("_results_under_test", REPO / "bench" / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.write_results(tmp_path / "r.json", "x", {}, {}, [], {}, 0.0)
    commit = json.loads(out.read_text())["machine"]["aioexperts_commit"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        assert commit is None
    else:
        assert commit is not None and commit.removesuffix("+dirty") == head.stdout.strip()
