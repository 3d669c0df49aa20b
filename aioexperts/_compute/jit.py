"""numba set-up for the compiled kernels: whether numba serves, where its cache lives, one decorator.

The kernels in :mod:`aioexperts._compute.kernels` are compiled by numba on first use and cached on
disk, never inside the installed package: under ``$AIOEXPERTS_CACHE/numba`` (else
``$XDG_CACHE_HOME/aioexperts/numba``, else ``~/.cache/aioexperts/numba``), in a folder named after
the Python, numba and llvmlite versions and a hash of the kernel sources.

Why the hash: numba's own cache key covers only the file of the function being compiled (its
mtime/size stamp and bytecode). A kernel that inlines a helper from another module, or an
``@intrinsic`` whose code generator changed, would otherwise keep running the old machine code after
an edit or an upgrade (``docs/notes/KERNELS.md``, pitfall 4). Every source file of the kernels
package and this module go into the hash, so any edit moves the cache to a new folder and the
kernels are compiled afresh. Stale folders are left for the user to delete (they are small).

numba reads its cache folder from ``numba.config.CACHE_DIR`` when a function is decorated; the
:func:`kernel` decorator sets it for the duration of the decoration only, so the user's own numba
functions keep their configuration, under a lock: two threads decorating at once (kernel modules
imported by compute-pool threads) left numba reading the other thread's restored ``""``, a cache
folder relative to the working directory. If the folder cannot be written, kernels are compiled without
a disk cache (numba would otherwise fall back to ``__pycache__`` inside the package).

Environment:
    ``AIOEXPERTS_KERNELS``: ``numba`` (default) or ``numpy`` to force the numpy kernels.
    ``AIOEXPERTS_CACHE``: the cache root (shared with the bench model).
    ``NUMBA_DISABLE_JIT`` (numba's own): when set, numba compiles nothing, so the numpy kernels
    serve (with one log line saying so).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = (
    "BACKEND_ENV",
    "CACHE_ENV",
    "FASTMATH_FLAGS",
    "JitStatus",
    "cache_dir",
    "jit_status",
    "kernel",
    "kernel_sources_hash",
    "reset_jit_status",
    "sources_hash",
)

log = logging.getLogger("aioexperts")

BACKEND_ENV = "AIOEXPERTS_KERNELS"
CACHE_ENV = "AIOEXPERTS_CACHE"

#: fastmath flags of the float kernels: reassociation (vectorised reductions) and contraction
#: (FMA), but no ``nnan``/``ninf``, so NaN and inf in the weights still propagate to the output.
FASTMATH_FLAGS = frozenset({"reassoc", "contract", "nsz", "arcp"})

_KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
_CACHE_DIR_LOCK = threading.RLock()
_HASH_CHARS = 16

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class JitStatus:
    """Whether the compiled kernels can serve, and where they are cached.

    Attributes:
        available: numba imported and was not disabled by ``AIOEXPERTS_KERNELS=numpy`` or by
            numba's own ``NUMBA_DISABLE_JIT``.
        reason: why the numpy kernels serve instead (None when ``available``).
        numba_version: the imported numba version, or None.
        cache_dir: the folder of the on-disk cache, or None when kernels are not cached.
        cache_reason: why there is no on-disk cache (None when there is one).
    """

    available: bool
    reason: str | None
    numba_version: str | None
    cache_dir: Path | None
    cache_reason: str | None


def _user_cache_root() -> Path:
    """``$AIOEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/aioexperts``, else ``~/.cache/aioexperts``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aioexperts"


def sources_hash(files: Iterable[Path]) -> str:
    """SHA-256 (hex, shortened) of the names and contents of ``files``, in sorted order.

    Names are included so that renaming a module or moving code between modules also changes it.

    Raises:
        OSError: a file cannot be read.
    """
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:_HASH_CHARS]


@functools.cache
def kernel_sources_hash() -> str:
    """:func:`sources_hash` of every module of the kernels package and of this module (once per process)."""
    return sources_hash([*_KERNELS_DIR.glob("*.py"), Path(__file__).resolve()])


