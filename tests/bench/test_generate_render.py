"""The generate regions of README.md and docs/bench.md are what bench/generate.py renders from the results they name."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from aioexperts_bench import load_generate_results, render_into

REPO = Path(__file__).parents[2]
START, END = "<!-- bench:generate-headline -->", "<!-- /bench:generate-headline -->"


def _region(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0]


@pytest.mark.parametrize("doc", ["README.md", "docs/bench.md"])
def test_the_region_is_rendered_from_its_results_files(
    doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails when the region was typed or edited by hand, or not rendered again after its results changed."""
    monkeypatch.chdir(REPO)
    text = (REPO / doc).read_text()
    found = re.search(r"rendered by bench/generate.py --render (.+?) -- DOCS;", _region(text))
    assert found is not None, f"{doc}'s generate region names no results files"
    sources = found.group(1).split()
    copy = tmp_path / "doc.md"
    shutil.copy(REPO / doc, copy)
    assert render_into(copy, [load_generate_results(s) for s in sources], sources)
    assert _region(copy.read_text()) == _region(text)
