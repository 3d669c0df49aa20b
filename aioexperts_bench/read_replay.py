"""Replays of a :class:`ReadList` without the store: a thread pool, buffered ``pread``, mmap.

Each replay reads every row of the list, in order, into its own place in a destination buffer
as large as all the reads together (distinct memory, like the store's slab; never a few reused
buffers). The destination is an anonymous ``mmap`` whose pages are touched before the clock
starts, as the store pre-faults its slab.

- ``threads``: ``n_threads`` threads calling ``os.preadv`` on an ``O_DIRECT`` descriptor;
- ``pread``: the same on a buffered descriptor (through the page cache);
- ``mmap``: one thread copying each range out of a read-only shared mapping (page faults and
  the kernel's readahead);
- ``uring``: a minimal io_uring loop (``liburing``, ``O_DIRECT``, registered buffers and
  ``READV_FIXED`` as the store and fio use them, no store around it) at the store's depth, into
  distinct memory or, with ``reused``, into ``depth`` buffers each reused as soon as its read
  completed (the way fio reads): the pair measures whether it matters where reads land.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioexperts.backends import liburing_unusable_reason

from .measure import Clock
from .readlist import ReadList

__all__ = ("Destination", "ReplayResult", "replay_mmap", "replay_pread", "replay_uring", "uring_slot_bytes")

_PAGE = mmap.PAGESIZE


class Destination:
    """Page-aligned anonymous memory for every read of a list side by side, pre-faulted.

    Use as a context manager; :meth:`close` unmaps it.
    """

    def __init__(self, n_bytes: int) -> None:
        self.n_bytes = max(_PAGE, -(-n_bytes // _PAGE) * _PAGE)
        self._map = mmap.mmap(-1, self.n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[::_PAGE] = 0  # fault every page in now, not inside a timed pass
        self.array[-1] = 0

    def raw(self, offset: int, n_bytes: int) -> memoryview:
        """A writable view of ``n_bytes`` at ``offset`` that holds no buffer export of the mapping.

        For liburing's ``Iovec``, which never releases an export (the mapping could then never be
        closed). Use only while the destination is open.
        """
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        return memoryview((ctypes.c_char * n_bytes).from_address(address + offset)).cast("B")

    def view(self, offset: int, n_bytes: int) -> memoryview:
        """A writable view of ``n_bytes`` at ``offset``."""
        return memoryview(self.array[offset : offset + n_bytes])  # type: ignore[arg-type]

    def close(self) -> None:
        """Unmap (every view must have been released)."""
        del self.array
        self._map.close()

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ReplayResult:
    """One replay pass.

    Attributes:
        seconds: wall time.
        cpu_seconds: user + system CPU of this process (every thread).
        bytes_read: bytes the reads returned.
        n_reads: reads done.
        latencies: per read, seconds (submit to done).
        registered: io_uring replays: True when the buffers were registered (None otherwise).
    """

    seconds: float
    cpu_seconds: float
    bytes_read: int
    n_reads: int
    latencies: np.ndarray
    registered: bool | None = None


def replay_pread(reads: ReadList, dest: Destination, *, direct: bool, n_threads: int) -> ReplayResult:
    """``os.preadv`` every read from ``n_threads`` threads, ``O_DIRECT`` if ``direct``.

    Raises:
        OSError: a file cannot be opened (``O_DIRECT`` refused) or a read fails.
    """
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(p, flags) for p in reads.paths]
    rows = reads.reads.tolist()
    where = reads.destinations().tolist()
    lat = np.zeros(len(rows))
    views = [dest.view(w, n) for w, (_, _, n) in zip(where, rows, strict=True)]
    clock_fn = time.perf_counter

    def one(i: int) -> int:
        shard, offset, _n = rows[i]
        t0 = clock_fn()
        got = os.preadv(fds[shard], [views[i]], offset)
        lat[i] = clock_fn() - t0
        return got

    try:
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(lambda i: None, range(n_threads)))  # start the threads outside the clock
            with Clock() as clock:
                got = sum(pool.map(one, range(len(rows))))
    finally:
        for v in views:
            v.release()
        for fd in fds:
            os.close(fd)
    return ReplayResult(clock.seconds, clock.cpu, got, len(rows), lat)


def replay_mmap(reads: ReadList, dest: Destination) -> ReplayResult:
    """Copy every range out of a shared read-only mapping of its file, one thread, in order."""
    maps = []
    for p in reads.paths:
        with open(p, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    rows = reads.reads.tolist()
    where = reads.destinations().tolist()
    out = dest.array
    lat = np.zeros(len(rows))
    clock_fn: Callable[[], float] = time.perf_counter
    got = 0
    src: np.ndarray | None = None
    try:
        with Clock() as clock:
            for i, ((shard, offset, n), w) in enumerate(zip(rows, where, strict=True)):
                t0 = clock_fn()
                src = arrays[shard][offset : offset + n]
                out[w : w + len(src)] = src
                got += len(src)
                lat[i] = clock_fn() - t0
    finally:
        src = None  # drop the last export of a mapping before closing them
        del arrays
        for m in maps:
            m.close()
    return ReplayResult(clock.seconds, clock.cpu, got, len(rows), lat)


def uring_slot_bytes(reads: ReadList) -> int:
    """Bytes of one buffer of :func:`replay_uring`: the largest read, rounded up to the page."""
    return -(-reads.max_len // _PAGE) * _PAGE


def replay_uring(
    reads: ReadList, dest: Destination, depth: int, *, reused: bool = False, register: bool = True
) -> ReplayResult:
    """Every read through a minimal io_uring loop at ``depth`` (``O_DIRECT``).

    Buffer ``i`` is ``dest`` at ``i * uring_slot_bytes(reads)``: read ``i`` goes to buffer ``i``
    (distinct memory), or with ``reused`` to one of ``depth`` buffers, each reused as soon as its
    read completed (as fio does). With ``register`` the buffers are registered with the ring, in
    chunks of whole buffers up to 1 GiB, and read with ``READV_FIXED``, as the store and fio
    (``--fixedbufs``) do; if the kernel refuses, plain ``readv`` (``registered`` is then False).

    Raises:
        ValueError: ``dest`` is smaller than the buffers need.
        OSError: io_uring or ``O_DIRECT`` is not available, or a read failed.
    """
    reason = liburing_unusable_reason()
    if reason is not None:
        raise OSError(errno.ENOSYS, reason)
    import liburing as lu

    rows = reads.reads.tolist()
    slot = uring_slot_bytes(reads)
    n_buffers = min(depth, len(rows)) if reused else len(rows)
    if n_buffers * slot > dest.n_bytes:
        raise ValueError(f"{n_buffers} buffers of {slot} bytes do not fit in {dest.n_bytes} bytes")
    iovecs: dict[tuple[int, int], tuple[Any, memoryview]] = {}

    def iovec(b: int, n: int) -> Any:
        entry = iovecs.get((b, n))
        if entry is None:
            raw = dest.raw(b * slot, n)
            entry = iovecs[(b, n)] = (lu.Iovec([raw]), raw)
        return entry[0]

    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in reads.paths]
    ring, cqe = lu.Ring(), lu.Cqe()
    lu.io_uring_queue_init(max(depth, 1), ring)
    chunk = max(1, (1 << 30) // slot)
    registered: Any = None
    if register:
        spans = [dest.raw(c * slot, min(chunk, n_buffers - c) * slot) for c in range(0, n_buffers, chunk)]
        try:
            registered = (lu.Iovec(spans), spans)
            lu.io_uring_register_buffers(ring, registered[0])
        except OSError:
            registered = None
    free = list(range(n_buffers))[::-1]
    lat = np.zeros(len(rows))
    started = [0.0] * len(rows)
    nxt = in_flight = done = got = 0
    clock_fn = time.perf_counter
    try:
        with Clock() as clock:
            while done < len(rows):
                while in_flight < depth and nxt < len(rows):
                    b = free.pop() if reused else nxt
                    shard, offset, n = rows[nxt]
                    sqe = lu.io_uring_get_sqe(ring)
                    if registered is not None:
                        lu.io_uring_prep_readv_fixed(sqe, fds[shard], iovec(b, n), b // chunk, offset)
                    else:
                        lu.io_uring_prep_readv(sqe, fds[shard], iovec(b, n), offset)
                    lu.io_uring_sqe_set_data64(sqe, (nxt << 20) | (b + 1))
                    started[nxt] = clock_fn()
                    nxt += 1
                    in_flight += 1
                lu.io_uring_submit_and_wait(ring, 1)
                k = 0
                now = clock_fn()
                for _ in lu.CqeIter(ring, cqe):
                    entry = cqe[0]
                    got += entry.res
                    data = entry.user_data
                    lat[data >> 20] = now - started[data >> 20]
                    if reused:
                        free.append((data & 0xFFFFF) - 1)
                    k += 1
                lu.io_uring_cq_advance(ring, k)
                in_flight -= k
                done += k
    finally:
        lu.io_uring_queue_exit(ring)
        for fd in fds:
            os.close(fd)
        iovecs.clear()
        was_registered, registered = registered is not None, None
    return ReplayResult(clock.seconds, clock.cpu, got, len(rows), lat, was_registered)