def cache_dir(root: Path | None = None) -> Path:
    """The cache folder of the current kernel sources and toolchain (not created here).

    Args:
        root: the cache root; default ``$AIOEXPERTS_CACHE`` etc. (see the module docstring).

    Returns:
        ``root/numba/py<X.Y>-numba<version>-llvmlite<version>-<source hash>``.
    """
    import llvmlite
    import numba

    tag = (
        f"py{platform.python_version_tuple()[0]}.{platform.python_version_tuple()[1]}"
        f"-numba{numba.__version__}-llvmlite{llvmlite.__version__}-{kernel_sources_hash()}"
    )
    return (root if root is not None else _user_cache_root()) / "numba" / tag


def _writable_dir(path: Path) -> str | None:
    """Create ``path`` and check that a file can be written there; None if fine, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        return f"cannot write the kernel cache folder {path}: {exc}"
    return None


@functools.cache
def jit_status() -> JitStatus:
    """Probe numba once per process (the result is cached; see :func:`reset_jit_status` for tests).

    Returns:
        The :class:`JitStatus`. Never raises: every failure becomes a ``reason``.
    """
    forced = os.environ.get(BACKEND_ENV, "numba").strip().lower()
    if forced == "numpy":
        return JitStatus(False, f"{BACKEND_ENV}=numpy", None, None, None)
    if forced not in ("", "numba"):
        return JitStatus(False, f"{BACKEND_ENV}={forced!r} is not 'numba' or 'numpy'", None, None, None)
    try:
        import numba
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return JitStatus(False, f"numba cannot be imported ({type(exc).__name__}: {exc})", None, None, None)
    if getattr(numba.config, "DISABLE_JIT", False):
        # njit then returns the plain Python function: no dispatcher, no .compile, no .stats
        reason = "NUMBA_DISABLE_JIT is set: numba compiles nothing"
        return JitStatus(False, reason, numba.__version__, None, None)
    try:
        folder: Path | None = cache_dir()
    except Exception as exc:  # llvmlite missing or unreadable kernel sources
        return JitStatus(False, f"numba is unusable ({type(exc).__name__}: {exc})", numba.__version__, None, None)
    assert folder is not None
    cache_reason = _writable_dir(folder)
    if cache_reason is not None:
        folder = None
    return JitStatus(True, None, numba.__version__, folder, cache_reason)


def reset_jit_status() -> None:
    """Forget the probe of :func:`jit_status` (tests that change the environment)."""
    jit_status.cache_clear()


def kernel(*, exact: bool = False, cache: bool = True, inline: bool = False) -> Callable[[F], F]:
    """Compile a function with numba, lazily, with the project's options and cache folder.

    Options: ``nogil=True`` (the compute pool runs kernels in parallel threads),
    ``boundscheck=False``, ``error_model="numpy"`` (no Python exception checks on division), and
    fastmath :data:`FASTMATH_FLAGS` unless ``exact``: exact kernels keep IEEE float32 semantics
    operation by operation (no FMA contraction, no reassociation), as the bit-exact dequantizers
    need.

    Args:
        exact: compile without fastmath.
        cache: cache the machine code on disk (for the entry points; helpers they call are
            compiled into them and need no cache of their own).
        inline: a helper inlined into its callers in numba's IR (``inline="always"``): numba
            compiles each dispatcher into its own LLVM module, so a plain call is never inlined
            by LLVM and costs a call per use. An inlined helper takes its caller's fastmath flags;
            it is never cached on its own.

    Returns:
        A decorator returning the numba dispatcher.

    Raises:
        ImportError: numba is not installed (callers import the kernel modules inside a ``try``).
    """
    import numba

    def decorate(fn: F) -> F:
        options: dict[str, Any] = {
            "nogil": True,
            "boundscheck": False,
            "error_model": "numpy",
            "fastmath": False if exact else set(FASTMATH_FLAGS),
        }
        if inline:
            options["inline"] = "always"
        folder = jit_status().cache_dir if cache and not inline else None
        if folder is None:
            compiled: F = numba.njit(**options)(fn)
            return compiled
        config: Any = numba.config
        with _CACHE_DIR_LOCK:  # kernel modules imported in two threads at once must not interleave here
            saved = config.CACHE_DIR
            config.CACHE_DIR = os.fspath(folder)
            try:
                compiled = numba.njit(cache=True, **options)(fn)
            finally:
                config.CACHE_DIR = saved
        return compiled

    return decorate
