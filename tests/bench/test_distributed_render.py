"""The simulation region of docs/distributed.md is what bench/distributed.py renders from the results file it names."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOC = REPO / "docs" / "distributed.md"
START, END = "<!-- bench:distributed_shards -->", "<!-- /bench:distributed_shards -->"


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("distributed_bench", REPO / "bench" / "distributed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _region(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0]


def test_the_simulation_region_is_rendered_from_its_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails when the region was typed or edited by hand, left empty, or not rendered again after a new run."""
    monkeypatch.chdir(REPO)  # the results file is named relative to the repository
    text = DOC.read_text()
    found = re.search(r"rendered by bench/distributed.py --render (\S+) DOC;", _region(text))
    assert found is not None, "docs/distributed.md's region names no results file"
    copy = tmp_path / "distributed.md"
    shutil.copy(DOC, copy)
    _bench().render(Path(found.group(1)), copy)
    assert _region(copy.read_text()) == _region(text)
    for n_shards in (1, 2, 4, 8):  # every shard count and placement has its row
        for method in ("round-robin", "frequency", "coactivation"):
            assert f"| {n_shards} | {method} |" in text


def test_the_default_model_is_the_file_the_built_in_generator_writes() -> None:
    """It named a ``-v1`` file that nothing writes any more (``make run`` writes the 8-layer one)."""
    from aioexperts.testing._full_model import FULL_SPEC

    assert _bench().MODEL.name == FULL_SPEC.with_(n_layer=8).file_name()
