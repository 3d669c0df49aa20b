"""The bench CLIs' answers to misuse found by a new-user trial: checked before any run, one line and
exit status 2, and nothing of the user's written through a fixed ``OUT.tmp`` or a symlink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aioexperts.cli import bench, tiertool
from aioexperts.testing import SyntheticSpec, write_synthetic_model

REPO = Path(__file__).parents[2]
SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2)


def generate_args(model: Path, *extra: str) -> list[str]:
    return [
        "--mode",
        "generate",
        "--model",
        str(model),
        "--engines",
        "aioexperts",
        "--limits",
        "none",
        "--rounds",
        "1",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--quiet",
        *extra,
    ]


def timeline_args(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--mode",
        "timeline",
        "--model",
        str(model),
        "--limit",
        "none",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--picture-tokens",
        "2",
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


def test_results_go_through_a_private_temporary_file_never_out_tmp(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's ``OUT.tmp`` (a file, or a symlink to one) is neither replaced nor written through."""
    precious = tmp_path / "precious"
    precious.write_text("mine")
    out = tmp_path / "gen.json"
    (tmp_path / "gen.json.tmp").symlink_to(precious)
    assert bench.main([*generate_args(tiny_full_model), "--out", str(out)]) == 0
    tl = tmp_path / "tl.json"
    (tmp_path / "tl.json.tmp").write_text("also mine")
    (tmp_path / "tl.svg.tmp").symlink_to(precious)
    assert bench.main(timeline_args(tiny_full_model, tl)) in (0, 1)
    assert precious.read_text() == "mine"
    assert (tmp_path / "tl.json.tmp").read_text() == "also mine"
    assert json.loads(out.read_text())["runs"] and not out.is_symlink()
    assert tl.exists() and (tmp_path / "tl.svg").read_text().startswith("<svg")
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert leftovers == []


def test_a_model_without_a_vocabulary_is_refused_before_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "experts.gguf"
    write_synthetic_model(model, SMALL)
    for args in (generate_args(model, "--out", ""), timeline_args(model, tmp_path / "t.json")):
        assert bench.main(args) == 2
        err = capsys.readouterr().err
        assert "carries no tokenizer" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("where", ["no/such/dir/out.json", "adir"])
def test_outputs_that_cannot_be_made_are_refused_before_the_run(
    tiny_full_model: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "adir").mkdir()
    out = str(tmp_path / where)
    assert bench.main([*generate_args(tiny_full_model), "--out", out]) == 2
    assert out in capsys.readouterr().err
    assert bench.main(timeline_args(tiny_full_model, tmp_path / "t.json", "--svg", out)) == 2
    err = capsys.readouterr().err
    assert out in err and ".tmp" not in err
    assert not (tmp_path / "t.json").exists()  # nothing ran


def test_timeline_refusals_exit_2(tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    foreign = tmp_path / "notes.txt"
    foreign.write_text("notes")
    assert bench.main(timeline_args(tiny_full_model, tiny_full_model)) == 2  # the model itself
    assert bench.main(timeline_args(tiny_full_model, tmp_path / "t.json", "--svg", str(foreign))) == 2
    assert foreign.read_text() == "notes"


def test_a_symlink_output_is_never_replaced_even_with_force(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    assert bench.main([*generate_args(tiny_full_model), "--out", str(link), "--force"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and target.read_text() == "{}"


def test_a_wrong_sidecar_is_refused_before_a_run(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "experts.gguf"
    write_synthetic_model(other, SMALL)
    stale = tmp_path / "experts.miss-tier-Q2_K.gguf"
    assert tiertool.main([str(other), "--type", "Q2_K", "-o", str(stale), "--quiet"]) == 0
    previous = tmp_path / "tl.json"
    previous.write_text('{"keep": true}')
    for missing_or_stale in (tmp_path / "nosuch.gguf", stale):
        code = bench.main(
            [
                *generate_args(tiny_full_model),
                "--out",
                "",
                "--engines",
                "aioexperts-tier",
                "--miss-tier",
                str(missing_or_stale),
            ]
        )
        assert code == 2
        err = capsys.readouterr().err
        assert "--miss-tier" in err and "Traceback" not in err
        code = bench.main(
            timeline_args(
                tiny_full_model, previous, "--engine", "aioexperts-tier", "--miss-tier", str(missing_or_stale)
            )
        )
        assert code == 2
    assert previous.read_text() == '{"keep": true}'


def test_tier_rules_without_the_tier_engine_and_huge_values_are_usage_errors(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        bench.main([*generate_args(tiny_full_model), "--out", "", "--miss-tier-weight", "0.1"])
    assert raised.value.code == 2
    with pytest.raises(SystemExit) as raised:
        bench.main([*generate_args(tiny_full_model), "--out", "", "--rounds", "99999999999999"])
    assert raised.value.code == 2
    with pytest.raises(SystemExit) as raised:
        bench.main(timeline_args(tiny_full_model, tmp_path / "t.json", "--picture-tokens", "9"))
    assert raised.value.code == 2
    with pytest.raises(SystemExit) as raised:
        bench.main(["--rebuild", "--model", str(tiny_full_model)])
    assert raised.value.code == 2
    with pytest.raises(SystemExit) as raised:
        bench.main(["--model", str(tiny_full_model), "--threads", "100000"])
    assert raised.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_limit_below_what_a_process_needs_is_refused(
    tiny_full_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main([*generate_args(tiny_full_model), "--out", "", "--limits", "1/4"]) == 2
    assert "MiB" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["matvec_rows.py", "model_speed.py", "distributed.py"])
@pytest.mark.parametrize("results", ["missing", "dir", "text", "foreign"])
def test_render_scripts_give_one_line_for_a_bad_results_file(script: str, results: str, tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    regions = [
        f"<!-- bench:{r} -->\nx\n<!-- /bench:{r} -->" for r in ("matvec_rows", "model_speed", "distributed_shards")
    ]
    doc.write_text("\n".join(regions) + "\n")
    before = doc.read_text()
    path = tmp_path / "r.json"
    if results == "dir":
        path.mkdir()
    elif results == "text":
        path.write_text("not json")
    elif results == "foreign":
        path.write_text('{"benchmark": "something else"}')
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--render", str(path), str(doc)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert doc.read_text() == before


def test_render_of_a_reads_only_results_file_leaves_the_regions_it_has_no_data_for(tmp_path: Path) -> None:
    model = tmp_path / "experts.gguf"
    write_synthetic_model(model, SMALL)
    out = tmp_path / "reads.json"
    args = ["--mode", "reads", "--model", str(model), "--out", str(out), "--methods", "pread", "--rounds", "1"]
    assert bench.main([*args, "--no-probe", "--quiet"]) == 0
    assert "tokens" not in json.loads(out.read_text())
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- bench:reads -->\nold\n<!-- /bench:reads -->\n<!-- bench:tokens -->\nold\n<!-- /bench:tokens -->\n"
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "render.py"), str(out), "--write", str(doc)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert "<!-- bench:tokens -->\nold\n<!-- /bench:tokens -->" in text  # left as it was
    assert "rendered by bench/render.py" in text.split("<!-- bench:tokens -->")[0]
    assert "tokens: not in" in proc.stderr
