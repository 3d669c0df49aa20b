"""docs/fuzzing.md's long-run table is what tests/fuzz/render.py renders from the committed results."""

from __future__ import annotations

from pathlib import Path

from fuzz.render import render_into

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_rendered_from_the_results_file() -> None:
    doc = ROOT / "docs" / "fuzzing.md"
    assert render_into(Path("docs/results/fuzz-2026-12-03.json"), doc) == doc.read_text()
