"""bench/spin_ab.py: the per-round ratio and the rendered table come from the runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchkit import assert_region_rendered, load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    return load_bench("spin_ab")


def test_the_ratio_is_taken_within_each_round(ab: ModuleType) -> None:
    rounds = [
        {"round": 0, "spin_ms_per_token": 100.0, "sleep_ms_per_token": 110.0, "ratio": 1.1},
        {"round": 1, "spin_ms_per_token": 150.0, "sleep_ms_per_token": 150.0, "ratio": 1.0},
        {"round": 2, "spin_ms_per_token": 120.0, "sleep_ms_per_token": 126.0, "ratio": 1.05},
    ]
    s = ab.summarize(rounds)
    assert s["ratio"] == {"median": 1.05, "min": 1.0, "max": 1.1}
    assert s["spin_ms_per_token"] == {"median": 120.0, "min": 100.0, "max": 150.0}


def test_the_region_of_docs_executor_is_rendered_from_its_results_file(
    ab: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails when the figures of the region were typed, edited by hand, or not rendered again."""
    monkeypatch.chdir(BENCH.parent)
    doc = BENCH.parent / "docs" / "executor.md"
    results = assert_region_rendered(doc, "spin_ab", "spin_ab.py", ab.render, tmp_path)
    assert results["benchmark"] == "spin_ab"


def test_the_table_names_what_each_block_did(ab: ModuleType, tmp_path: Path) -> None:
    summary = ab.summarize([{"round": 0, "spin_ms_per_token": 90.0, "sleep_ms_per_token": 99.0, "ratio": 1.1}])
    base = {"rounds": 1, "tokens": 6, "prompt": 256, "spin_us": 1000}
    for against, second in ((0, "| sleep at once | 99.0"), (200, "| spin 200 us, then sleep | 99.0")):
        path = tmp_path / f"r{against}.json"
        params = base if not against else {**base, "against_us": against}  # files before --against-us have none
        path.write_text(
            json.dumps(
                {"benchmark": "spin_ab", "parameters": params, "machine": {}, "summary": summary, "started": "t"}
            )
        )
        lines = ab.render_lines(path)
        assert any(line.startswith("| spin 1000 us, then sleep | 90.0") for line in lines)
        assert any(line.startswith(second) for line in lines), lines


def test_bad_files_and_settings_are_one_line_before_any_model_loads(
    ab: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:spin_ab -->\n<!-- /bench:spin_ab -->\n")
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"benchmark": "other"}))
    broken = tmp_path / "broken.json"
    broken.write_text("not json")
    monkeypatch.setattr(ab, "ensure_full_model", lambda n: pytest.fail("a model was loaded"))
    for results in (tmp_path / "missing.json", foreign, broken):
        monkeypatch.setattr("sys.argv", ["spin_ab.py", "--render", str(results), str(doc)])
        assert ab.main() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    for name, value in (("AIOEXPERTS_COMPUTE_SPIN_US", "abc"), ("AIOEXPERTS_COMPUTE_THREADS", "0")):
        monkeypatch.setenv(name, value)
        monkeypatch.setattr("sys.argv", ["spin_ab.py", "--rounds", "1"])
        with pytest.raises(SystemExit) as info:
            ab.main()
        assert info.value.code == 2 and name in capsys.readouterr().err
        monkeypatch.delenv(name)
    monkeypatch.setenv("AIOEXPERTS_COMPUTE_SPIN_US", "0")  # a valid setting, but no spin to compare
    monkeypatch.setattr("sys.argv", ["spin_ab.py"])
    with pytest.raises(SystemExit):
        ab.main()
    assert "AIOEXPERTS_COMPUTE_SPIN_US (the default of --spin-us)" in capsys.readouterr().err
