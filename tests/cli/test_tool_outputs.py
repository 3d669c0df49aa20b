"""What the tools write: strict JSON (no ``NaN``), and never over one of their inputs (issue 24)."""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from aioexperts import _json as strict_json
from aioexperts._errors import ConfigError
from aioexperts._format.expert_map import EXPERT_MAP_MAGIC, write_expert_map
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._predict.trace import RoutingTrace
from aioexperts.cli import bench, maptool, tracetool
from aioexperts.testing import SyntheticSpec, write_synthetic_model

REPO = Path(__file__).resolve().parents[2]


def _strict_loads(text: str) -> object:
    """``json.loads`` that refuses ``NaN`` / ``Infinity`` as strict parsers (jq, JSON.parse) do."""

    def refuse(token: str) -> object:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _trace_with_an_unrouted_layer(path: Path) -> Path:
    ids = np.full((4, 2, 2), -1, np.int16)
    ids[:, 0, :] = [[0, 1], [1, 2], [0, 3], [2, 1]]  # layer 1 routed; layer 2 never
    RoutingTrace(ids, [1, 2], 8).save(path)
    return path


def test_trace_summary_json_says_null_for_an_undefined_hot_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace_with_an_unrouted_layer(tmp_path / "t.npz")
    assert tracetool.main(["summary", str(trace), "--json"]) == 0
    doc = _strict_loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    shares = [layer["hot_share"] for layer in doc["layers"]]
    assert shares[1] is None and shares[0] == pytest.approx(3 / 8)  # expert 1 serves 3 of 8 requests
    assert tracetool.main(["summary", str(trace)]) == 0
    assert re.search(r"^\s+2 .* - ", capsys.readouterr().out, re.M)  # the table shows a dash


def test_json_safe_turns_every_non_finite_number_into_null() -> None:
    value = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], 3: np.float32("nan"), "c": np.arange(2), "d": (1, 2)}
    assert strict_json.json_safe(value) == {"a": None, "b": [None, None, 1.5], "3": None, "c": [0, 1], "d": [1, 2]}
    assert _strict_loads(strict_json.dumps(value)) == strict_json.json_safe(value)
    with pytest.raises(ValueError, match="Out of range float"):
        json.dumps(math.nan, allow_nan=False)  # what the strict writers rely on


def _json_writes(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("dump", "dumps")
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "json"
    ]


