"""Loading a script of ``bench/`` as a module in a test (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` as a module, its sibling modules (``_results``, ``read_cpu``) importable
    while it loads."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def assert_region_rendered(
    doc: Path, region: str, script: str, render: Callable[[Path, Path], None], tmp_path: Path
) -> dict[str, object]:
    """The ``<!-- bench:REGION -->`` region of ``doc`` is what ``render(results, doc)`` writes from
    the results file it names (``rendered by bench/SCRIPT --render RESULTS DOC``), run from the
    repository root; returns the results. Fails when the region was typed, edited by hand, or not
    rendered again after its results changed."""
    start, end = f"<!-- bench:{region} -->", f"<!-- /bench:{region} -->"
    text = doc.read_text()
    found_region = text.split(start, 1)[1].split(end, 1)[0]
    found = re.search(rf"rendered by bench/{re.escape(script)} --render (\S+) DOC;", found_region)
    assert found is not None, f"{doc.name}'s {region} region names no results file"
    results = json.loads(Path(found.group(1)).read_text())
    copy = tmp_path / doc.name
    shutil.copy(doc, copy)
    render(Path(found.group(1)), copy)
    assert copy.read_text().split(start, 1)[1].split(end, 1)[0] == found_region
    return results
