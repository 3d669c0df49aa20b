"""bench/speculative_ab.py: the per-round speed-up and the rendered table come from the runs."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from benchkit import assert_region_rendered, load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    return load_bench("speculative_ab")


def run(ms: float, spec: int, status: str = "ok") -> dict[str, object]:
    return {
        "status": status,
        "speculative": spec,
        "ms_per_token": ms,
        "stall_ms_per_token": ms / 2,
        "mb_per_token": 980.0,
        "device_busy_fraction": 0.8,
        "pipeline_ratio": 1.2,
    }


def test_the_speed_up_is_taken_within_each_round_and_failed_runs_are_left_out(ab: ModuleType) -> None:
    rounds = [
        {"round": 0, "limit": "1/4", "runs": {"0": run(500, 0), "1": run(400, 1)}},
        {"round": 1, "limit": "1/4", "runs": {"0": run(600, 0), "1": run(500, 1)}},
        {"round": 2, "limit": "1/4", "runs": {"0": run(550, 0), "1": {"status": "timeout", "speculative": 1}}},
    ]
    s = ab.summarize(rounds, [1])["1/4"]
    assert s["1"]["speedup_per_round"] == [500 / 400, 600 / 500]
    assert s["0"]["ms_per_token"] == {"median": 550, "min": 500, "max": 600} and s["0"]["ok_runs"] == 3
    assert s["1"]["ms_per_token"]["median"] == 450 and s["1"]["ok_runs"] == 2


def test_the_region_of_docs_executor_is_rendered_from_its_results_file(
    ab: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails when the figures of the region were typed, edited by hand, or not rendered again."""
    monkeypatch.chdir(BENCH.parent)
    doc = BENCH.parent / "docs" / "executor.md"
    results = assert_region_rendered(doc, "speculative_ab", "speculative_ab.py", ab.render, tmp_path)
    assert results["benchmark"] == "speculative_ab"
