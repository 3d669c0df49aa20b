"""The built-in bench model (``aioexperts-bench``'s): built once into the cache directory, safely when two runs race.

Two ``aioexperts-bench`` runs started at once build it once (:func:`aioexperts.testing._cache.build_once`:
an exclusive ``flock`` on ``NAME.lock`` beside the model, a temporary file renamed into place when
complete, removed when the build fails or is interrupted).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ._cache import Progress, build_once, cache_dir
from ._synthetic import BENCH_SPEC, SyntheticSpec, write_synthetic_model

__all__ = ("BENCH_NAME", "bench_model_path", "cache_dir", "ensure_bench_model")

#: File name of the built-in model; the suffix changes whenever the generator's output does.
BENCH_NAME = "qwen3-30b-a3b-geometry-q4_k-8l-v2.gguf"


def bench_model_path() -> Path:
    """Where the built-in model lives (it may not exist yet)."""
    return cache_dir() / BENCH_NAME


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

    def write_moe(tmp: Path, report: Progress | None) -> None:
        write_synthetic_model(tmp, spec or BENCH_SPEC, progress=report)

    return build_once(
        path or bench_model_path(),
        write or write_moe,
        rebuild=rebuild,
        on_build=on_build,
        on_wait=on_wait,
        progress=progress,
    )
