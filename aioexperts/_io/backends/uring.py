"""io_uring through the ``liburing`` wrapper: one ring, completions reaped via an eventfd.

Sharp edges of the wrapper this module is built around (measured, see docs/architecture.md):

- ``Iovec`` keeps raw pointers and never releases the buffer it took, so one ``Iovec`` per
  (slot, offset, length) is built once from :meth:`Slab.raw_buffer` (no export of the mmap) and
  kept for the backend's lifetime.
- ``user_data`` is an int that is never 0 (a prep that fails leaves a zeroed NOP in the queue).
- ``submit`` holds the GIL while it runs; nothing here ever waits in the kernel: the event loop
  watches the ring's eventfd and :meth:`_reap` walks the ready completions without blocking.
- A cancel never means "done": a slot is free only after its own completion arrived.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

import liburing as lu

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab
from .base import IOBackend, ReadOp

__all__ = ("UringBackend",)

log = logging.getLogger("aioexperts")

MAX_REGISTERED_BUFFER = 1 << 30  # the kernel's limit for one registered buffer
MAX_REGISTERED_BUFFERS = 1 << 14


class UringBackend(IOBackend):
    """One io_uring of ``depth`` entries; every :meth:`submit` is one ``io_uring_submit``.

    Args:
        fixed_buffers: register the slab (in chunks of whole slots up to 1 GiB) and use
            ``READV_FIXED``, which about halves the kernel CPU per read; silently off where the
            kernel or ``RLIMIT_MEMLOCK`` refuses.
        sqe_async: set ``IOSQE_ASYNC`` so that submit returns at once and kernel workers issue
            the reads (less time on the loop thread, more CPU in total).

    Raises:
        OSError: ``io_uring_queue_init`` failed (``EPERM``: disabled by sysctl or seccomp;
            ``ENOSYS``: no io_uring in this kernel). Nothing is left open.
    """

    name = "io_uring"

    def __init__(
        self,
        files: ShardFiles,
        slab: Slab,
        loop: LoopAdapter,
        depth: int,
        *,
        fixed_buffers: bool = True,
        sqe_async: bool = False,
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self._ring = lu.Ring()
        lu.io_uring_queue_init(depth, self._ring)
        self._efd = -1
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            lu.io_uring_register_eventfd(self._ring, self._efd)
            self._chunk_slots = self._register_buffers() if fixed_buffers else 0
            self.loop.add_reader(self._efd, self._reap)
        except BaseException:
            if self._efd >= 0:
                os.close(self._efd)
            lu.io_uring_queue_exit(self._ring)
            raise
        self._sqe_flags = lu.IOSQE_ASYNC if sqe_async else 0
        self._cqe = lu.Cqe()
        self._iovecs: dict[tuple[int, int, int], tuple[Any, memoryview]] = {}
        self._ops: dict[int, ReadOp] = {}
        self._next_user_data = 1
        self._closed = False
        self.submit_calls = 0

    def _register_buffers(self) -> int:
        slab = self.slab
        chunk_slots = MAX_REGISTERED_BUFFER // slab.slot_bytes
        if chunk_slots == 0:
            return 0
        n_chunks = -(-slab.n_slots // chunk_slots)
        if n_chunks > MAX_REGISTERED_BUFFERS:
            return 0
        probe = lu.io_uring_get_probe_ring(self._ring)
        try:
            if not lu.io_uring_opcode_supported(probe, lu.io_uring_op.IORING_OP_READV_FIXED):
                return 0
        finally:
            lu.io_uring_free_probe(probe)
        buffers = []
        for c in range(n_chunks):
            first = c * chunk_slots
            n = min(chunk_slots, slab.n_slots - first) * slab.slot_bytes
            buffers.append(_raw(slab, first, n))
        self._registered = (lu.Iovec(buffers), buffers)
        try:
            lu.io_uring_register_buffers(self._ring, self._registered[0])
        except OSError as exc:
            log.debug("io_uring buffer registration refused (%s); using plain readv", exc)
            return 0
        return chunk_slots

    def features(self) -> dict[str, Any]:
        return {
            "fixed_buffers": self._chunk_slots > 0,
            "sqe_async": bool(self._sqe_flags),
            "depth": self.depth,
            "submit_calls": self.submit_calls,
        }

    def _iovec(self, op: ReadOp) -> Any:
        key = (op.slot, op.slot_offset, op.n_bytes)
        entry = self._iovecs.get(key)
        if entry is None:
            raw = self.slab.raw_buffer(op.slot, op.slot_offset, op.n_bytes)
            entry = self._iovecs[key] = (lu.Iovec([raw]), raw)
        return entry[0]

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self._closed:
            raise RuntimeError("submit on a closed io_uring backend")
        if self._in_flight + len(ops) > self.depth:
            raise RuntimeError(f"{len(ops)} more reads would exceed the ring depth {self.depth}")
        ring, fds, flags, chunk = self._ring, self.files.fds, self._sqe_flags, self._chunk_slots
        for op in ops:
            sqe = lu.io_uring_get_sqe(ring)
            if sqe is None:  # cannot happen while in_flight <= depth; fail loudly rather than drop
                raise RuntimeError("io_uring submission queue is full")
            iov = self._iovec(op)
            if chunk:
                lu.io_uring_prep_readv_fixed(sqe, fds[op.shard], iov, op.slot // chunk, op.file_offset)
            else:
                lu.io_uring_prep_readv(sqe, fds[op.shard], iov, op.file_offset)
            if flags:
                lu.io_uring_sqe_set_flags(sqe, flags)
            user_data = self._next_user_data
            self._next_user_data += 1
            lu.io_uring_sqe_set_data64(sqe, user_data)
            self._ops[user_data] = op
            self._in_flight += 1
        self._submit_all()

    def _submit_all(self) -> None:
        while lu.io_uring_sq_ready(self._ring):
            try:
                lu.io_uring_submit(self._ring)
                self.submit_calls += 1
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EBUSY, errno.EINTR):
                    # The kernel is short of resources: completions will free some; retry then.
                    self.loop.call_soon(self._submit_all)
                    return
                raise

    def _reap(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        ring, cqe = self._ring, self._cqe
        done: list[tuple[int, int | OSError]] = []
        for _ in lu.CqeIter(ring, cqe):
            entry = cqe[0]
            user_data = entry.user_data
            try:
                result: int | OSError = entry.res
            except OSError as exc:
                result = exc
            done.append((user_data, result))
        if done:
            lu.io_uring_cq_advance(ring, len(done))
        for user_data, result in done:
            op = self._ops.pop(user_data, None)
            if op is not None:
                self._deliver(op, result)

    def close(self) -> None:
        if self._closed:
            return
        if self._in_flight:
            raise RuntimeError(f"closing the io_uring backend with {self._in_flight} reads in flight")
        self._closed = True
        self.loop.remove_reader(self._efd)
        lu.io_uring_queue_exit(self._ring)
        os.close(self._efd)
        self._iovecs.clear()


def _raw(slab: Slab, first_slot: int, n_bytes: int) -> memoryview:
    """Slab memory from ``first_slot`` for ``n_bytes`` (may span slots), without a buffer export."""
    return slab.raw_span(first_slot * slab.slot_bytes, n_bytes)
