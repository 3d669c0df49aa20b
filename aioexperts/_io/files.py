"""Open the model's shard files for reading, with ``O_DIRECT`` when it really works.

Direct I/O is probed, not assumed: ``statx`` must report a direct-I/O alignment (tmpfs, where
``O_DIRECT`` is accepted but the page cache is used anyway, reports none), the ``O_DIRECT`` open
must succeed, and one aligned read must succeed. Otherwise the files are opened buffered and the
reason is kept for the statistics and the log.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

from .._errors import BackendUnavailableError, FormatError
from .._format.model import GGUFModel
from .align import DEFAULT_ALIGNMENT, DirectIOAlignment, probe_alignment

__all__ = ("ShardFiles", "open_shards")


@dataclass(slots=True)
class ShardFiles:
    """Open descriptors of every shard, all direct or all buffered.

    Attributes:
        fds: one read-only descriptor per shard, in shard order.
        sizes: file sizes in bytes.
        direct_io: True when opened with ``O_DIRECT``.
        alignment: bytes to align offsets, lengths and buffers to: the largest direct-I/O unit
            of all shards (``statx``), at least the 4096-byte page; for buffered reads 4096, where
            it only rounds reads.
        buffered_reason: why direct I/O is off, or None.
    """

    fds: tuple[int, ...]
    sizes: tuple[int, ...]
    direct_io: bool
    alignment: int
    buffered_reason: str | None

    def close(self) -> None:
        """Close every descriptor; idempotent."""
        fds, self.fds = self.fds, ()
        for fd in fds:
            os.close(fd)


def _probe_read(fd: int, unit: int) -> None:
    buf = mmap.mmap(-1, max(unit, mmap.PAGESIZE))
    try:
        with memoryview(buf) as view:
            os.preadv(fd, [view[:unit]], 0)
    finally:
        buf.close()


def _open_direct(path: str, unit: int) -> tuple[int | None, str | None]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None, f"O_DIRECT open refused by the file system ({errno.errorcode[exc.errno]})"
        raise
    try:
        _probe_read(fd, unit)
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EINVAL:
            return None, f"an aligned O_DIRECT read of {unit} bytes failed (EINVAL)"
        raise
    return fd, None


def open_shards(model: GGUFModel, direct_io: bool | None = None) -> ShardFiles:
    """Open every shard of ``model`` (blocking: call from a worker thread under a loop).

    Args:
        model: the parsed model.
        direct_io: True to require ``O_DIRECT``, False to use buffered reads, None to use
            ``O_DIRECT`` where it works.

    Raises:
        BackendUnavailableError: ``direct_io=True`` but direct I/O does not work here.
        FormatError: a shard changed (size, inode or mtime) since the model was parsed.
        OSError: a file cannot be opened.
    """
    reason: str | None = None if direct_io is not False else "buffered reads requested (direct_io=False)"
    alignments: list[DirectIOAlignment] = []
    if reason is None:
        alignments = [probe_alignment(s.path) for s in model.shards]
        if not all(a.direct_io_supported for a in alignments):
            reason = "statx reports no direct I/O on this file system (tmpfs or similar: it uses the page cache)"
    # Widen reads to whole pages even where the device takes 512-byte alignment: page-aligned
    # reads measured ~12 % faster on a virtio disk backed by a host file (3.0-3.2 vs 2.7-2.8 GB/s),
    # for 0.4 % more bytes read with Qwen3-30B-A3B experts.
    unit = max([DEFAULT_ALIGNMENT, *(a.unit for a in alignments)])
    fds: list[int] = []
    try:
        if reason is None:
            for shard in model.shards:
                fd, reason = _open_direct(shard.path, unit)
                if fd is None:
                    break
                fds.append(fd)
        if reason is not None:
            if direct_io:
                raise BackendUnavailableError(f"direct I/O was required but is not available: {reason}")
            for fd in fds:
                os.close(fd)
            fds = [os.open(s.path, os.O_RDONLY | os.O_CLOEXEC) for s in model.shards]
            unit = DEFAULT_ALIGNMENT
        for shard, fd in zip(model.shards, fds, strict=True):
            if not shard.matches(os.fstat(fd)):
                raise FormatError(f"{shard.path} changed since it was parsed (size, inode or mtime); reopen the model")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return ShardFiles(tuple(fds), tuple(s.size for s in model.shards), reason is None, unit, reason)
