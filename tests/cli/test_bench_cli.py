"""``aioexperts-bench`` end to end on a small generated model: results file, tables, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from aioexperts.backends import io_uring_unusable_reason
from aioexperts.cli import bench
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=4)
FAST = ["--rounds", "2", "--token-count", "2", "--executor-tokens", "1", "--no-probe", "--quiet"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


@pytest.fixture(scope="module")
def results(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("out") / "results.json"
    reason = io_uring_unusable_reason()
    if reason is not None:  # the figures below are the io_uring store's against the others
        pytest.skip(f"io_uring unusable here: {reason}")
    methods = "io_uring,threads,pread,mmap" + (",fio" if shutil.which("fio") else "")
    assert bench.main(["--model", str(model), "--out", str(out), "--methods", methods, *FAST]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_results_file_has_context_units_and_every_round(results: dict) -> None:  # type: ignore[type-arg]
    assert results["schema"] == 1 and results["aioexperts"]
    assert results["units"]["GB"] == "1e9 bytes"
    machine = results["machine"]
    assert machine["kernel"] and machine["cpu_count"] >= 1 and machine["filesystem"]
    assert results["model"]["experts"] == 32 and results["model"]["bytes"] > 0
    assert results["parameters"]["rounds"] == 2 and results["parameters"]["loop"] == "uvloop"
    assert any("under 1 GiB" in w for w in results["warnings"])
    reads = results["reads"]
    assert len(reads["rounds"]) == 2
    first, second = (r["order"] for r in reads["rounds"])
    assert second == first[1:] + first[:1]  # rotated by one each round


def test_every_method_reads_the_same_bytes(results: dict) -> None:  # type: ignore[type-arg]
    reads = results["reads"]
    expected = reads["read_list"]["bytes_expected"]
    n_reads = reads["read_list"]["n_reads"]
    assert n_reads == 2 * 16 * 3  # every expert once, three segments each
    for rnd in reads["rounds"]:
        for method, p in rnd["cold"].items():
            assert p["bytes_read"] == expected, method
            assert p["n_reads"] == n_reads, method
        assert rnd["cold"]["io_uring"]["same_reads_as_list"]
    for summary in reads["summary"].values():
        assert summary["bytes_read"] == [expected]


def test_ratios_are_per_round(results: dict) -> None:  # type: ignore[type-arg]
    reads = results["reads"]
    per_round = sorted(r["cold"]["io_uring"]["gb_per_s"] / r["cold"]["mmap"]["gb_per_s"] for r in reads["rounds"])
    ratio = reads["ratios"]["io_uring_x_mmap"]
    assert ratio["min"] == pytest.approx(per_round[0]) and ratio["max"] == pytest.approx(per_round[-1])
    assert ratio["n"] == 2


def test_warm_and_token_figures(results: dict) -> None:  # type: ignore[type-arg]
    warm = results["reads"]["warm"]["store"]
    assert warm["experts_single_us_per_hit"]["median"] > 0 and warm["moe_us_per_call"]["median"] > 0
    tokens = results["tokens"]
    assert len(tokens["rounds"]) == 2
    for rnd in tokens["rounds"]:
        runs = rnd["runs"]
        assert set(runs) == {"io only", "compute only", "pipelined", "serial"}
        expected = runs["pipelined"]["ms_per_token"] / max(
            runs["io only"]["ms_per_token"], runs["compute only"]["ms_per_token"]
        )
        assert rnd["overlap"] == pytest.approx(expected)
        assert runs["compute only"]["hit_rate"] == 1.0  # every expert resident: no I/O
        assert set(rnd["executor"]) == {"0", "0.25", "1"}
        assert rnd["executor"]["1"]["hit_rate"] == 1.0
    assert tokens["target_overlap"] == 1.15
    timeline = tokens["timeline"]
    assert timeline["compute"] and all(c["end_ms"] >= c["start_ms"] for c in timeline["compute"])


def test_targets_say_met_or_missed(results: dict) -> None:  # type: ignore[type-arg]
    names = {t["name"]: t for t in results["targets"]}
    assert {"x_mmap", "x_threads", "warm_hit", "overlap", "cpu_vs_fio", "x_fio"} <= set(names)
    assert names["warm_hit"]["met"] in (True, False)
    if not shutil.which("fio"):
        assert names["x_fio"]["met"] is None


def test_loops_are_measured(results: dict) -> None:  # type: ignore[type-arg]
    assert {"uvloop", "asyncio"} <= set(results["loops"])
    assert all(v["yield_us"] > 0 for v in results["loops"].values())


@pytest.mark.io_uring
def test_tables_on_stdout_titles_fit_80_columns(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(model), "--out", "", "--mode", "reads", "--methods", "io_uring,mmap", *FAST]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "Cold reads, the same 96 reads, 2 rounds" in out, [x for x in out.splitlines() if "Cold" in x]
    assert "aioexperts io_uring" in out and "mmap copy" in out
    assert "under 1 GiB" in out
    for title in ("Cold reads", "Warm hits", "Targets", "Cost of one await"):
        line = next(x for x in out.splitlines() if x.startswith(title))
        assert len(line) <= 80


def test_progress_goes_to_stderr_as_plain_lines(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(model), "--out", "", "--mode", "reads", "--methods", "mmap", "--rounds", "2", "--no-probe"]
    assert bench.main(argv) == 0
    err = capsys.readouterr().err
    assert "recording the store's reads" in err and "\x1b[" not in err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    for option in ("--rounds", "--depth", "--threads", "--loop", "--out", "--slab-fraction", "--executor-tokens"):
        block = text.split(option, 1)[1].split("\n  -", 1)[0]
        assert "default:" in block, option


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "nope"],
        ["--methods", ","],
        ["--rounds", "0"],
        ["--depth", "2"],
        ["--depth", "4097"],
        ["--depth", "many"],
        ["--seed", "-1"],
        ["--slab-fraction", "0"],
        ["--mode", "everything"],
        ["--loop", "gevent"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 1  # one line, as every command's
    assert err.startswith("aioexperts-bench: error: ") and err.endswith(" (see --help)\n")


def test_depth_is_checked_against_its_range_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--depth", "5000"])
    assert "must be in 3..4096" in capsys.readouterr().err


def _one_error_line(captured: pytest.CaptureFixture[str]) -> str:
    """Errors go to stderr as exactly one line; stdout stays empty."""
    out, err = captured.readouterr()
    assert out == ""
    assert err.startswith("aioexperts-bench: error: ") and err.count("\n") == 1, err
    return err


def test_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--model", str(tmp_path / "none.gguf"), "--quiet", "--out", ""]) == 2  # before the run
    err = _one_error_line(capsys)
    assert f"{tmp_path / 'none.gguf'}: no such model file" in err and "--rebuild" not in err


def test_bad_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    assert bench.main(["--model", str(path), "--quiet", "--out", ""]) == 2  # bad input, as for every command
    assert "--rebuild" not in _one_error_line(capsys)  # the user's own file: no hint about the built-in one


def test_a_damaged_built_in_model_suggests_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    from aioexperts.testing import bench_model_path

    bench_model_path().parent.mkdir()
    bench_model_path().write_bytes(b"GGUF" + b"\0" * 100)  # truncated: a FormatError reading it
    assert bench.main(["--quiet", "--out", ""]) == 1
    err = _one_error_line(capsys)
    assert "the built-in model may be damaged: run again with --rebuild" in err and str(tmp_path / "cache") in err


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the bench ran although its arguments were refused")


@pytest.mark.parametrize(
    ("make_argv", "needle"),
    [
        (lambda d: ["--out", str(d / "a-file" / "results.json")], "--out"),
        (lambda d: ["--out", str(d)], "is a directory"),
        (lambda d: ["--plot", str(d / "a-file" / "img")], "--plot"),
    ],
)
def test_unwritable_outputs_are_refused_before_the_run(
    make_argv: Callable[[Path], list[str]],
    needle: str,
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "a-file").write_text("x")  # a path under a regular file cannot be created (even by root)
    monkeypatch.setattr(bench, "run_read_bench", _must_not_run)
    monkeypatch.setattr(bench, "run_token_bench", _must_not_run)
    assert bench.main(["--model", str(model), "--quiet", *make_argv(tmp_path)]) == 2
    err = _one_error_line(capsys)
    assert needle in err and "--rebuild" not in err


def test_plot_without_matplotlib_is_refused_before_the_run(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importlib.util.find_spec then says: not installed
    monkeypatch.setattr(bench, "run_read_bench", _must_not_run)
    assert bench.main(["--model", str(model), "--quiet", "--out", "", "--plot", str(tmp_path / "img")]) == 2
    err = _one_error_line(capsys)
    assert "pip install 'aioexperts[plot]'" in err and "--rebuild" not in err


def test_an_unwritable_cache_dir_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "a-file" / "cache"))
    assert bench.main(["--quiet", "--out", ""]) == 2
    err = _one_error_line(capsys)
    assert "AIOEXPERTS_CACHE" in err and "--rebuild" not in err


def test_results_that_cannot_be_written_are_still_printed(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run is done when the results file fails (disk full, removed directory): tables and a copy survive."""
    out = tmp_path / "results.json"
    real = bench.write_results

    def write_fails_at_out(path: str, results: dict) -> None:  # type: ignore[type-arg]
        if Path(path) == out:
            raise OSError(28, "No space left on device")
        real(path, results)

    monkeypatch.setattr(bench, "write_results", write_fails_at_out)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    argv = ["--model", str(model), "--out", str(out), "--mode", "reads", "--methods", "mmap", *FAST]
    assert bench.main(argv) == 1
    captured = capsys.readouterr()
    assert "Cold reads" in captured.out and "mmap copy" in captured.out
    assert captured.err.count("\n") == 1 and "No space left on device" in captured.err
    (saved,) = (tmp_path / "tmp").iterdir()
    assert str(saved) in captured.err and json.loads(saved.read_text())["reads"]
    assert not out.exists()


