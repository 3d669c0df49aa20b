"""The built-in models in the user cache: written once (with progress), reused after, safely when two runs race.

:func:`ensure_bench_model` is the MoE-only bench model (:data:`BENCH_SPEC`, ``aioexperts-bench``);
:func:`ensure_full_model` the whole model of :func:`write_full_model` (``aioexperts-run``,
``aioexperts-serve``, ``aioexperts-bench --mode generate``); both live in :func:`cache_dir`.

Two runs started at once must not write the same file: the builder holds an exclusive ``flock`` on
``NAME.lock`` beside the model and writes a uniquely named temporary file that is renamed into
place when complete. A second run waits for the lock, then finds the
finished model and reuses it. A build that fails or is interrupted (Ctrl-C) removes its
temporary file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from ._full_model import DEFAULT_FULL_LAYERS, FULL_SPEC, FullModelSpec, Progress, write_full_model
from ._synthetic import BENCH_SPEC, SyntheticSpec, write_synthetic_model

__all__ = (
    "BENCH_NAME",
    "Progress",
    "bench_model_path",
    "cache_dir",
    "ensure_bench_model",
    "ensure_full_model",
    "full_model_path",
    "print_progress",
)

#: File name of the built-in model; the suffix changes whenever the generator's output does.
BENCH_NAME = "qwen3-30b-a3b-geometry-q4_k-8l-v2.gguf"


def cache_dir() -> Path:
    """``$AIOEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/aioexperts``, else ``~/.cache/aioexperts``."""
    explicit = os.environ.get("AIOEXPERTS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aioexperts"


def bench_model_path() -> Path:
    """Where the built-in model lives (it may not exist yet)."""
    return cache_dir() / BENCH_NAME


@contextlib.contextmanager
def _locked(lock_path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def ensure_bench_model(
    *,
    rebuild: bool = False,
    spec: SyntheticSpec | None = None,
    path: Path | None = None,
    on_build: Callable[[Path], None] | None = None,
    on_wait: Callable[[], None] | None = None,
    progress: Progress | None = None,
    write: Callable[[Path, Progress | None], object] | None = None,
) -> Path:
    """The built-in model's path, building it first when it is missing (or ``rebuild``).

    Args:
        rebuild: write the model again even if it exists (a run that waited for another
            builder that finished after this call started reuses that fresh file instead).
        spec: the geometry (default :data:`BENCH_SPEC`; tests pass a small one).
        path: where to put it (default :func:`bench_model_path`).
        on_build: called with the path before a build starts.
        on_wait: called once if another process holds the build lock.
        progress: ``(bytes written, total)`` during a build.
        write: writes the model to the temporary path it is given, with ``progress`` (default: the
            MoE-only model of ``spec``); another built-in model passes its own writer and ``path``.

    Returns:
        The model's path.

    Raises:
        OSError: the cache directory cannot be written.
    """
    target = path or bench_model_path()
    if target.exists() and not rebuild:
        return target
    started = time.time()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(target.name + ".lock"), on_wait or (lambda: None)):
        if target.exists() and (not rebuild or target.stat().st_mtime >= started):
            return target  # built by another run while we waited
        if on_build is not None:
            on_build(target)
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if write is None:
                write_synthetic_model(tmp, spec or BENCH_SPEC, progress=progress)
            else:
                write(tmp, progress)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target


def full_model_path(n_layer: int = DEFAULT_FULL_LAYERS) -> Path:
    """Where the built-in full model of ``n_layer`` layers lives in the cache (it may not exist yet)."""
    return cache_dir() / FULL_SPEC.with_(n_layer=n_layer).file_name()


def print_progress(stream: TextIO | None = None) -> Progress:
    """A ``progress`` callback that prints a line at every tenth of the bytes (stderr by default)."""
    out = stream or sys.stderr
    last = [-1]

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"  written {done / 1e9:.2f} of {total / 1e9:.2f} GB", file=out, flush=True)

    return progress


def ensure_full_model(
    n_layer: int = DEFAULT_FULL_LAYERS,
    *,
    rebuild: bool = False,
    spec: FullModelSpec | None = None,
    path: Path | None = None,
    progress: Progress | None = None,
    on_build: Callable[[Path], None] | None = None,
    on_wait: Callable[[], None] | None = None,
) -> Path:
    """The built-in full model's path, written first when it is missing (or ``rebuild``).

    Two processes that ask at once build it once (the lock of :func:`ensure_bench_model`).

    Args:
        n_layer: layers (default :data:`DEFAULT_FULL_LAYERS`; 48 is the real model's depth,
            about 17 GB).
        rebuild: write it again even if it exists.
        spec: the whole geometry instead (its ``n_layer`` wins over ``n_layer``).
        path: where to put it (default :func:`full_model_path`).
        progress: ``(bytes written, total)`` during a build (e.g. :func:`print_progress`).
        on_build: called with the path before a build starts.
        on_wait: called once if another process is building it.

    Returns:
        The model's path.

    Raises:
        ConfigError: a bad spec or ``tokenizers`` missing.
        OSError: the cache directory cannot be written.
    """
    chosen = spec or FULL_SPEC.with_(n_layer=n_layer)
    chosen.check()
    target = path or cache_dir() / chosen.file_name()

    def write(tmp: Path, report: Progress | None) -> None:
        write_full_model(tmp, chosen, progress=report)

    return ensure_bench_model(
        rebuild=rebuild, path=target, on_build=on_build, on_wait=on_wait, progress=progress, write=write
    )
