"""The page-cache mode's I/O: read-only shared mappings of the shards, residency, warming.

In page-cache mode the kernel's page cache is the expert cache: views point straight into a
``PROT_READ`` / ``MAP_SHARED`` mapping of each shard, and prefetching only warms the page cache.
Before warming a range, ``mincore`` tells whether its pages are resident already (such ranges are
skipped and counted); the ranges to warm are sorted and merged when the gap between them is small.

``mincore`` can lie: since Linux 5.0 (``mm/mincore.c``, ``can_do_mincore``) it reports every page of a
file mapping resident unless the caller owns the file, may write it, or has ``CAP_FOWNER`` (a model
owned by root, served by a service user). :func:`residency_facts` gathers those facts, and
``cachestat(2)`` (Linux 6.5+), which refuses with ``EPERM`` in exactly that case, where the kernel has
it; :func:`residency_trusted` decides. When residency cannot be trusted, every range is warmed.

Warming methods (``WARM_METHODS``):

- ``"read"``: worker threads ``pread`` each range into a small scratch buffer (the data is in the
  page cache when the call returns);
- ``"advice"``: one worker thread calls ``posix_fadvise(POSIX_FADV_WILLNEED)`` per range (the
  kernel starts readahead and returns);
- ``"parallel-advice"``: the same advice, ranges spread over the worker threads;
- ``"uring"``: buffered io_uring reads into a small scratch slab, thrown away (where io_uring
  can be set up).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import platform
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._errors import ConfigError

__all__ = (
    "DEFAULT_MAX_GAP",
    "WARM_METHODS",
    "MappedShards",
    "ResidencyFacts",
    "WarmRange",
    "cachestat_verdict",
    "merge_ranges",
    "residency_facts",
    "residency_trusted",
    "warm_advice",
    "warm_read",
)

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_MAX_GAP = 64 << 10
"""Ranges closer than this (bytes) are warmed as one: reading a small gap costs less than a call."""
WARM_METHODS = ("read", "advice", "parallel-advice", "uring")
SCRATCH_BYTES = 1 << 20
"""Bytes one ``read`` warming call reads at a time."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


_SYS_CACHESTAT = 451  # the same number on every architecture of the unified syscall table
_CAP_FOWNER = 3


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted"))


@dataclass(frozen=True, slots=True)
class ResidencyFacts:
    """What decides whether ``mincore`` tells the truth about a file mapping.

    Attributes:
        owner_uid: the file's owner (``st_uid``).
        euid: the process's effective user id.
        may_write: the process may write the file (``faccessat(W_OK, AT_EACCESS)``).
        cap_fowner: the process has ``CAP_FOWNER`` (root usually has).
        cachestat: ``"ok"`` (the kernel answered), ``"refused"`` (``EPERM``: it would not tell
            this process) or ``"unavailable"`` (no such syscall: Linux before 6.5, or not Linux).
    """

    owner_uid: int
    euid: int
    may_write: bool
    cap_fowner: bool
    cachestat: str


def residency_trusted(facts: ResidencyFacts) -> bool:
    """Whether ``mincore`` on a mapping of the file reports real residency.

    ``cachestat`` applies the same rule as ``mincore`` (owner, ``CAP_FOWNER`` or write access) and
    says so by refusing: its verdict wins where the kernel has it; otherwise the rule is applied to
    the facts.
    """
    if facts.cachestat == "ok":
        return True
    if facts.cachestat == "refused":
        return False
    return facts.euid == facts.owner_uid or facts.may_write or facts.cap_fowner


def cachestat_verdict(fd: int) -> str:
    """``cachestat(2)`` on the first page of ``fd``: ``"ok"``, ``"refused"`` or ``"unavailable"``."""
    if platform.system() != "Linux":
        return "unavailable"
    try:
        syscall = _libc.syscall
    except AttributeError:  # pragma: no cover - a libc without syscall()
        return "unavailable"
    span, out = _CachestatRange(0, PAGE_SIZE), _Cachestat()
    if syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(out), 0) == 0:
        return "ok"
    return "refused" if ctypes.get_errno() in (errno.EPERM, errno.EACCES) else "unavailable"


def _cap_fowner() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def residency_facts(fd: int, path: str) -> ResidencyFacts:
    """The :class:`ResidencyFacts` of the open file ``fd`` (named ``path``) for this process."""
    owner = os.fstat(fd).st_uid
    try:
        if os.access in os.supports_effective_ids:
            may_write = os.access(path, os.W_OK, effective_ids=True)
        else:  # pragma: no cover - Linux has faccessat(AT_EACCESS)
            may_write = os.access(path, os.W_OK)
    except OSError:
        may_write = False
    return ResidencyFacts(owner, os.geteuid(), may_write, _cap_fowner(), cachestat_verdict(fd))


@dataclass(frozen=True, slots=True, order=True)
class WarmRange:
    """A page-aligned byte range of one shard to warm.

    Attributes:
        shard: file index.
        offset: first byte (a multiple of the page size).
        n_bytes: length in bytes (the last range of a file may end at its size, unaligned).
    """

    shard: int
    offset: int
    n_bytes: int

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.n_bytes