def test_a_failing_fio_is_one_line_and_a_failed_row(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aioexperts_bench import FioError, readbench

    calls = []

    def fio_fails(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise FioError("fio exited with status 1: fio: pid=0, err=22/file:engines/io_uring.c", ["fio"])

    monkeypatch.setattr(readbench, "fio_path", lambda: "/usr/bin/fio")
    monkeypatch.setattr(readbench, "fio_version", lambda: "fio-3.33")
    monkeypatch.setattr(readbench, "run_fio_replay", fio_fails)
    out = tmp_path / "r.json"
    argv = ["--model", str(model), "--out", str(out), "--mode", "reads", "--methods", "fio,mmap", "--rounds", "2"]
    assert bench.main([*argv, "--no-probe"]) == 0
    captured = capsys.readouterr()
    fio_lines = [line for line in captured.err.splitlines() if "fio exited" in line]
    assert len(fio_lines) == 1 and "status 1" in fio_lines[0] and "Traceback" not in captured.err
    assert len(calls) == 1  # left out of the later rounds
    row = next(line for line in captured.out.splitlines() if "fio replay" in line)
    assert "failed" in row
    results = json.loads(out.read_text())
    assert "status 1" in results["reads"]["failed"]["fio"]
    assert next(t for t in results["targets"] if t["name"] == "x_fio")["met"] is None
    assert "make render RESULTS=" in captured.out  # the last line: a command that works in a clone


def test_ctrl_c_prints_one_line_and_writes_nothing(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_read_bench", interrupted)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(model), "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_default_model_is_built_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    import aioexperts.testing._model_cache as model_cache

    monkeypatch.setattr(model_cache, "BENCH_SPEC", SMALL)
    argv = ["--mode", "reads", "--methods", "mmap", "--rounds", "1", "--no-probe", "--json", "--out", ""]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["model"]["builtin"] and Path(out["model"]["path"]).parent == tmp_path / "cache"
    assert "building the built-in model once" in captured.err


@pytest.mark.parametrize("json_out", [False, True])
def test_a_closed_pipe_ends_the_bench_quietly(model: Path, json_out: bool) -> None:
    """``aioexperts-bench | head``: no "Broken pipe" error, no traceback, the status of SIGPIPE."""
    argv = [str(Path(sys.executable).parent / "aioexperts-bench"), "--model", str(model), "--out", ""]
    argv += ["--mode", "reads", "--methods", "mmap", "--rounds", "1", "--no-probe", "--quiet"]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*argv, *(["--json"] if json_out else [])],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize(("blocked", "extra"), [("rich", "bench"), ("rich.console", "bench")])
def test_a_missing_extra_is_one_line_naming_the_extra(blocked: str, extra: str) -> None:
    """Without the bench extra, the command says which package to install, in one line, no traceback."""
    code = f"import sys; sys.modules[{blocked!r}] = None; from aioexperts.cli.bench import main"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    root = blocked.partition(".")[0]
    assert run.returncode == 1
    assert run.stderr == f"aioexperts-bench: error: {root} is not installed: pip install 'aioexperts[{extra}]'\n"


def test_a_missing_module_that_is_no_extra_is_not_hidden() -> None:
    """Only the optional extras get the one-line message; any other missing module keeps its traceback."""
    code = "import sys; sys.modules['aioexperts_bench.sweep'] = None; from aioexperts.cli.bench import main"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1 and "Traceback" in run.stderr and "ModuleNotFoundError" in run.stderr


def test_the_thread_pool_store_gives_warm_figures_and_a_timeline_of_phases(model: Path, tmp_path: Path) -> None:
    """Without io_uring: the warm hit follows the thread-pool store's pass; the timeline splits a token."""
    out = tmp_path / "results.json"
    assert bench.main(["--model", str(model), "--out", str(out), "--methods", "aioexperts-threads", *FAST]) == 0
    results = json.loads(out.read_text())
    warm = results["reads"]["warm"]["store"]
    assert warm["experts_single_us_per_hit"]["median"] > 0 and warm["experts_single_calls"]["median"] > 0
    timeline = results["tokens"]["timeline"]
    phases = timeline["phases"]
    assert [p["layer"] for p in phases] == [0, 1]
    for p in phases:
        assert min(p["route_ms"], p["wait_ms"], p["compute_ms"], p["handoff_ms"], p["io_wait_ms"]) >= 0
        assert p["io_wait_ms"] <= p["wait_ms"]  # the wait for experts lies between the route and the compute
    totals = timeline["phase_totals_ms"]
    covered = sum(totals[k] for k in ("route_ms", "wait_ms", "compute_ms", "handoff_ms"))
    assert covered + totals["before_first_route_ms"] == pytest.approx(timeline["token_ms"])
    loop = timeline["loop_thread_ms"]
    assert loop["submit_ms"] >= 0 and loop["reap_ms"] >= 0 and loop["reaps"] >= 0
