"""Every command says a missing, directory or unreadable model file in the same words, exit 2, no traceback.

``aioexperts-bench`` (each mode), ``-map``, ``-tier``, ``-trace --model``, ``-run`` and ``-serve`` all
check the file with one helper (``model_file`` of ``aioexperts/cli/_common.py``) before they read or load anything
(``aioexperts-bench``, ``-map`` and ``-tier`` used to print ``[Errno 2] ...``, the bench with exit 1).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from aioexperts.cli import bench, maptool, run, serve, tiertool, tracetool

Main = Callable[[Sequence[str]], int]

#: (command, its main, its arguments with MODEL for the model file; every other file named is in OUT)
COMMANDS: list[tuple[str, Main, list[str]]] = [
    ("aioexperts-bench", bench.main, ["--model", "MODEL", "--out", "OUT/results.json"]),
    ("aioexperts-bench", bench.main, ["--mode", "generate", "--model", "MODEL", "--out", "OUT/generate.json"]),
    ("aioexperts-bench", bench.main, ["--mode", "timeline", "--model", "MODEL", "--out", "OUT/timeline.json"]),
    ("aioexperts-map", maptool.main, ["layout", "MODEL"]),
    ("aioexperts-map", maptool.main, ["write", "MODEL", "-o", "OUT/map.weepf"]),
    ("aioexperts-tier", tiertool.main, ["MODEL", "-o", "OUT/sidecar.gguf"]),
    ("aioexperts-trace", tracetool.main, ["summary", "OUT/none.npz", "--model", "MODEL"]),
    ("aioexperts-run", run.main, ["MODEL", "-p", "Hi"]),
    ("aioexperts-serve", serve.main, ["MODEL", "--port", "0"]),
]


def _call(main: Main, argv: Sequence[str]) -> int | str | None:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own exit
        return exc.code


def _unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``path`` exists and this user may not open it (root may open any file: its open is refused here)."""
    path.write_bytes(b"GGUF")
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = os.open

        def refusing_open(name: str | os.PathLike[str], flags: int, *args: int, **kwargs: int) -> int:
            if os.fspath(name) == os.fspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(name))
            return real_open(name, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)


@pytest.mark.parametrize(("prog", "main", "args"), COMMANDS, ids=[f"{c[0]} {c[2][0]} {c[2][1]}" for c in COMMANDS])
@pytest.mark.parametrize("case", ["missing", "directory", "unreadable"])
def test_a_bad_model_file_is_one_line_in_the_same_words_and_exit_2(
    prog: str,
    main: Main,
    args: list[str],
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if case == "missing":
        model, want = tmp_path / "no-such.gguf", "no such model file"
    elif case == "directory":
        model, want = tmp_path / "a-folder.gguf", "is a directory, not a model file"
        model.mkdir()
    else:
        model, want = tmp_path / "locked.gguf", "cannot read the model file (Permission denied)"
        _unreadable(model, monkeypatch)
    argv = [str(model) if a == "MODEL" else a.replace("OUT", str(out)) for a in args]

    status = _call(main, argv)

    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [f"{prog}: error: {model}: {want}"], captured.err
    assert "Traceback" not in captured.err and "Errno" not in captured.err
    assert os.listdir(out) == []  # nothing written


def test_the_home_directory_is_expanded_and_a_fifo_refused_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # found under ~: read, and refused as a GGUF file
    assert maptool.main(["layout", "~/m.gguf"]) == 2
    err = capsys.readouterr().err
    assert "no such model file" not in err and str(tmp_path / "m.gguf") in err, err
    os.mkfifo(tmp_path / "pipe.gguf")  # an open for reading would wait for a writer for ever
    assert maptool.main(["layout", str(tmp_path / "pipe.gguf")]) == 2
    err = capsys.readouterr().err
    assert err == f"aioexperts-map: error: {tmp_path / 'pipe.gguf'}: not a regular file, not a model file\n"


@pytest.mark.parametrize("command", ["summary", "order"])
@pytest.mark.parametrize("case", ["missing", "directory"])
def test_a_bad_trace_file_is_one_line_and_exit_2(
    command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``aioexperts-trace summary|order TRACE`` checks TRACE as the model files are checked (it printed
    ``[Errno 2] No such file or directory: ...``)."""
    trace = tmp_path / "trace.npz"
    if case == "directory":
        trace.mkdir()
    argv = [command, str(trace)] + (["-o", str(tmp_path / "order.json")] if command == "order" else [])
    assert tracetool.main(argv) == 2
    captured = capsys.readouterr()
    want = "no such trace file" if case == "missing" else "is a directory, not a trace file"
    assert captured.out == "" and captured.err == f"aioexperts-trace: error: {trace}: {want}\n", captured.err


@pytest.mark.parametrize(("prog", "main"), [("aioexperts-run", run.main), ("aioexperts-serve", serve.main)])
@pytest.mark.parametrize("case", ["under-a-file", "cannot-create"])
def test_a_bad_cache_folder_is_one_line_and_exit_2(
    prog: str,
    main: Main,
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The built-in model cannot be written into ``$AIOEXPERTS_CACHE``: one line naming the folder, the
    reason and what to do, exit 2 (it printed ``[Errno 20] ...``; an unwritable folder a traceback)."""
    if case == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        cache, why = tmp_path / "a-file" / "cache", "a file stands where a folder of that path should be"
    else:  # a folder that cannot be made (root may write anywhere, so a failing mkdir stands for it)
        cache, why = tmp_path / "cache", f"Permission denied: {tmp_path / 'cache'}"

        def refusing_mkdir(self: Path, *args: object, **kwargs: object) -> None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(self))

        monkeypatch.setattr(Path, "mkdir", refusing_mkdir)
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(cache))
    argv = ["-p", "Hi", "--layers", "1"] if prog == "aioexperts-run" else ["--port", "0", "--layers", "1"]
    status = _call(main, argv)
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [
        f"{prog}: error: cannot write the built-in model into {cache} ({why}); set $AIOEXPERTS_CACHE to a "
        "writable folder, or give a MODEL file"
    ], captured.err


def test_an_os_error_is_one_line_without_its_errno() -> None:
    from aioexperts.cli._common import error_text

    assert error_text(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y")) == (
        "/x/y: No such file or directory"
    )
    assert error_text(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == (
        "/a: /b: Invalid cross-device link"
    )
    assert error_text(OSError("plain")) == "plain" and error_text(ValueError("v")) == "v"
