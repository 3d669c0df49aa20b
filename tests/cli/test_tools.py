"""``aioexperts-map`` (layout, write, check) and ``aioexperts-trace`` (summary, order)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_fixtures_dir

import aioexperts
from aioexperts._predict.simulate import expert_frequencies, replay, slots_for_hit_rate
from aioexperts._predict.trace import skewed_random_trace, uniform_random_trace
from aioexperts.cli import maptool, tracetool
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "m.gguf"
    write_synthetic_model(path, SPEC)
    return path


def test_layout_table_and_json(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert maptool.main(["layout", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert "3 MoE layers" in out and "top-2" in out
    assert maptool.main(["layout", str(model_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = aioexperts.build_layout(aioexperts.open_model(model_path))
    per_expert = {b["expert_bytes"] for b in doc["banks"]}
    assert per_expert == {SPEC.expert_bytes()}
    assert doc["expert_bytes_total"] == sum(loc.n_bytes for loc in layout) == 3 * 8 * SPEC.expert_bytes()
    assert doc["token_bytes_min"] == doc["token_bytes_max"] == 3 * 2 * SPEC.expert_bytes()


def test_layout_of_a_mixed_tier_model(capsys: pytest.CaptureFixture[str]) -> None:
    root = shared_fixtures_dir()
    if root is None or not (root / "qwen3moe-mixed.gguf").exists():
        pytest.skip("shared fixtures not found")
    path = root / "qwen3moe-mixed.gguf"
    assert maptool.main(["layout", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    assert {b["bank"] for b in doc["banks"]} == {0, 1, 2, 3}
    assert doc["expert_bytes_total"] == sum(loc.n_bytes for loc in layout)
    # top-2 of the smallest and of the largest experts of each layer, computed independently
    low = high = 0
    for moe in layout.layers.values():
        sizes = sorted(layout.locate(moe.index, e).n_bytes for e in range(moe.n_experts))
        low += sum(sizes[:2])
        high += sum(sizes[-2:])
    assert (doc["token_bytes_min"], doc["token_bytes_max"]) == (low, high) and low < high


def test_write_then_check_then_stale(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "copy.gguf"
    shutil.copy(model_path, model)
    assert maptool.main(["write", str(model)]) == 0
    emap = tmp_path / "copy.weepf"
    assert emap.exists() and aioexperts.read_expert_map(emap).model_size == model.stat().st_size
    assert maptool.main(["check", str(model), str(emap)]) == 0
    assert "up to date" in capsys.readouterr().out
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert maptool.main(["check", str(model), str(emap)]) == 1
    assert "write it again" in capsys.readouterr().err


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert maptool.main(["layout", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aioexperts-map: error:") and err.count("\n") == 1
    bad = tmp_path / "bad.weepf"
    bad.write_bytes(b"WEEPF000" + bytes(40))
    model = tmp_path / "m.gguf"
    write_synthetic_model(model, SPEC)
    assert maptool.main(["check", str(model), str(bad)]) == 2
    assert "magic" in capsys.readouterr().err
    target = tmp_path / "no-such-dir" / "m.weepf"
    assert maptool.main(["write", str(model), "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{target}: No such file or directory" in err and ".weepf-" not in err and "[Errno" not in err


def test_the_console_scripts_are_installed(model_path: Path) -> None:
    bindir = Path(sys.executable).parent
    for name in ("aioexperts-map", "aioexperts-trace"):
        done = subprocess.run([str(bindir / name), "--help"], capture_output=True, text=True, check=False)
        assert done.returncode == 0 and "usage:" in done.stdout


def test_slots_for_a_hit_rate_are_the_fewest(tmp_path: Path) -> None:
    trace = skewed_random_trace(300, [0, 1, 2], 16, 2, seed=1, zipf_exponent=1.2, locality=0.3)
    for policy in ("lru", "belady"):
        slots = slots_for_hit_rate(trace, 0.6, policy)
        assert slots is not None
        assert replay(trace, slots, (policy,))[policy].hit_rate >= 0.6
        if slots > 2:
            assert replay(trace, slots - 1, (policy,))[policy].hit_rate < 0.6
    assert slots_for_hit_rate(trace, 0.6, "belady") <= slots_for_hit_rate(trace, 0.6, "lru")  # type: ignore[operator]
    assert slots_for_hit_rate(uniform_random_trace(3, [0], 16, 2, seed=0), 0.99) is None  # compulsory misses


def test_trace_summary_and_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = skewed_random_trace(200, [1, 2], 8, 2, seed=3, zipf_exponent=1.5, locality=0.2)
    path = tmp_path / "t.npz"
    trace.save(path)
    assert tracetool.main(["summary", str(path), "--hit-rate", "0.5,0.7", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["hit_rate"] for r in doc["slab_sizes"]] == [0.5, 0.7]
    for row in doc["slab_sizes"]:
        assert row["belady"] == slots_for_hit_rate(trace, row["hit_rate"], "belady")
    counts = expert_frequencies(trace)
    for layer in doc["layers"]:
        c = counts[layer["layer"]]
        assert layer["requests"] == int(c.sum()) == 200 * 2
        assert layer["hottest"][0] == int(np.argmax(c))
    assert tracetool.main(["summary", str(path)]) == 0
    assert "Belady" in capsys.readouterr().out
    out = tmp_path / "order.json"
    assert tracetool.main(["order", str(path), "-o", str(out)]) == 0
    order = json.loads(out.read_text())["layers"]
    for layer, entry in order.items():
        c = counts[int(layer)]
        assert sorted(entry["hot_first"]) == list(range(8))
        assert entry["counts"] == [int(c[e]) for e in entry["hot_first"]]
        assert entry["counts"] == sorted(entry["counts"], reverse=True)
    assert tracetool.main(["summary", str(tmp_path / "missing.npz")]) == 2


def test_trace_summary_of_an_empty_trace_asks_for_no_slot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/trace-format.md: ``n_tokens`` may be 0 (and ids -1 are no request): a valid trace whose
    summary is zero slots at every hit rate, not a refusal."""
    path = tmp_path / "empty.npz"
    uniform_random_trace(0, [0, 1], 8, 2, seed=0).save(path)
    assert tracetool.main(["summary", str(path), "--hit-rate", "0.5,0.9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_tokens"] == 0
    assert [(r["lru"], r["belady"]) for r in doc["slab_sizes"]] == [(0, 0), (0, 0)]
    assert all(layer["requests"] == 0 for layer in doc["layers"])


def test_trace_summary_refuses_a_model_it_was_not_recorded_on(
    model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = uniform_random_trace(20, [0, 1], 8, 2, seed=1)  # the model has 3 MoE layers
    path = tmp_path / "t.npz"
    trace.save(path)
    assert tracetool.main(["summary", str(path), "--model", str(model_path)]) == 2
    assert "not of this model" in capsys.readouterr().err


def test_help_shows_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A None default is not shown: the help text says what happens without the option."""
    with pytest.raises(SystemExit):
        maptool.main(["write", "--help"])
    out = capsys.readouterr().out
    assert "(default: MODEL with the suffix .weepf)" in out and "None" not in out
    with pytest.raises(SystemExit):
        tracetool.main(["summary", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.5,0.8,0.9)" in out and "None" not in out


def _write_to_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a console script whose stdout is a pipe nobody reads any more (``tool | head`` after head quit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    finally:
        os.close(write_end)


def test_a_closed_pipe_ends_the_tools_quietly(model_path: Path, tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent
    trace = tmp_path / "t.npz"
    skewed_random_trace(50, [1, 2], 8, 2, seed=3, zipf_exponent=1.5, locality=0.2).save(trace)
    for argv in (
        [str(bindir / "aioexperts-map"), "layout", "--json", str(model_path)],
        [str(bindir / "aioexperts-map"), "layout", str(model_path)],
        [str(bindir / "aioexperts-trace"), "summary", "--json", str(trace)],
    ):
        done = _write_to_a_closed_pipe(argv)
        assert (done.returncode, done.stderr) == (141, ""), argv


@pytest.mark.parametrize("script", ["run", "serve", "bench", "map", "trace", "tier"])
def test_every_command_prints_its_version(script: str) -> None:
    """Each console script of pyproject.toml answers ``--version`` with its name and the package's version."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts[f"aioexperts-{script}"].partition(":")
    code = f"import sys, {module} as m; sys.argv[0] = 'x'; sys.exit(m.{func}(['--version']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"aioexperts-{script} {aioexperts.__version__}"


def test_a_fifo_as_the_map_is_refused_not_waited_on(model_path: Path, tmp_path: Path) -> None:
    """``aioexperts-map check MODEL FIFO`` waited for a writer for ever."""
    fifo = tmp_path / "m.weepf"
    os.mkfifo(fifo)
    cmd = [str(Path(sys.executable).parent / "aioexperts-map"), "check", str(model_path), str(fifo)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("aioexperts-map check waited on a FIFO")
    assert done.returncode == 2 and "not a regular file" in done.stderr, done.stderr


@pytest.mark.parametrize("tool", ["map", "trace"])
def test_ctrl_c_is_one_line_and_status_130(
    tool: str, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt printed a traceback (as ``aioexperts-tier``'s once did)."""

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    if tool == "map":
        monkeypatch.setattr(maptool, "build_layout", interrupt)
        argv = ["layout", str(model_path)]
    else:
        trace = tmp_path / "t.npz"
        skewed_random_trace(50, [1, 2], 8, 2, seed=3, zipf_exponent=1.5, locality=0.2).save(trace)
        monkeypatch.setattr(tracetool, "_summary", interrupt)
        argv = ["summary", str(trace)]
    main = maptool.main if tool == "map" else tracetool.main
    try:
        status = main(argv)
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left main()")
    assert status == 130
    assert capsys.readouterr().err == f"aioexperts-{tool}: interrupted\n"
