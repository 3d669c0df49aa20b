"""bench/serve_speed.py judges its targets (the region test comes with the first results file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
