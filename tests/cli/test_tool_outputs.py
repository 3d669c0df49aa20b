"""What the tools write: strict JSON (no ``NaN``), and never over one of their inputs (issue 24)."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from aioexperts import _json as strict_json
from aioexperts._cli import tracetool
from aioexperts._predict.trace import RoutingTrace

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
