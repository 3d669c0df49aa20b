"""Choose the read backend once, by probing, and say why when it is not io_uring."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import BackendUnavailableError, ConfigError
from .backends.base import IOBackend
from .backends.threads import ThreadBackend
from .files import ShardFiles
from .loop import LoopAdapter
from .slab import Slab
from .uring_probe import liburing_unusable_reason

__all__ = ("BACKEND_NAMES", "BackendFactory", "create_backend", "io_uring_disabled_sysctl")

log = logging.getLogger("aioexperts")

BACKEND_NAMES = ("auto", "io_uring", "threads")
#: A callable that builds a backend, for tests and custom backends.
BackendFactory = Callable[[ShardFiles, Slab, LoopAdapter, int], IOBackend]
_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


def io_uring_disabled_sysctl() -> int | None:
    """Value of ``kernel.io_uring_disabled`` (0 on, 1 root/group only, 2 off), None if absent."""
    try:
        return int(_SYSCTL.read_text().strip())
    except (OSError, ValueError):
        return None


def _why_no_uring(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"the liburing package cannot be imported ({exc})"
    if not isinstance(exc, OSError):
        return f"setting up the ring raised {exc!r}"
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if exc.errno == errno.EPERM:
        sysctl = io_uring_disabled_sysctl()
        hint = f"kernel.io_uring_disabled={sysctl}" if sysctl else "a seccomp filter or container policy"
        return f"io_uring_setup failed with {name} ({hint})"
    if exc.errno == errno.ENOSYS:
        return f"io_uring_setup failed with {name} (the kernel has no io_uring)"
    return f"io_uring_setup failed with {name} ({exc.strerror})"


def create_backend(
    backend: str | BackendFactory,
    files: ShardFiles,
    slab: Slab,
    loop: LoopAdapter,
    depth: int,
    *,
    attach: bool = True,
    **options: Any,
) -> tuple[IOBackend, str | None]:
    """Build the backend named ``backend`` (or call a factory).

    ``"auto"`` takes io_uring when its ring can be set up (and the ``liburing`` wheel runs on this
    CPU: :func:`~aioexperts._io.uring_probe.liburing_unusable_reason`), else the thread pool,
    logging one warning line with the reason. ``"io_uring"`` and ``"threads"`` force one.

    With ``attach=False`` nothing touches the event loop, so this can run in a worker thread (ring
    set-up and buffer registration are blocking system calls); then call ``backend.attach()`` on
    the loop thread before the first submit.

    Args:
        attach: attach the backend to ``loop`` before returning (loop thread only).
        options: ``fixed_buffers``, ``sqe_async`` (io_uring), ``n_threads`` (threads).

    Returns:
        ``(backend, fallback_reason)``; the reason is None unless ``auto`` fell back.

    Raises:
        ConfigError: an unknown backend name.
        BackendUnavailableError: ``"io_uring"`` was forced and cannot be set up (whatever the
            wrapper raised is the cause).
    """
    built, reason = _build(backend, files, slab, loop, depth, options)
    if attach:
        try:
            built.attach()
        except BaseException:
            built.close()
            raise
    return built, reason


def _build(
    backend: str | BackendFactory,
    files: ShardFiles,
    slab: Slab,
    loop: LoopAdapter,
    depth: int,
    options: dict[str, Any],
) -> tuple[IOBackend, str | None]:
    if callable(backend):
        return backend(files, slab, loop, depth), None
    if backend not in BACKEND_NAMES:
        raise ConfigError(f"backend must be one of {', '.join(BACKEND_NAMES)} or a factory, got {backend!r}")
    reason = liburing_unusable_reason() if backend in ("auto", "io_uring") else None
    if reason is not None:
        if backend == "io_uring":
            raise BackendUnavailableError(f"io_uring was requested but {reason}")
        log.warning("%s; falling back to the thread-pool preadv backend", reason)
    elif backend in ("auto", "io_uring"):
        try:
            from .backends.uring import UringBackend

            uring_options = {k: options[k] for k in ("fixed_buffers", "sqe_async") if k in options}
            return UringBackend(files, slab, loop, depth, **uring_options), None
        except Exception as exc:  # ImportError, OSError, and whatever old kernels make the wrapper raise
            reason = _why_no_uring(exc)
            if backend == "io_uring":
                raise BackendUnavailableError(f"io_uring was requested but {reason}") from exc
            log.warning("%s; falling back to the thread-pool preadv backend", reason)
    thread_options = {k: options[k] for k in ("n_threads",) if k in options}
    return ThreadBackend(files, slab, loop, depth, **thread_options), reason
