"""The user cache of the built-in models: its folder, and a build-once that is safe when runs race.

Two processes that need the same built-in model at once must not write the same file: the builder
holds an exclusive ``flock`` on ``NAME.lock`` beside the model and writes a uniquely named
temporary file that is renamed into place when complete. A second process waits for the lock, then
finds the finished model and reuses it. A build that fails or is interrupted (Ctrl-C) removes its
temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

__all__ = (
    "FREE_SPACE_MARGIN",
    "Progress",
    "build_once",
    "cache_dir",
    "check_free_space",
    "print_progress",
    "progress_bytes",
)

#: ``(bytes written so far, total bytes)``.
Progress = Callable[[int, int], None]


def cache_dir() -> Path:
    """``$AIOEXPERTS_CACHE``, else ``$XDG_CACHE_HOME/aioexperts``, else ``~/.cache/aioexperts``."""
    explicit = os.environ.get("AIOEXPERTS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aioexperts"


def progress_bytes(done: int, total: int) -> str:
    """``done`` of ``total`` bytes in the decimal unit that fits ``total``: ``"1.23 of 2.90 GB"``,
    ``"0.52 of 2.10 MB"``, ``"12.29 of 409.60 kB"``, ``"12 of 512 bytes"`` (every progress line of a
    build or a sidecar says its sizes this way)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return f"{done / scale:.2f} of {total / scale:.2f} {unit}"
    return f"{done} of {total} bytes"


def print_progress(stream: TextIO | None = None) -> Progress:
    """A ``progress`` callback that prints a line at every tenth of the bytes (stderr by default)."""
    out = stream or sys.stderr
    last = [-1]

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"  written {progress_bytes(done, total)}", file=out, flush=True)

    return progress


#: room left free beside a built-in model being written (bytes): the header, and a margin for the rest
FREE_SPACE_MARGIN = 1 << 30


def check_free_space(folder: Path, n_bytes: int) -> None:
    """Refuse to start a file of ``n_bytes`` in ``folder`` where the disk has less room (plus
    :data:`FREE_SPACE_MARGIN`): a build that fills the disk fails late and hurts everything else on it.

    Raises:
        OSError: ``ENOSPC``, saying how much is needed and free.
    """
    free = shutil.disk_usage(folder).free
    if free < n_bytes + FREE_SPACE_MARGIN:
        raise OSError(
            errno.ENOSPC,
            f"the model needs {(n_bytes + FREE_SPACE_MARGIN) / 1e9:.1f} GB of free space, "
            f"{folder} has {free / 1e9:.1f} GB",
        )


@contextlib.contextmanager
def _locked(lock_path: Path, on_wait: Callable[[], None]) -> Iterator[bool]:
    """Hold the ``flock`` of ``lock_path``; yields whether this call created the lock file."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        created = True
    except FileExistsError:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        created = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield created
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _remove_unlocked_partials(folder: Path, skip: str) -> None:
    """Remove the ``NAME.*.partial`` files of other built-in files in ``folder`` (not ``skip``)
    whose ``NAME.lock`` no process holds: what killed builds of a size never asked for again left
    (a 49-layer model stopped by SIGTERM left 17 GB)."""
    for partial in folder.glob("*.partial"):
        name = partial.name[: -len(".partial")].rpartition(".")[0]
        if not name or name == skip:
            continue
        lock = folder / (name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file: not one of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # another process is writing it
        else:
            partial.unlink(missing_ok=True)
        finally:
            os.close(fd)


def build_once(
    target: Path,
    write: Callable[[Path, Progress | None], object],
    *,
    rebuild: bool = False,
    on_build: Callable[[Path], None] | None = None,
    on_wait: Callable[[], None] | None = None,
    progress: Progress | None = None,
    needs_bytes: int | None = None,
) -> Path:
    """``target``, written first by ``write(temporary path, progress)`` when missing (or ``rebuild``).

    Args:
        target: the file.
        write: writes the file to the temporary path it is given, reporting to ``progress``.
        rebuild: write it again even if it exists (a process that waited for another builder that
            finished after this call started reuses that fresh file instead).
        on_build: called with the path before a build starts.
        on_wait: called once if another process holds the build lock.
        progress: ``(bytes written, total)`` during a build.
        needs_bytes: the size of the file (at most), if known: a disk without that room (plus
            :data:`FREE_SPACE_MARGIN`) is refused before ``on_build`` is called or a byte is
            written, and the lock file this call created is removed again.

    Returns:
        ``target``.

    A temporary ``NAME.*.partial`` file that a killed build left beside ``target`` is removed by
    the next build (under the lock, so never one another process is writing), and so are those
    of other files in the folder whose lock no process holds.

    Raises:
        OSError: the folder cannot be written; ``ENOSPC``: the disk has not ``needs_bytes`` free.
    """
    if target.exists() and not rebuild:
        return target
    started = time.time()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # a file where the cache folder should be
        raise NotADirectoryError(
            exc.errno,
            f"the model cache folder {target.parent} is not a folder (set $AIOEXPERTS_CACHE, or "
            "$XDG_CACHE_HOME, to a folder)",
        ) from None
    lock = target.with_name(target.name + ".lock")
    with _locked(lock, on_wait or (lambda: None)) as created:
        if target.exists() and (not rebuild or target.stat().st_mtime >= started):
            return target  # built by another process while we waited
        # under the lock no other process writes this file: a temporary file left by a build that
        # was killed (SIGKILL, SIGTERM: no clean-up ran) is removed, so none piles up
        for stale in target.parent.glob(target.name + ".*.partial"):
            stale.unlink(missing_ok=True)
        _remove_unlocked_partials(target.parent, target.name)
        if needs_bytes is not None:
            try:
                check_free_space(target.parent, needs_bytes)  # after the clean-up, which frees room
            except OSError:
                if created:  # a refused build leaves nothing behind (a 0-byte NAME.lock was left)
                    lock.unlink(missing_ok=True)
                raise
        if on_build is not None:
            on_build(target)
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write(tmp, progress)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target
