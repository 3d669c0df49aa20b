"""``aioexperts-tier``: writes the sidecar, replaces only its own kind, never the model; errors exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._format.tier_sidecar import read_tier_sidecar
from aioexperts.cli.tiertool import default_output, main
from aioexperts.testing import SyntheticSpec, write_synthetic_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    return path


def test_writes_a_sidecar_the_store_accepts(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model), "--type", "IQ4_XS"]) == 0
    out = default_output(str(model), "IQ4_XS")
    done = capsys.readouterr()
    assert done.out.strip() == out and out.endswith("m.miss-tier-IQ4_XS.gguf")
    # a sidecar under 1 MB: its progress in kB, not "0 of 0 MB written"
    assert re.search(r"^aioexperts-tier: [\d.]+ of [\d.]+ kB written \(100 %\)$", done.err, re.M), done.err
    assert " 0 of 0 MB" not in done.err
    gguf = open_model(model)
    assert read_tier_sidecar(out, gguf, build_layout(gguf)).ggml_type.name == "IQ4_XS"
    assert main([str(model), "--type", "IQ4_XS", "--quiet"]) == 0  # its own kind: replaced


def test_refuses_to_write_over_the_model_or_another_file(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model), "-o", str(model)]) == 2
    assert "is the input" in capsys.readouterr().err
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    assert main([str(model), "-o", str(other)]) == 2
    assert other.read_text() == "keep me"
    assert main([str(model), "-o", str(other), "--force", "--quiet"]) == 0
    assert main([str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x.gguf")]) == 2


def test_an_output_in_a_missing_folder_names_the_users_path(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the temporary ``.NAME.PID.tmp`` written beside it (as ``aioexperts-map write -o``)."""
    target = tmp_path / "no-such-dir" / "x.gguf"
    assert main([str(model), "-o", str(target), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"aioexperts-tier: error: {target}: No such file or directory\n", err
    assert not (tmp_path / "no-such-dir").exists()


@pytest.mark.parametrize("command", ["tiertool", "run", "serve", "maptool", "tracetool", "bench"])
def test_help_is_plain_user_facing_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` shows no reST markup (double backticks, ``:func:`` roles) and no issue numbers of the
    project's tracker (``aioexperts-tier --help`` printed its module docstring)."""
    import importlib

    main = importlib.import_module(f"aioexperts.cli.{command}").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ")
    assert "``" not in text and not re.search(r":\w+:`", text) and not re.search(r"\bissue \d", text), text


def test_ctrl_c_is_one_line_and_status_130_with_no_file_left(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt in the middle of the write (raised from the first progress line) was a
    traceback: one line, exit status 130, and neither the sidecar nor its temporary file is left."""
    from aioexperts.cli import tiertool

    def interrupt(done: int, total: int) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiertool, "progress_bytes", interrupt)
    try:
        status = main([str(model), "-o", str(tmp_path / "x.gguf"), "--type", "Q2_K"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left main()")  # not the pytest session
    assert status == 130
    done = capsys.readouterr()
    assert done.out == "" and done.err == "aioexperts-tier: interrupted\n", done.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_never_writes_over_another_shard_of_a_split_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--force`` replaced shard 2 of the split set it read (the model then no longer opened)."""
    write_synthetic_model(
        tmp_path / "s.gguf", SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2), shards=3
    )
    first, second = tmp_path / "s-00001-of-00003.gguf", tmp_path / "s-00002-of-00003.gguf"
    before = second.read_bytes()
    assert main([str(first), "-o", str(second), "--force", "--quiet"]) == 2
    assert "is the input" in capsys.readouterr().err
    assert second.read_bytes() == before
    assert len(open_model(first).shards) == 3


def test_a_file_planted_at_a_guessable_temporary_name_is_not_written(model: Path, tmp_path: Path) -> None:
    """The temporary file was ``.OUT.PID.tmp``, opened through a symlink planted there: the file it
    pointed to was overwritten. It is a fresh file of its own now (``mkstemp``)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "x.gguf"
    (tmp_path / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim)
    assert main([str(model), "-o", str(out), "--type", "Q2_K", "--quiet"]) == 0
    assert victim.read_text() == "keep me"
    assert not out.is_symlink() and out.stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".{out.name}.{os.getpid()}.tmp", "m.gguf", "victim.txt", "x.gguf"]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


TIER_IN_A_CHILD = """
import os, signal, sys
from aioexperts.cli import tiertool
def progress(done, total):
    if sys.argv[1] == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    return "?"
tiertool.progress_bytes = progress
raise SystemExit(tiertool.main([sys.argv[2], "-o", sys.argv[3], "--type", "Q2_K"]))
"""


def test_sigterm_removes_the_partial_file_and_exits_143(model: Path, tmp_path: Path) -> None:
    """SIGTERM's default action killed the writer and left a hidden file of the sidecar's size."""
    out = tmp_path / "x.gguf"
    done = subprocess.run(
        [sys.executable, "-c", TIER_IN_A_CHILD, "term", str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 143 and done.stderr.endswith("aioexperts-tier: terminated\n"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_closed_stdout_exits_141_quietly_with_the_sidecar_written(model: Path, tmp_path: Path) -> None:
    """``aioexperts-tier ... | true`` ended with a BrokenPipeError traceback and status 1."""
    out = tmp_path / "x.gguf"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        cmd = [str(Path(sys.executable).parent / "aioexperts-tier"), str(model), "-o", str(out), "--quiet"]
        done = subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr
    assert out.is_file()


def test_a_temporary_name_swapped_for_a_symlink_never_writes_its_target(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar is written through the ``mkstemp`` descriptor: a name swapped for a symlink right
    after it was made (someone with write access to the folder) leaves the link's target as it was,
    and the write fails instead of renaming the link into place."""
    import tempfile

    from aioexperts import write_miss_tier
    from aioexperts._quant import sidecar

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    real = tempfile.mkstemp

    def swapped(*args: object, **kwargs: object) -> tuple[int, str]:
        fd, name = real(*args, **kwargs)  # type: ignore[call-overload]
        os.unlink(name)
        os.symlink(victim, name)
        return fd, name

    monkeypatch.setattr(sidecar.tempfile, "mkstemp", swapped)
    out = tmp_path / "x.gguf"
    with pytest.raises(OSError, match="replaced"):
        write_miss_tier(model, out, "Q2_K")
    assert victim.read_text() == "keep me" and not out.exists()


def test_an_output_naming_a_directory_or_nothing_is_refused_and_tilde_is_home(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o DIR/`` wrote a file named DIR, ``-o ''`` the default path, ``-o ~/x`` a folder named ``~``."""
    assert main([str(model), "-o", f"{tmp_path}/newdir/", "--quiet"]) == 2
    assert "names a directory, not a file" in capsys.readouterr().err
    assert not (tmp_path / "newdir").exists()
    assert main([str(model), "-o", "", "--quiet"]) == 2
    assert "the sidecar's path is empty" in capsys.readouterr().err
    assert not os.path.exists(default_output(str(model), "Q3_K"))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert main([str(model), "-o", "~/x.gguf", "--quiet"]) == 0
    assert (home / "x.gguf").is_file() and not (tmp_path / "~").exists()