def merge_ranges(
    ranges: Iterable[tuple[int, int, int]], file_sizes: Sequence[int], max_gap: int = DEFAULT_MAX_GAP
) -> list[WarmRange]:
    """Page-align ``(shard, offset, n_bytes)`` ranges, sort them and merge those at most ``max_gap`` apart.

    Args:
        ranges: byte ranges (any alignment; empty ones are dropped).
        file_sizes: each shard's size in bytes; ranges are clipped to it.
        max_gap: bytes between two ranges of a shard below which they become one range.

    Returns:
        Disjoint :class:`WarmRange`s in (shard, offset) order.

    Raises:
        ConfigError: ``max_gap`` is negative.
    """
    if max_gap < 0:
        raise ConfigError(f"max_gap must be >= 0 bytes, got {max_gap}")
    aligned = []
    for shard, offset, n in ranges:
        if n <= 0:
            continue
        start = offset - offset % PAGE_SIZE
        end = min(-(-(offset + n) // PAGE_SIZE) * PAGE_SIZE, file_sizes[shard])
        if end > start:
            aligned.append((shard, start, end))
    aligned.sort()
    merged: list[list[int]] = []
    for shard, start, end in aligned:
        if merged and merged[-1][0] == shard and start - merged[-1][2] <= max_gap:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([shard, start, end])
    return [WarmRange(s, a, b - a) for s, a, b in merged]


class _Mapping:
    """One ``mmap(2)`` of a whole file; unmapped when the last reference goes (or :meth:`unmap`)."""

    __slots__ = ("__weakref__", "address", "n_bytes")

    def __init__(self, fd: int, n_bytes: int) -> None:
        self.n_bytes = n_bytes
        self.address = 0
        if n_bytes == 0:
            return
        address = _libc.mmap(None, n_bytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {n_bytes} bytes failed: {os.strerror(err)}")
        self.address = address

    def unmap(self) -> None:
        if self.address:
            _libc.munmap(ctypes.c_void_p(self.address), ctypes.c_size_t(self.n_bytes))
            self.address = 0

    def __del__(self) -> None:
        self.unmap()


class MappedShards:
    """A read-only shared mapping of every shard: zero-copy views and page residency.

    Args:
        fds: open descriptors of the shards (not taken over: the caller closes them; a mapping
            outlives its descriptor).
        sizes: their sizes in bytes.

    Raises:
        OSError: a mapping failed (nothing stays mapped).
    """

    def __init__(self, fds: Sequence[int], sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self._maps: list[_Mapping] = []
        try:
            for fd, size in zip(fds, sizes, strict=True):
                self._maps.append(_Mapping(fd, size))
        except BaseException:
            self.close()
            raise
        self._exporters: weakref.WeakValueDictionary[int, ctypes.Array[ctypes.c_char]] = weakref.WeakValueDictionary()
        self._next_view = itertools.count()
        self._closed = False

    def _check(self, shard: int, offset: int, n_bytes: int) -> _Mapping:
        if self._closed:
            raise ValueError("the mappings are closed")
        if not 0 <= shard < len(self._maps):
            raise IndexError(f"no shard {shard}")
        if offset < 0 or n_bytes < 0 or offset + n_bytes > self.sizes[shard]:
            raise IndexError(f"[{offset}, {offset + n_bytes}) is outside shard {shard} of {self.sizes[shard]} bytes")
        return self._maps[shard]

    def view(self, shard: int, offset: int, n_bytes: int) -> memoryview:
        """A read-only ``memoryview`` (format ``B``) of the file bytes ``[offset, offset + n_bytes)``.

        Reading it may page-fault (and block) when the pages are not in the page cache. Each view
        has its own exporting object, which keeps the mapping alive while the view or anything
        derived from it (``np.frombuffer``) lives.
        """
        mapping = self._check(shard, offset, n_bytes)
        exporter = (ctypes.c_char * n_bytes).from_address(mapping.address + offset)
        exporter.mapping = mapping  # type: ignore[attr-defined]
        self._exporters[next(self._next_view)] = exporter
        return memoryview(exporter).cast("B").toreadonly()

    def residency(self, shard: int, offset: int, n_bytes: int) -> tuple[int, int]:
        """``(resident, total)`` pages of the range, from ``mincore(2)`` (no page is touched).

        Raises:
            OSError: ``mincore`` failed.
        """
        mapping = self._check(shard, offset, n_bytes)
        if n_bytes == 0:
            return 0, 0
        start = offset - offset % PAGE_SIZE
        length = offset + n_bytes - start
        n_pages = -(-length // PAGE_SIZE)
        vec = (ctypes.c_ubyte * n_pages)()
        if _libc.mincore(ctypes.c_void_p(mapping.address + start), ctypes.c_size_t(length), vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        resident = sum(1 for b in bytes(vec) if b & 1)
        return resident, n_pages

    @property
    def views_alive(self) -> int:
        """Views (or arrays made from them) that still exist."""
        return len(self._exporters)

    def close(self) -> None:
        """Unmap every shard whose views are all gone; the others are unmapped when their last view goes."""
        self._closed = True
        maps, self._maps = self._maps, []
        in_use = {id(e.mapping) for e in self._exporters.values()}  # type: ignore[attr-defined]
        for mapping in maps:
            if id(mapping) not in in_use:
                mapping.unmap()


def warm_read(fd: int, offset: int, n_bytes: int, scratch: memoryview) -> int:
    """Bring ``[offset, offset + n_bytes)`` into the page cache by reading it into ``scratch``.

    Blocking: run it in a worker thread. Returns the bytes read (fewer at end of file).

    Raises:
        OSError: a read failed.
    """
    done = 0
    while done < n_bytes:
        n = os.preadv(fd, [scratch[: min(len(scratch), n_bytes - done)]], offset + done)
        if n == 0:
            break
        done += n
    return done


def warm_advice(fd: int, offset: int, n_bytes: int) -> int:
    """Ask the kernel to read ``[offset, offset + n_bytes)`` ahead (``POSIX_FADV_WILLNEED``).

    May block while the readahead is queued: run it in a worker thread. Returns ``n_bytes``.

    Raises:
        OSError: the advice failed.
    """
    os.posix_fadvise(fd, offset, n_bytes, os.POSIX_FADV_WILLNEED)
    return n_bytes
