"""The built-in full model in the user cache: written once (with progress), reused after.

:func:`builtin_model_path` is what the examples of README.md and docs/ open: the path of the
built-in full model (:func:`~aioexperts.testing.write_full_model` of :data:`FULL_SPEC`, about
2.9 GB), written into :func:`~aioexperts.testing._cache.cache_dir` the first time. With
``$AIOEXPERTS_BUILTIN_SIZE=tiny`` it is :data:`TINY_FULL_SPEC` instead: the same architecture,
tokenizer and chat template at a test size (about 2 MB, written in a second or two), which is what
the docs' examples run against in the tests.

:func:`ensure_dsv4_model` is the built-in DeepSeek-V4-Flash-geometry model
(:func:`~aioexperts.testing.write_dsv4_model` of :data:`DSV4_SPEC`, 4 layers: about 9.1 GB) in the
same cache: what the benches run for ``--model dsv4-flash``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .._errors import ConfigError
from ._cache import Progress, build_once, cache_dir, print_progress
from ._dsv4_model import DSV4_SPEC, DSV4Spec, write_dsv4_model
from ._full_model import DEFAULT_FULL_LAYERS, FULL_SPEC, FullModelSpec, write_full_model

__all__ = (
    "BUILTIN_SIZE_ENV",
    "TINY_FULL_SPEC",
    "builtin_model_path",
    "dsv4_model_path",
    "ensure_dsv4_model",
    "ensure_full_model",
    "full_model_path",
)

#: The built-in full model at a test size: 2 layers, small dims, a 600-token vocabulary.
TINY_FULL_SPEC = FULL_SPEC.with_(
    n_layer=2,
    n_embd=256,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_expert=4,
    n_expert_used=2,
    n_ff_exp=256,
    vocab_size=600,
    context_length=4096,
)

#: The environment variable that chooses the size of :func:`builtin_model_path`'s model.
BUILTIN_SIZE_ENV = "AIOEXPERTS_BUILTIN_SIZE"
_SIZES = {"full": FULL_SPEC, "tiny": TINY_FULL_SPEC}


def full_model_path(n_layer: int = DEFAULT_FULL_LAYERS) -> Path:
    """Where the built-in full model of ``n_layer`` layers lives in the cache (it may not exist yet)."""
    return cache_dir() / FULL_SPEC.with_(n_layer=n_layer).file_name()


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

    Two processes that ask at once build it once (:func:`aioexperts.testing._cache.build_once`).

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

    return build_once(
        target,
        write,
        rebuild=rebuild,
        on_build=on_build,
        on_wait=on_wait,
        progress=progress,
        needs_bytes=chosen.tensor_bytes(),
    )


def dsv4_model_path(n_layer: int = DSV4_SPEC.n_layer) -> Path:
    """Where the built-in DeepSeek-V4-geometry model of ``n_layer`` layers lives in the cache (it may not exist yet)."""
    return cache_dir() / DSV4_SPEC.with_(n_layer=n_layer).file_name()


def ensure_dsv4_model(
    n_layer: int = DSV4_SPEC.n_layer,
    *,
    rebuild: bool = False,
    spec: DSV4Spec | None = None,
    path: Path | None = None,
    progress: Progress | None = None,
    on_build: Callable[[Path], None] | None = None,
    on_wait: Callable[[], None] | None = None,
) -> Path:
    """The built-in DeepSeek-V4-geometry model's path, written first when it is missing (or ``rebuild``).

    The model is :data:`DSV4_SPEC` (DeepSeek-V4-Flash's shapes: 256 routed experts of width 2048 per
    layer, top-6, Q2_K experts, random weights) with ``n_layer`` layers, about 2.3 GB per layer
    (4 layers, the default: about 9.1 GB). Two processes that ask at once build it once.

    Args:
        n_layer: layers (the default 4 has each attention kind: window, window, CSA, HCA; the
            first 3 are hash-routed, the rest router-routed).
        rebuild: write it again even if it exists.
        spec: the whole geometry instead (its ``n_layer`` wins over ``n_layer``).
        path: where to put it (default :func:`dsv4_model_path`).
        progress: ``(bytes written, total)`` during a build (e.g. :func:`print_progress`).
        on_build: called with the path before a build starts.
        on_wait: called once if another process is building it.

    Returns:
        The model's path.

    Raises:
        ConfigError: a bad spec (e.g. ``n_layer`` < 1) or ``tokenizers`` missing.
        OSError: the cache directory cannot be written.
    """
    chosen = spec or DSV4_SPEC.with_(n_layer=n_layer)
    chosen.check()
    target = path or cache_dir() / chosen.file_name()

    def write(tmp: Path, report: Progress | None) -> None:
        write_dsv4_model(tmp, chosen, progress=report)

    return build_once(target, write, rebuild=rebuild, on_build=on_build, on_wait=on_wait, progress=progress)


def builtin_model_path(*, progress: Progress | None = None) -> str:
    """The path of the built-in full model, written into the user cache the first time.

    The model is a complete ``qwen3moe`` GGUF of Qwen3-30B-A3B's shape (8 layers, about 2.9 GB,
    random weights, so its text is random) with a byte-level BPE vocabulary and a ChatML template:
    what ``make run`` writes. It lives in ``$AIOEXPERTS_CACHE`` (else ``$XDG_CACHE_HOME/aioexperts``,
    else ``~/.cache/aioexperts``); two processes that ask at once write it once.
    ``$AIOEXPERTS_BUILTIN_SIZE=tiny`` gives the same architecture at a test size instead
    (:data:`TINY_FULL_SPEC`, about 2 MB).

    Args:
        progress: ``(bytes written, total)`` while it is written (default: a line on stderr at
            every tenth).

    Returns:
        The model's path (a ``str``, for ``aioexperts.open``, ``aioexperts.load`` and the rest).

    Raises:
        ConfigError: ``$AIOEXPERTS_BUILTIN_SIZE`` is neither ``full`` nor ``tiny``, or ``tokenizers``
            (the ``text`` extra) is missing.
        OSError: the cache folder cannot be written.
    """
    size = os.environ.get(BUILTIN_SIZE_ENV) or "full"
    spec = _SIZES.get(size)
    if spec is None:
        raise ConfigError(f"${BUILTIN_SIZE_ENV}={size!r}: expected one of {', '.join(_SIZES)}")
    return os.fspath(ensure_full_model(spec=spec, progress=progress or print_progress()))
