"""``aioexperts-bench --mode timeline``: a run on a small model writes a results JSON and an SVG picture."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from aioexperts.cli import bench
from aioexperts_bench import TIMELINE_SCHEMA, render_timeline_svg


def test_timeline_run_writes_results_and_a_picture(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tl.json"
    args = ["--mode", "timeline", "--model", str(tiny_full_model), "--limit", "none", "--prompt-tokens", "6"]
    args += ["--speculative", "2"]
    code = bench.main([*args, "--decode-tokens", "4", "--picture-tokens", "2", "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr()
    results = json.loads(out.read_text())
    assert results["schema"] == TIMELINE_SCHEMA and results["run"]["status"] == "ok"
    assert results["parameters"]["speculative"] == 2
    tl, s = results["timeline"], results["summary"]
    layers = tl["layers"]
    assert len(tl["tokens"]["start_ms"]) == 4 == s["tokens"]
    assert len(tl["steps"]["layer"]) == 4 * len(layers)  # one step per MoE layer and token
    assert sorted(set(tl["steps"]["token"])) == [0, 1, 2, 3]
    for a, r, d in zip(tl["steps"]["start_ms"], tl["steps"]["ready_ms"], tl["steps"]["done_ms"], strict=True):
        assert a <= r <= d
    assert len(tl["computes"]["step"]) >= len(tl["steps"]["layer"])
    assert 0 <= s["device_busy_fraction"] <= 1 and 0 <= s["compute_busy_fraction"] <= 1
    assert s["stall_seconds_per_token"] >= 0 and s["pipeline_ratio"] >= 1 - 1e-9
    assert [row["layer"] for row in results["per_layer"]] == layers
    svg = out.with_suffix(".svg")
    root = ET.fromstring(svg.read_text())  # well-formed
    assert root.tag.endswith("svg")
    texts = [t.text or "" for t in root.iter() if t.tag.endswith("text")]
    assert any(t == f"layer {layers[0]}" for t in texts) and "token 1" in texts and "token 2" not in texts
    printed = capsys.readouterr().out
    assert "decode / max(I/O, compute)" in printed and str(svg) in printed


def test_the_picture_of_a_run_without_a_timeline_says_so() -> None:
    svg = render_timeline_svg({"model": {"name": "m.gguf"}, "timeline": None})
    assert "no timeline was recorded" in svg
    ET.fromstring(svg)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--limit", "2/0"], ["--decode-tokens", "0"], ["--engine", "aioexperts-tier"], ["--speculative", "-1"]):
        with pytest.raises(SystemExit) as info:
            bench.main(["--mode", "timeline", *bad])
        assert info.value.code == 2
    assert "--miss-tier go together" in capsys.readouterr().err
