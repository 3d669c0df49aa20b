"""Cold means cold: dropping the guest's page cache, and probing for a cache below the guest.

The bench drops a file from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before
every cold pass of every method, outside the timed and CPU-counted part. That empties the
guest's page cache only: on a virtual machine the host may keep the file in its own memory, and
then "cold" reads come from RAM at RAM-like speed. :func:`probe_host_cache` looks for that:

- it reads a region of the model twice with ``O_DIRECT`` (the guest cache plays no part): when
  the second read is much faster than the first, something below the guest kept the data;
- it writes a fresh scratch file beside the model, drops it, and reads it back with ``O_DIRECT``:
  when that first read of just-written data is much faster than the first read of the model, the
  host caches what was written recently (a freshly built model is then read from the host's
  memory).

Both are heuristics ("likely"); the bench prints the caveat next to the table when either fires.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ("DROP_METHOD", "HostCacheProbe", "drop_page_cache", "probe_host_cache")

#: How the bench makes a pass cold, as printed with the tables.
DROP_METHOD = "posix_fadvise(POSIX_FADV_DONTNEED) on every file before each cold pass (guest page cache only)"
#: A second read this much faster than the first suggests a cache below the guest.
SPEEDUP_THRESHOLD = 1.3
_CHUNK = 1 << 20


def drop_page_cache(paths: Sequence[str]) -> None:
    """``POSIX_FADV_DONTNEED`` over each whole file (clean pages leave the guest's page cache)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class HostCacheProbe:
    """What :func:`probe_host_cache` measured (rates in GB/s, GB = 1e9 bytes).

    Attributes:
        n_bytes: bytes per read pass.
        model_first, model_again: the same model region read twice with ``O_DIRECT``.
        fresh_first: a just-written scratch file's first ``O_DIRECT`` read (None if it could
            not be written).
        reread_speedup: ``model_again / model_first``.
        fresh_speedup: ``fresh_first / model_first``.
        likely_host_cache: either speed-up is above the threshold.
        caveat: the sentence the tables print, or "".
    """

    n_bytes: int
    model_first: float
    model_again: float
    fresh_first: float | None
    reread_speedup: float
    fresh_speedup: float | None
    likely_host_cache: bool
    caveat: str

    def as_dict(self) -> dict[str, object]:
        """Fields as a dict."""
        return asdict(self)


def _direct_read_rate(path: str, offset: int, n_bytes: int, depth_bytes: int = 64 << 20) -> float:
    """Sequential ``O_DIRECT`` read of ``n_bytes`` at ``offset`` (aligned) in 1 MiB reads; GB/s."""
    buf = mmap.mmap(-1, depth_bytes)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < n_bytes:
            got = os.preadv(fd, [view[(done % depth_bytes) : (done % depth_bytes) + _CHUNK]], offset + done)
            if got <= 0:
                break
            done += got
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        view.release()
        buf.close()
    return done / seconds / 1e9 if seconds > 0 else float("nan")


def probe_host_cache(model_path: str, n_bytes: int = 256 << 20, offset: int | None = None) -> HostCacheProbe:
    """Probe for a cache below the guest (see the module docstring).

    Args:
        model_path: a model file at least ``n_bytes`` long (the probe reads its middle).
        n_bytes: bytes per pass (rounded down to 1 MiB).
        offset: where in the model to read (default: the middle, rounded to 1 MiB).

    Raises:
        OSError: the model cannot be read with ``O_DIRECT``.
    """
    size = os.path.getsize(model_path)
    n_bytes = max(_CHUNK, min(n_bytes, size // 2) // _CHUNK * _CHUNK)
    if offset is None:
        offset = (size // 2 - n_bytes // 2) // _CHUNK * _CHUNK
    drop_page_cache([model_path])
    first = _direct_read_rate(model_path, offset, n_bytes)
    again = _direct_read_rate(model_path, offset, n_bytes)
    fresh: float | None = None
    with contextlib.suppress(OSError):
        fresh = _fresh_file_rate(os.path.dirname(os.path.abspath(model_path)), n_bytes)
    reread = again / first
    fresh_speedup = None if fresh is None else fresh / first
    reasons = []
    if reread > SPEEDUP_THRESHOLD:
        reasons.append(f"an O_DIRECT re-read ran {reread:.1f}x the first read")
    if fresh_speedup is not None and fresh_speedup > SPEEDUP_THRESHOLD:
        reasons.append(f"just-written data read back at {fresh_speedup:.1f}x the model's first read")
    caveat = ""
    if reasons:
        caveat = (
            "a cache below this guest (the host's) likely serves some 'cold' reads: "
            + "; ".join(reasons)
            + ". Cold figures may be faster than the device."
        )
    return HostCacheProbe(n_bytes, first, again, fresh, reread, fresh_speedup, bool(reasons), caveat)


def _fresh_file_rate(directory: str, n_bytes: int) -> float:
    fd, name = tempfile.mkstemp(prefix=".aioexperts-probe-", dir=directory)
    try:
        block = os.urandom(_CHUNK)
        for _ in range(n_bytes // _CHUNK):
            os.write(fd, block[:-8] + os.urandom(8))  # no two chunks alike
        os.fsync(fd)
        os.close(fd)
        fd = -1
        drop_page_cache([name])
        return _direct_read_rate(name, 0, n_bytes)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)
