"""``aioexperts-bench`` end to end on a small model: both modes, JSON output, errors, the cached model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aioexperts._cli import bench
from aioexperts._cli.synthetic import SyntheticSpec, write_synthetic_model

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff=256, n_expert=16, n_expert_used=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert bench.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_reads_mode_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "--model",
        str(model),
        "--repeat",
        "1",
        "--json",
        "--methods",
        "io_uring,threads,buffered,mmap",
    )
    rows = {(r["method"], r["phase"]): r for r in out["reads"]}
    assert set(rows) == {
        (m, p)
        for m in ("aioexperts io_uring", "aioexperts threads", "buffered pread", "mmap")
        for p in ("cold", "warm")
    }
    expert_bytes = SMALL.expert_bytes()
    for r in rows.values():
        assert r["n_experts"] == 2 * 16  # every expert of both layers, once per pass
        assert r["payload_bytes"] == 32 * expert_bytes
        assert r["gb_per_s"] > 0 and r["cpu_s_per_gib"] >= 0
    assert "0 hits / 32 misses" in rows[("aioexperts io_uring", "cold")]["note"]
    assert "32 hits / 0 misses" in rows[("aioexperts io_uring", "warm")]["note"]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_baseline(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--model", str(model), "--repeat", "1", "--json", "--methods", "fio")
    (row,) = out["reads"]
    assert row["method"] == "fio" and row["payload_bytes"] > 0 and "iodepth=64" in row["note"]


def test_tokens_mode_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--model", str(model), "--mode", "tokens", "--tokens", "3", "--repeat", "1", "--json")
    tokens = out["tokens"]
    names = [r["name"] for r in tokens["runs"]]
    assert names[:4] == [
        "io only (oracle prefetch)",
        "io only, one core busy elsewhere",
        "serial (no prefetch)",
        "pipelined (oracle)",
    ]
    oracle = tokens["runs"][3]
    assert oracle["prefetch_hits"] > 0 and oracle["tokens"] == 3
    assert tokens["overlap"] > 0 and tokens["compute"] == "synthetic"
    assert [r["name"].split()[1] for r in tokens["policies"]] == ["lru", "lfu", "lfuda"]
    assert set(tokens["replay"]) == {"uniform", "skewed"}
    for by_policy in tokens["replay"]["skewed"].values():
        assert by_policy["belady"] >= max(by_policy["lru"], by_policy["lfu"], by_policy["lfuda"])


def test_table_output(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--model", str(model), "--repeat", "1", "--methods", "io_uring,mmap"]) == 0
    text = capsys.readouterr().out
    assert "per-expert read rates" in text and "aioexperts io_uring" in text and "x mmap" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "nope"],
        ["--methods", ","],
        ["--repeat", "0"],
        ["--depth", "2"],
        ["--seed", "-1"],
        ["--slab-fraction", "0"],
        ["--mode", "everything"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--model", str(tmp_path / "none.gguf"), "--repeat", "1"]) == 1
    assert "error:" in capsys.readouterr().out


def test_bad_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    assert bench.main(["--model", str(path), "--repeat", "1"]) == 1
    assert "error:" in capsys.readouterr().out


def test_default_model_is_built_once_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench, "BENCH_SPEC", SMALL)
    console = bench.Console(file=None)
    first = bench.default_model_path(console)
    assert first.parent == tmp_path / "cache" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert bench.default_model_path(console) == first and first.stat().st_mtime_ns == stamp
    assert not list(first.parent.glob("*.partial*"))
    assert "building the bench model once" in capsys.readouterr().out
    out = run_json(capsys, "--repeat", "1", "--json", "--methods", "io_uring")
    assert out["model"] == str(first)
