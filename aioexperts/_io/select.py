"""Choose the read backend once, by probing, and say why when it is not io_uring."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import AioExpertsError, BackendUnavailableError, ConfigError
from .backends.base import IOBackend
from .backends.threads import ThreadBackend
from .files import ShardFiles
from .loop import LoopAdapter
from .slab import Slab
from .uring_probe import liburing_unusable_reason

__all__ = ("BACKEND_NAMES", "BackendFactory", "create_backend", "io_uring_disabled_sysctl")

log = logging.getLogger("aioexperts")

BACKEND_NAMES = ("auto", "io_uring", "threads", "io_uring_raw")
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

    ``"auto"`` takes io_uring when its ring can be set up, else the thread pool, logging one
    warning line with the reason. ``"io_uring"`` and ``"threads"`` force one. io_uring goes
    through the ``liburing`` wheel where it runs on this CPU
    (:func:`~aioexperts._io.uring_probe.liburing_unusable_reason`); where it does not (not
    installed, or it dies with ``SIGILL`` without AVX-512) the ring is driven through the raw
    system calls instead (:mod:`.backends.rawring`; why is ``features()["ring_reason"]``, one
    info line). ``"io_uring_raw"`` forces the raw ring.

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
        try:
            made: object = backend(files, slab, loop, depth)
        except AioExpertsError:
            raise
        except Exception as exc:  # a custom factory's own failure: named as the store's option
            raise ConfigError(f"the backend factory {backend!r} failed: {exc!r}") from exc
        if not isinstance(made, IOBackend):
            raise ConfigError(f"the backend factory {backend!r} returned {made!r}, not an IOBackend")
        return made, None
    if backend not in BACKEND_NAMES:
        raise ConfigError(f"backend must be one of {', '.join(BACKEND_NAMES)} or a factory, got {backend!r}")
    reason: str | None = None
    if backend in ("auto", "io_uring"):
        liburing_reason = liburing_unusable_reason()
        if liburing_reason is None:
            try:
                from .backends.uring import UringBackend

                return UringBackend(files, slab, loop, depth, **_uring_options(options)), None
            except Exception as exc:  # ImportError, OSError, and whatever old kernels make the wrapper raise
                reason = _why_no_uring(exc)
                if backend == "io_uring":
                    raise BackendUnavailableError(f"io_uring was requested but {reason}") from exc
        else:
            built, reason = _build_raw(files, slab, loop, depth, options, liburing_reason, backend == "io_uring")
            if built is not None:
                return built, None
        log.warning("%s; falling back to the thread-pool preadv backend", reason)
    elif backend == "io_uring_raw":
        built, reason = _build_raw(files, slab, loop, depth, options, "backend='io_uring_raw' was requested", True)
        assert built is not None
        return built, None
    thread_options = {k: options[k] for k in ("n_threads",) if k in options}
    return ThreadBackend(files, slab, loop, depth, **thread_options), reason


def _uring_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options[k] for k in ("fixed_buffers", "sqe_async") if k in options}


def _build_raw(
    files: ShardFiles,
    slab: Slab,
    loop: LoopAdapter,
    depth: int,
    options: dict[str, Any],
    ring_reason: str,
    required: bool,
) -> tuple[IOBackend | None, str | None]:
    """The raw-syscall ring, or (None, why not); raises ``BackendUnavailableError`` when ``required``."""
    from .backends.rawring import RawUringBackend
    from .uring_raw import raw_ring_unusable_reason

    platform_reason = raw_ring_unusable_reason()
    try:
        if platform_reason is not None:
            raise OSError(errno.ENOSYS, platform_reason)
        built = RawUringBackend(files, slab, loop, depth, ring_reason=ring_reason, **_uring_options(options))
    except Exception as exc:  # OSError from io_uring_setup or a registration
        reason = f"{ring_reason}, and the raw io_uring ring failed: {platform_reason or _why_no_uring(exc)}"
        if required:
            raise BackendUnavailableError(f"io_uring was requested but {reason}") from exc
        return None, reason
    log.info("%s; io_uring runs through raw system calls", ring_reason)
    return built, None