@pytest.mark.parametrize("folder", ["aioexperts", "bench"])
def test_every_json_writer_of_the_project_is_strict(folder: str) -> None:
    """Each ``json.dump``/``json.dumps`` passes ``allow_nan=False`` (or goes through ``aioexperts._json``),
    also inside the code strings the benches run in child interpreters."""
    loose = []
    for path in sorted((REPO / folder).rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        loose.extend(
            f"{path.relative_to(REPO)}:{call.lineno}"
            for call in _json_writes(tree)
            if not any(k.arg == "allow_nan" and getattr(k.value, "value", True) is False for k in call.keywords)
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "json.dump" in node.value:
                calls = len(re.findall(r"\bjson\.dumps?\(", node.value))
                if node.value.count("allow_nan=False") < calls:
                    loose.append(f"{path.relative_to(REPO)}:{node.lineno} (code string)")
    assert not loose, loose


# -- never over an input ------------------------------------------------------------------------

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "m.gguf"
    path.parent.mkdir()
    write_synthetic_model(path, SPEC)
    return path


def _one_error(capsys: pytest.CaptureFixture[str], tool: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{tool}: error:") and err.count("\n") == 1, err
    return err


def _same_paths(path: Path) -> list[str]:
    """``path`` by other names: through ``..``, a symlink and a hard link."""
    link, hard = path.parent / "link.gguf", path.parent / "hard.gguf"
    link.symlink_to(path.name)
    os.link(path, hard)
    return [str(path), str(path.parent / ".." / path.parent.name / path.name), str(link), str(hard)]


def test_map_write_never_writes_over_its_model(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = model.read_bytes()
    for output in _same_paths(model):
        for force in ([], ["--force"]):
            assert maptool.main(["write", str(model), "-o", output, *force]) == 2
            assert "is the input" in _one_error(capsys, "aioexperts-map")
    named = model.with_name("m.weepf")  # a model named like its default map
    model.rename(named)
    assert maptool.main(["write", str(named)]) == 2
    assert "is the input" in _one_error(capsys, "aioexperts-map")
    assert named.read_bytes() == before
    loaded = open_model(named)
    layout = build_layout(loaded)
    with pytest.raises(ConfigError, match="never written over its model"):  # the library refuses too
        write_expert_map(loaded, layout, named.parent / ".." / named.parent.name / named.name)
    assert named.read_bytes() == before


def test_the_map_tool_knows_the_map_magic() -> None:
    """aioexperts-map recognises a map by its magic without importing the format layer."""
    assert maptool.MAP_MAGIC == EXPERT_MAP_MAGIC


def test_map_write_replaces_a_map_but_another_file_only_with_force(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    emap = model.with_suffix(".weepf")
    assert maptool.main(["write", str(model)]) == 0
    assert maptool.main(["write", str(model)]) == 0  # a map is replaced freely
    other = model.parent / "notes.txt"
    other.write_text("keep me")
    assert maptool.main(["write", str(model), "-o", str(other)]) == 2
    assert "--force" in _one_error(capsys, "aioexperts-map") and other.read_text() == "keep me"
    assert maptool.main(["write", str(model), "-o", str(other), "--force"]) == 0
    assert other.read_bytes() == emap.read_bytes()
    assert maptool.main(["write", str(model), "-o", str(model.parent)]) == 2  # a directory
    assert "not a regular file" in _one_error(capsys, "aioexperts-map")


def test_trace_order_never_writes_over_its_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace_with_an_unrouted_layer(tmp_path / "t.npz")
    before = trace.read_bytes()
    for output in (trace, tmp_path / ".." / tmp_path.name / "t.npz"):
        for force in ([], ["--force"]):
            assert tracetool.main(["order", str(trace), "-o", str(output), *force]) == 2
            assert "is the input" in _one_error(capsys, "aioexperts-trace")
    assert trace.read_bytes() == before
    order, other = tmp_path / "order.json", tmp_path / "other.json"
    assert tracetool.main(["order", str(trace), "-o", str(order)]) == 0
    assert tracetool.main(["order", str(trace), "-o", str(order)]) == 0  # its own output: replaced
    other.write_text('{"something": "else"}')
    assert tracetool.main(["order", str(trace), "-o", str(other)]) == 2
    assert "--force" in _one_error(capsys, "aioexperts-trace")
    assert tracetool.main(["order", str(trace), "-o", str(other), "--force"]) == 0
    assert json.loads(other.read_text()) == json.loads(order.read_text())


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the bench ran although its outputs were refused")


def test_bench_outputs_never_replace_the_model_or_a_foreign_file(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "run_read_bench", _must_not_run)
    monkeypatch.setattr(bench, "run_token_bench", _must_not_run)
    before = model.read_bytes()
    for output in _same_paths(model):
        assert bench.main(["--model", str(model), "--quiet", "--out", output, "--force"]) == 2
        assert "is the input" in capsys.readouterr().err
    other = tmp_path / "results.json"
    other.write_text("[1, 2]")
    assert bench.main(["--model", str(model), "--quiet", "--out", str(other)]) == 2
    assert "--force" in capsys.readouterr().err
    plots = tmp_path / "img"
    plots.mkdir()
    (plots / "reads_vs_depth.png").write_text("not a png")
    assert bench.main(["--model", str(model), "--quiet", "--out", "", "--plot", str(plots)]) == 2
    assert "--force" in capsys.readouterr().err
    assert model.read_bytes() == before and other.read_text() == "[1, 2]"


def test_bench_scripts_never_replace_a_file_that_is_not_results(model: Path, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_results", REPO / "bench" / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = model.read_bytes()
    with pytest.raises(SystemExit, match="is not a results file"):
        module.write_results(model, "x", {}, {}, [], {}, 0.0)
    assert model.read_bytes() == before
    out = module.write_results(tmp_path / "r.json", "x", {"p": math.nan}, {}, [{"v": math.inf}], {}, 0.0)
    doc = _strict_loads(out.read_text())
    assert isinstance(doc, dict) and doc["parameters"] == {"p": None} and doc["rounds"] == [{"v": None}]
    assert module.write_results(out, "x", {}, {}, [], {}, 0.0) == out  # its own file: replaced
