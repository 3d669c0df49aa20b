"""The built-in full model in the user cache: written once (with progress), reused after.

The writer is :func:`aioexperts.testing.write_full_model`; the cache folder, the build-once lock
and ``--rebuild`` are the bench model's (:func:`aioexperts._bench.model_cache.ensure_bench_model`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from ..testing._full_model import DEFAULT_FULL_LAYERS, FULL_SPEC, FullModelSpec, Progress, write_full_model
from .model_cache import cache_dir, ensure_bench_model

__all__ = ("DEFAULT_FULL_LAYERS", "ensure_full_model", "full_model_path", "print_progress")


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

    Two processes that ask at once build it once (the lock of :func:`aioexperts._bench.model_cache.ensure_bench_model`).

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
