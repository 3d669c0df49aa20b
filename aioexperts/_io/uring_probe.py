"""Whether the ``liburing`` wheel runs on this CPU, asked of a child process once per process.

The PyPI wheels of ``liburing`` (2026.3.x, built with Zig) contain AVX-512 instructions: on a CPU
without AVX-512 the first ``liburing.Ring()`` kills the whole process with ``SIGILL``, which no
exception handler can catch. So before the io_uring backend is built, a child process sets up and
tears down a small ring; if the child dies by a signal, io_uring is refused with the reason and
``backend="auto"`` takes the thread pool. A child that merely raises (``EPERM``, ``ENOSYS``) counts
as usable here: the same error is then raised safely in this process and reported as today.
"""

from __future__ import annotations

import functools
import importlib.util
import signal
import subprocess
import sys

__all__ = ("io_uring_unusable_reason", "liburing_unusable_reason")

_PROBE = "import liburing as lu\nr = lu.Ring()\nlu.io_uring_queue_init(4, r)\nlu.io_uring_queue_exit(r)\n"
_TIMEOUT_S = 60.0


@functools.cache
def liburing_unusable_reason() -> str | None:
    """Why the ``liburing`` wheel cannot be used in this process, or None when it can.

    Runs ``python -c <ring set-up>`` once (about 0.1-0.3 s) and caches the answer for the process.

    Returns:
        None when the child exited normally or with a Python exception; a one-line reason when
        the package is missing, the child was killed by a signal (``SIGILL``: the wheel needs CPU
        instructions this machine lacks), or it did not finish in 60 s.
    """
    if importlib.util.find_spec("liburing") is None:
        return "the liburing package is not installed"
    try:
        proc = subprocess.run(  # noqa: S603 - our own interpreter, a fixed script
            [sys.executable, "-c", _PROBE], capture_output=True, timeout=_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return f"a child process setting up an io_uring ring did not finish in {_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return f"a child process to probe liburing could not start ({exc})"
    if proc.returncode >= 0:
        return None
    sig = -proc.returncode
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    if sig == signal.SIGILL:
        return (
            "the liburing wheel stops with SIGILL on this CPU (it was built for instructions this CPU lacks, "
            "e.g. AVX-512)"
        )
    return f"a child process setting up an io_uring ring with liburing was killed by {name}"


@functools.cache
def io_uring_unusable_reason() -> str | None:
    """Why no io_uring backend can run in this process (neither ``liburing`` nor the raw-syscall
    ring of :mod:`aioexperts._io.uring_raw`), or None when one can.

    Where the wheel is unusable, sets up and tears down a 4-entry raw ring here (safe in-process:
    no foreign machine code runs). Cached for the process.
    """
    reason = liburing_unusable_reason()
    if reason is None:
        return None
    from .uring_raw import RawRing, raw_ring_unusable_reason

    raw = raw_ring_unusable_reason()
    if raw is None:
        try:
            RawRing(4).close()
        except OSError as exc:
            raw = f"the raw io_uring ring cannot be set up either ({exc})"
        else:
            return None
    return f"{reason}; {raw}"
