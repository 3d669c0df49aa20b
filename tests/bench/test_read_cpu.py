"""bench/read_cpu.py: more groups than the model holds is a clear error, never an endless loop (issue 31 item 14)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from benchkit import BENCH, load_bench

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def read_cpu() -> ModuleType:
    return load_bench("read_cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_model(tmp_path_factory.mktemp("read_cpu") / "m.gguf", SMALL)[0]


def test_pick_groups_fills_the_model_exactly_and_refuses_one_more(read_cpu: ModuleType, model: Path) -> None:
    layout = aioexperts.build_layout(aioexperts.open_model(model))
    assert read_cpu.group_capacity(layout, 2) == 8 and read_cpu.group_capacity(layout, 3) == 4
    groups = read_cpu.pick_groups(layout, 8, 2, random.Random(0))
    picked = [(layer, e) for layer, ids in groups for e in ids]
    assert len(picked) == len(set(picked)) == 16
    with pytest.raises(ValueError, match="9 groups of 2 distinct experts do not fit in this model: it holds 8"):
        read_cpu.pick_groups(layout, 9, 2, random.Random(0))
    with pytest.raises(ValueError, match="holds 0"):
        read_cpu.pick_groups(layout, 1, 9, random.Random(0))


def test_too_many_groups_exit_2_naming_the_limit(model: Path, tmp_path: Path) -> None:
    """The issue's case: --groups 48 x 3 rounds on a file that holds fewer groups looped for ever."""
    cmd = [sys.executable, str(BENCH / "read_cpu.py"), "--model", str(model), "--groups", "48"]
    cmd += ["--top-k", "2", "--methods", "store-threads", "--json", str(tmp_path / "out.json")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("bench/read_cpu.py --groups 48 did not stop within 60 s")
    assert done.returncode == 2, done.stderr
    assert "--groups 48 x --rounds 3 = 144 groups" in done.stderr and "holds 8" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_the_default_model_is_the_file_the_built_in_generator_writes(read_cpu: ModuleType) -> None:
    """It named a ``-v1`` file that nothing writes any more."""
    from aioexperts.testing._full_model import FULL_SPEC

    assert read_cpu.DEFAULT_MODEL.name == FULL_SPEC.with_(n_layer=48).file_name()


def test_a_missing_model_names_what_writes_it(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "read_cpu.py"), "--model", str(tmp_path / "none.gguf")]
    cmd += ["--methods", "store-threads"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "aioexperts-bench --mode generate" in done.stderr


def test_the_region_of_docs_architecture_is_rendered_from_its_results_file(
    read_cpu: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails when the read-CPU figures of docs/architecture.md were typed, edited by hand, or not
    rendered again after a run."""
    import re
    import shutil

    repo = BENCH.parent
    monkeypatch.chdir(repo)  # the results file is named relative to the repository
    doc = repo / "docs" / "architecture.md"
    start, end = "<!-- bench:read_cpu -->", "<!-- /bench:read_cpu -->"
    region = doc.read_text().split(start, 1)[1].split(end, 1)[0]
    found = re.search(r"rendered by bench/read_cpu.py --render (\S+) DOC(?: --decode (\S+))?;", region)
    assert found is not None, "docs/architecture.md's read_cpu region names no results file"
    copy = tmp_path / "architecture.md"
    shutil.copy(doc, copy)
    decode = Path(found.group(2)) if found.group(2) else None
    read_cpu.render(Path(found.group(1)), copy, decode=decode)
    assert copy.read_text().split(start, 1)[1].split(end, 1)[0] == region
    assert "**MISSED**" in region or "**met**" in region


def test_decode_share_is_bytes_per_token_times_cpu_per_gib_over_the_token(read_cpu: ModuleType) -> None:
    """Per limit: the median bytes per token and token time of the aioexperts runs (other engines,
    failed runs and the unlimited runs left out)."""
    gib = 2**30

    def run(engine: str, status: str, limit: str, gib_per_token: float, tok_s: float) -> dict[str, object]:
        bytes_per_token = gib_per_token * gib
        return {"engine": engine, "status": status, "limit": limit} | {
            "expert_bytes_per_token": bytes_per_token,
            "decode_tok_s": tok_s,
        }

    runs = [
        run("aioexperts", "ok", "1/4", 1, 2.0),
        run("aioexperts", "ok", "1/4", 3, 4.0),
        run("aioexperts", "ok", "1/4", 2, 1.0),
        run("aioexperts", "oom", "1/4", 99, 9.0),
        run("aioexperts-tier", "ok", "1/4", 1, 9.0),
        run("aioexperts", "ok", "none", 1, 5.0),
    ]
    (row,) = read_cpu.decode_share(10.0, {"runs": runs})
    assert row["limit"] == "1/4" and row["rounds"] == 3
    assert row["mib_per_token"] == 2048 and row["token_ms"] == 500.0
    assert row["read_cpu_ms"] == 20.0 and row["share"] == 20.0 / 500.0


def test_store_null_counts_the_same_bytes_as_the_store_that_reads(model: Path, tmp_path: Path) -> None:
    """``store-null`` (the store's bookkeeping over a backend that reads nothing) runs the same
    groups as the reading store: the same bytes, a row per round, no O_DIRECT needed."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH / "read_cpu.py"), "--model", str(model), "--groups", "2", "--rounds", "2"]
    cmd += ["--top-k", "2", "--methods", "store-threads,store-null", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    for row in result["rounds"]:
        assert row["store-null"]["bytes"] == row["store-threads"]["bytes"] > 0
        assert row["store-null"]["backend"] == "fake" and row["store-null"]["cpu_s_per_gib"] > 0
    assert "store-null" in result["summary"]
