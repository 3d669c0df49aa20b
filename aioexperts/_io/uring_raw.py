"""An io_uring ring driven through the raw system calls: ``io_uring_setup`` / ``_enter`` / ``_register``.

No ``liburing``: the three system calls go through ``ctypes`` (libc's ``syscall``), and the
submission queue (SQ) ring, the completion queue (CQ) ring and the SQE array are ``mmap``-ed from
the ring's descriptor with numpy views over them. This is what the io_uring backend uses where the
PyPI ``liburing`` wheel cannot run (it needs AVX-512: ``uring_probe.py``).

Ring protocol (``io_uring(7)``, ``include/uapi/linux/io_uring.h``):

- Submission: write the SQE at ``tail & mask``, then publish the new tail (a store after the
  SQE's stores; x86 is TSO and every numpy write here is a separate call, so program order holds);
  ``io_uring_enter(to_submit)`` makes the kernel consume entries up to the tail and advance the SQ
  head. The SQ index array is the identity, written once.
- Completion: read the CQ tail (the kernel's), copy the CQEs between head and tail out, *then*
  store the new head, which hands those entries back to the kernel.
- Head and tail are free-running ``u32`` counters: differences and indices are taken modulo
  2**32 and masked with ``ring_mask``.
- Overflow: the ring requires ``IORING_FEAT_NODROP`` (Linux 5.5): a completion that finds the CQ
  full is kept by the kernel and ``IORING_SQ_CQ_OVERFLOW`` is set; :meth:`RawRing.reap` then calls
  ``io_uring_enter(GETEVENTS)`` (non-waiting) to flush them into the CQ and reaps again. Kernels
  without NODROP (which drop completions) are refused: a lost completion is a slot that can never
  be freed safely.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import select
import struct
import time
from collections.abc import Sequence

import numpy as np

__all__ = (
    "IORING_ENTER_GETEVENTS",
    "IORING_OP_ASYNC_CANCEL",
    "IORING_OP_NOP",
    "IORING_OP_READ",
    "IORING_OP_READ_FIXED",
    "IOSQE_ASYNC",
    "READ_SQE_STRUCT",
    "SQE_STRUCT",
    "RawRing",
    "raw_ring_unusable_reason",
    "wait_cqes",
)

# x86_64 and every asm-generic architecture share these numbers (Linux 5.1)
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
SYS_IO_URING_REGISTER = 427

IORING_OP_NOP = 0
IORING_OP_READ_FIXED = 4
IORING_OP_ASYNC_CANCEL = 14
IORING_OP_READ = 22

IOSQE_ASYNC = 1 << 4
IORING_SETUP_CQSIZE = 1 << 3
IORING_SETUP_SUBMIT_ALL = 1 << 7
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_FEAT_NODROP = 1 << 1
IORING_ENTER_GETEVENTS = 1 << 0
IORING_ENTER_EXT_ARG = 1 << 3
IORING_FEAT_EXT_ARG = 1 << 8
IORING_SQ_CQ_OVERFLOW = 1 << 1
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_REGISTER_BUFFERS = 0
IORING_UNREGISTER_BUFFERS = 1
IORING_REGISTER_EVENTFD = 4
IORING_UNREGISTER_EVENTFD = 5
IORING_REGISTER_PROBE = 8
IO_URING_OP_SUPPORTED = 1
MAX_ENTRIES = 32768
_U32 = 0xFFFFFFFF

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_L = ctypes.c_long
#: ``syscall`` again, typed for ``io_uring_enter`` (six ``long`` arguments after the number): the
#: hot path passes plain ints instead of building a ``c_long`` per argument.
_enter_syscall = ctypes.CDLL(None, use_errno=True).syscall
_enter_syscall.restype = ctypes.c_long
_enter_syscall.argtypes = [ctypes.c_long] * 7

#: One SQE (64 bytes), as the kernel reads it.
SQE_DTYPE = np.dtype(
    [
        ("opcode", "u1"),
        ("flags", "u1"),
        ("ioprio", "<u2"),
        ("fd", "<i4"),
        ("off", "<u8"),
        ("addr", "<u8"),
        ("len", "<u4"),
        ("rw_flags", "<u4"),
        ("user_data", "<u8"),
        ("buf_index", "<u2"),
        ("personality", "<u2"),
        ("splice_fd_in", "<i4"),
        ("addr3", "<u8"),
        ("pad", "<u8"),
    ]
)
#: One CQE (16 bytes; no IORING_SETUP_CQE32).
CQE_DTYPE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])
assert SQE_DTYPE.itemsize == 64 and CQE_DTYPE.itemsize == 16
#: The same SQE for ``struct.pack_into`` (one call per entry: cheaper than numpy for small batches).
SQE_STRUCT = struct.Struct("<BBHiQQIIQHHiQQ")
_SQE = SQE_STRUCT
assert _SQE.size == 64
#: A read's SQE with only the fields a read sets: (opcode, flags, fd, off, addr, len, user_data,
#: buf_index); ``ioprio``, ``rw_flags``, ``personality``, ``splice_fd_in``, ``addr3`` and the pad are
#: pad bytes, which ``pack_into`` writes as zeros (the whole 64 bytes are written, nothing of an
#: earlier use of the entry survives). Half the arguments of :data:`SQE_STRUCT`: cheaper per read.
READ_SQE_STRUCT = struct.Struct("<BBxxiQQI4xQH22x")
assert READ_SQE_STRUCT.size == 64
#: One entry for :meth:`RawRing.queue`: (opcode, flags, fd, file offset, address, length, user_data, buf_index).
SQEntry = tuple[int, int, int, int, int, int, int, int]


class _SQOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped")] + [
        ("array", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _CQOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes")] + [
        ("flags", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu", "sq_thread_idle")),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SQOffsets),
        ("cq_off", _CQOffsets),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


class _GeteventsArg(ctypes.Structure):
    """``struct io_uring_getevents_arg`` (``IORING_ENTER_EXT_ARG``, Linux 5.11): a timeout for a wait."""

    _fields_ = [
        ("sigmask", ctypes.c_uint64),
        ("sigmask_sz", ctypes.c_uint32),
        ("min_wait_usec", ctypes.c_uint32),
        ("ts", ctypes.c_uint64),
    ]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _ProbeOp(ctypes.Structure):
    _fields_ = [
        ("op", ctypes.c_uint8),
        ("resv", ctypes.c_uint8),
        ("flags", ctypes.c_uint16),
        ("resv2", ctypes.c_uint32),
    ]


class _Probe(ctypes.Structure):
    _fields_ = [
        ("last_op", ctypes.c_uint8),
        ("ops_len", ctypes.c_uint8),
        ("resv", ctypes.c_uint16),
        ("resv2", ctypes.c_uint32 * 3),
        ("ops", _ProbeOp * 256),
    ]


assert ctypes.sizeof(_Params) == 120


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def wait_cqes(ring_fd: int, min_complete: int, timeout: float) -> int:
    """:meth:`RawRing.wait_cqes` on a ring's descriptor (a duplicate of it works: same ring)."""
    seconds = max(timeout, 0.0)
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    arg = _GeteventsArg(0, 0, 0, ctypes.addressof(ts))
    ret: int = _enter_syscall(
        SYS_IO_URING_ENTER,
        ring_fd,
        0,
        min_complete,
        IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG,
        ctypes.addressof(arg),
        ctypes.sizeof(arg),
    )
    return ret if ret >= 0 else -ctypes.get_errno()


def raw_ring_unusable_reason() -> str | None:
    """Why a raw ring cannot be had on this platform at all (not Linux, unknown syscall numbers), or None."""
    if platform.system() != "Linux":
        return f"io_uring needs Linux, this is {platform.system()}"
    if platform.machine() not in ("x86_64", "aarch64", "riscv64", "loongarch64"):
        return f"the io_uring system call numbers are not known here for {platform.machine()}"
    return None


class RawRing:
    """One io_uring: the descriptor, the three mappings and numpy views over them.

    Not thread-safe: one thread submits and reaps at a time (the backend: the loop thread, then
    the closing thread once detached).

    Args:
        entries: SQ entries (1..32768; the kernel rounds up to a power of two).
        cq_entries: CQ entries (default: the kernel's, twice the SQ); at least ``entries``.

    Attributes:
        fd: the ring's descriptor (-1 once closed).
        sq_entries, cq_entries: the sizes the kernel gave.
        submit_all: ``IORING_SETUP_SUBMIT_ALL`` took (an SQE that fails does not stop the batch).
        features: the kernel's ``IORING_FEAT_*`` bits for this ring.

    Raises:
        OSError: ``io_uring_setup`` failed (``EPERM``: disabled by sysctl or seccomp; ``ENOSYS``:
            no io_uring; ``EINVAL``: bad sizes), a mapping failed, or the kernel lacks
            ``IORING_FEAT_NODROP`` (``ENOTSUP``). Nothing is left open.
    """

    #: Flags tried first (dropped, in one step, by a kernel that refuses them with EINVAL).
    preferred_flags = IORING_SETUP_SUBMIT_ALL

    def __init__(self, entries: int, *, cq_entries: int | None = None) -> None:
        self.fd = -1
        self._maps: list[mmap.mmap] = []
        self.submit_all = True
        params = self._setup(entries, cq_entries, self.preferred_flags)
        self.features = int(params.features)
        try:
            if not params.features & IORING_FEAT_NODROP:
                raise OSError(errno.ENOTSUP, "io_uring without IORING_FEAT_NODROP (Linux < 5.5) may drop completions")
            self._map(params)
        except BaseException:
            self.close()
            raise

    def _setup(self, entries: int, cq_entries: int | None, extra_flags: int) -> _Params:
        if not 1 <= entries <= MAX_ENTRIES:
            raise OSError(errno.EINVAL, f"io_uring entries must be 1..{MAX_ENTRIES}, got {entries}")
        for flags in (extra_flags, 0):
            params = _Params()
            params.flags = flags
            if cq_entries is not None:
                params.flags |= IORING_SETUP_CQSIZE
                params.cq_entries = cq_entries
            fd = _syscall(_L(SYS_IO_URING_SETUP), _L(entries), ctypes.byref(params))
            if fd >= 0:
                self.fd = fd
                self.submit_all = bool(flags & IORING_SETUP_SUBMIT_ALL)
                return params
            err = ctypes.get_errno()
            if err != errno.EINVAL or not flags:  # EINVAL with SUBMIT_ALL: a kernel before 5.18
                raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        raise AssertionError("unreachable")

    def _map(self, p: _Params) -> None:
        sq, cq = p.sq_off, p.cq_off
        self.sq_entries: int = int(p.sq_entries)
        self.cq_entries: int = int(p.cq_entries)
        sq_bytes = sq.array + p.sq_entries * 4
        cq_bytes = cq.cqes + p.cq_entries * CQE_DTYPE.itemsize
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_mm = cq_mm = mmap.mmap(self.fd, max(sq_bytes, cq_bytes), flags, prot, offset=IORING_OFF_SQ_RING)
            self._maps.append(sq_mm)
        else:
            sq_mm = mmap.mmap(self.fd, sq_bytes, flags, prot, offset=IORING_OFF_SQ_RING)
            self._maps.append(sq_mm)
            cq_mm = mmap.mmap(self.fd, cq_bytes, flags, prot, offset=IORING_OFF_CQ_RING)
            self._maps.append(cq_mm)
        sqe_mm = mmap.mmap(self.fd, p.sq_entries * SQE_DTYPE.itemsize, flags, prot, offset=IORING_OFF_SQES)
        self._maps.append(sqe_mm)
        sq32 = np.frombuffer(sq_mm, np.uint32)
        cq32 = np.frombuffer(cq_mm, np.uint32)
        self._sq_head = sq32[sq.head // 4 : sq.head // 4 + 1]
        self._sq_tail = sq32[sq.tail // 4 : sq.tail // 4 + 1]
        self._sq_flags = sq32[sq.flags // 4 : sq.flags // 4 + 1]
        self._sq_dropped = sq32[sq.dropped // 4 : sq.dropped // 4 + 1]
        self.sq_mask = int(sq32[sq.ring_mask // 4])
        sq_array = sq32[sq.array // 4 : sq.array // 4 + p.sq_entries]
        sq_array[:] = np.arange(p.sq_entries, dtype=np.uint32)  # SQ slot i always holds SQE i
        self._cq_head = cq32[cq.head // 4 : cq.head // 4 + 1]
        self._cq_tail = cq32[cq.tail // 4 : cq.tail // 4 + 1]
        self._cq_overflow = cq32[cq.overflow // 4 : cq.overflow // 4 + 1]
        self.cq_mask = int(cq32[cq.ring_mask // 4])
        self.sqes = np.frombuffer(sqe_mm, SQE_DTYPE, count=p.sq_entries)
        self.cqes = np.frombuffer(cq_mm, CQE_DTYPE, count=p.cq_entries, offset=cq.cqes)
        del sq32, cq32, sq_array
        # the hot path goes through memoryviews (an element access is far cheaper than numpy's)
        self._sqe_mm = sqe_mm
        self._views: list[memoryview] = []
        sq_mv, cq_mv = self._view(memoryview(sq_mm)), self._view(memoryview(cq_mm))

        def u32(mv: memoryview, offset: int) -> memoryview:
            return self._view(self._view(mv[offset : offset + 4]).cast("I"))

        self._mv_sq_head, self._mv_sq_tail, self._mv_sq_flags = (u32(sq_mv, o) for o in (sq.head, sq.tail, sq.flags))
        self._mv_cq_head, self._mv_cq_tail = u32(cq_mv, cq.head), u32(cq_mv, cq.tail)
        cqe_bytes = self._view(cq_mv[cq.cqes : cq.cqes + p.cq_entries * CQE_DTYPE.itemsize])
        self._cqe_u64 = self._view(cqe_bytes.cast("Q"))
        self._cqe_i32 = self._view(cqe_bytes.cast("i"))
        self._tail = self._mv_sq_tail[0]  # our copy: the kernel never writes the SQ tail

    def _view(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    # -- state ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def sq_unconsumed(self) -> int:
        """Entries published (tail) that the kernel has not consumed (head) yet."""
        return (self._tail - self._mv_sq_head[0]) & _U32

    def sq_space(self) -> int:
        """Free SQ entries."""
        return self.sq_entries - self.sq_unconsumed()

    def cq_ready(self) -> int:
        """CQEs posted and not reaped."""
        return (self._mv_cq_tail[0] - self._mv_cq_head[0]) & _U32

    @property
    def cq_overflow_pending(self) -> bool:
        """The kernel holds completions that did not fit in the CQ (``IORING_SQ_CQ_OVERFLOW``)."""
        return bool(self._mv_sq_flags[0] & IORING_SQ_CQ_OVERFLOW)

    @property
    def cq_overflow_count(self) -> int:
        """The CQ ring's ``overflow`` counter (completions the kernel could not post at once)."""
        return int(self._cq_overflow[0])

    @property
    def counters(self) -> tuple[int, int]:
        """(SQ tail, CQ head): the free-running u32 counters, for tests of the wrap-around."""
        return self._tail, self._mv_cq_head[0]

    # -- submission ---------------------------------------------------------------------------------

    def queue(self, entries: Sequence[SQEntry]) -> None:
        """Write one SQE per entry and publish them (the tail moves; nothing enters the kernel).

        Each entry is ``(opcode, flags, fd, file offset, address, length, user_data, buf_index)``.
        Every field of the 64-byte SQE is written, so nothing of an earlier use of the entry
        survives. Raises ``OSError(EBUSY)`` when the SQ lacks space, ``struct.error`` for a field
        out of range; either way nothing is published.
        """
        n = len(entries)
        if n > self.sq_space():
            raise OSError(errno.EBUSY, f"{n} entries do not fit in the {self.sq_space()} free SQ entries")
        tail, mask, pack, sqes = self._tail, self.sq_mask, _SQE.pack_into, self._sqe_mm
        for i, (opcode, flags, fd, off, addr, length, user_data, buf_index) in enumerate(entries):
            pack(
                sqes,
                ((tail + i) & mask) << 6,
                opcode,
                flags,
                0,
                fd,
                off,
                addr,
                length,
                0,
                user_data,
                buf_index,
                0,
                0,
                0,
                0,
            )
        self._tail = (tail + n) & _U32  # the entries first ...
        self._mv_sq_tail[0] = self._tail  # ... then the tail that publishes them

    def reserve(self, n: int) -> tuple[memoryview | mmap.mmap, int, int]:
        """Room for ``n`` SQEs: ``(sqe memory, first index, mask)``; write them, then :meth:`publish`.

        SQE ``k`` of the batch is the 64 bytes at ``((first + k) & mask) << 6``; the caller must
        write every field of each (as :meth:`queue` does). Nothing is visible to the kernel until
        :meth:`publish`: a batch abandoned half-written is simply overwritten by the next one.
        Raises ``OSError(EBUSY)`` when the SQ lacks space.
        """
        if n > self.sq_space():
            raise OSError(errno.EBUSY, f"{n} entries do not fit in the {self.sq_space()} free SQ entries")
        return self._sqe_mm, self._tail, self.sq_mask

    def publish(self, n: int) -> None:
        """Publish the ``n`` SQEs written after :meth:`reserve` (the tail moves after their stores)."""
        self._tail = (self._tail + n) & _U32
        self._mv_sq_tail[0] = self._tail

    def unpublish(self) -> int:
        """Take back every published entry the kernel has not consumed (tail := head); how many.

        Safe only because entries are consumed inside ``io_uring_enter`` on this ring's user
        thread (no SQPOLL): between two enters the kernel does not look at the SQ.
        """
        head = self._mv_sq_head[0]
        taken_back = (self._tail - head) & _U32
        self._tail = head
        self._mv_sq_tail[0] = head
        return taken_back

    def enter(self, to_submit: int, min_complete: int = 0, flags: int = 0) -> int:
        """``io_uring_enter``; the kernel's count of entries consumed, or ``-errno``."""
        ret: int = _enter_syscall(SYS_IO_URING_ENTER, self.fd, to_submit, min_complete, flags, 0, 0)
        return ret if ret >= 0 else -ctypes.get_errno()

    # -- completion ---------------------------------------------------------------------------------

    def reap(self) -> tuple[list[int], list[int]]:
        """Every CQE ready now, without waiting: (user_data list, res list), in CQ order.

        The entries between head and tail are copied out in bulk (at most two strided
        memoryview slices, one per side of the ring's wrap-around; no Python step per CQE), then
        the head moves past them. Flushes completions the kernel holds after a CQ overflow (a
        non-waiting ``io_uring_enter(GETEVENTS)``) and reaps those too.
        """
        users: list[int] = []
        results: list[int] = []
        u64, i32, entries = self._cqe_u64, self._cqe_i32, self.cq_entries
        cq_head, cq_tail, sq_flags = self._mv_cq_head, self._mv_cq_tail, self._mv_sq_flags
        while True:
            head = cq_head[0]
            n = (cq_tail[0] - head) & _U32  # the tail first ...
            if n:
                first = head & self.cq_mask  # ... the entries copied out ...
                stop = first + n
                if stop <= entries:
                    users += u64[2 * first : 2 * stop : 2].tolist()
                    results += i32[4 * first + 2 : 4 * stop : 4].tolist()
                else:  # wrapped: [first, entries) then [0, stop - entries)
                    stop -= entries
                    users += u64[2 * first :: 2].tolist()
                    users += u64[: 2 * stop : 2].tolist()
                    results += i32[4 * first + 2 :: 4].tolist()
                    results += i32[2 : 4 * stop : 4].tolist()
                cq_head[0] = (head + n) & _U32  # ... then hand them back to the kernel
            if not sq_flags[0] & IORING_SQ_CQ_OVERFLOW:
                return users, results
            ret = self.enter(0, 0, IORING_ENTER_GETEVENTS)
            if ret < 0 and -ret not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise OSError(-ret, f"io_uring_enter(GETEVENTS) to flush the CQ overflow: {os.strerror(-ret)}")
            if not n and self.cq_ready() == 0 and self.cq_overflow_pending:
                time.sleep(0)  # the kernel is flushing: let it

    @property
    def can_wait_with_timeout(self) -> bool:
        """The kernel takes a timeout for a wait in ``io_uring_enter`` (``IORING_FEAT_EXT_ARG``, Linux 5.11)."""
        return bool(self.features & IORING_FEAT_EXT_ARG)

    def wait_cqes(self, min_complete: int, timeout: float) -> int:
        """Block until at least ``min_complete`` CQEs are ready (not reaped yet, counted from the CQ
        head) or ``timeout`` seconds pass. Returns ``io_uring_enter``'s result: ``>= 0`` once
        ``min_complete`` are ready, and also at the timeout when fewer but some are; ``-ETIME`` at
        the timeout with none; ``-EINTR`` on a signal; another ``-errno`` on failure. Reaps nothing.

        The GIL is released while it waits (a ``ctypes`` call), so another thread may wait here
        while the owner submits and reaps; needs :attr:`can_wait_with_timeout`.
        """
        return wait_cqes(self.fd, min_complete, timeout)

    def wait(self, efd: int, timeout: float) -> None:
        """Block up to ``timeout`` seconds until ``efd`` (the ring's eventfd) is readable, and drain it."""
        ready, _, _ = select.select([efd], [], [], max(timeout, 0.0))
        if ready:
            try:
                os.eventfd_read(efd)
            except BlockingIOError:
                pass

    # -- registration -------------------------------------------------------------------------------

    def register(self, opcode: int, arg: ctypes._CData | None, nr_args: int) -> None:
        """``io_uring_register``; raises ``OSError`` on failure."""
        ptr = ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p) if arg is not None else ctypes.c_void_p(0)
        _check(
            _syscall(_L(SYS_IO_URING_REGISTER), _L(self.fd), _L(opcode), ptr, _L(nr_args)),
            f"io_uring_register({opcode})",
        )

    def register_eventfd(self, efd: int) -> None:
        self.register(IORING_REGISTER_EVENTFD, ctypes.c_int32(efd), 1)

    def register_buffers(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, bytes)`` spans as fixed buffers 0, 1, ... (pins their pages)."""
        iovecs = (_Iovec * len(spans))(*(_Iovec(addr, n) for addr, n in spans))
        self.register(IORING_REGISTER_BUFFERS, iovecs, len(spans))

    def unregister_buffers(self) -> None:
        self.register(IORING_UNREGISTER_BUFFERS, None, 0)

    def supported_opcodes(self) -> frozenset[int]:
        """Opcodes this kernel supports (``IORING_REGISTER_PROBE``, Linux 5.6)."""
        probe = _Probe()
        self.register(IORING_REGISTER_PROBE, probe, 256)
        return frozenset(
            int(probe.ops[i].op) for i in range(probe.ops_len) if probe.ops[i].flags & IO_URING_OP_SUPPORTED
        )

    # -- teardown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the views, unmap the rings, close the descriptor; idempotent.

        The caller must have reaped the completion of everything it submitted first (the
        kernel would otherwise go on with those reads after the descriptor is gone).
        """
        for view in reversed(self.__dict__.pop("_views", [])):
            view.release()
        for name in (
            "sqes",
            "cqes",
            "_sq_head",
            "_sq_tail",
            "_sq_flags",
            "_sq_dropped",
            "_cq_head",
            "_cq_tail",
            "_cq_overflow",
            "_sqe_mm",
            "_mv_sq_head",
            "_mv_sq_tail",
            "_mv_sq_flags",
            "_mv_cq_head",
            "_mv_cq_tail",
            "_cqe_u64",
            "_cqe_i32",
        ):
            self.__dict__.pop(name, None)
        maps, self._maps = self._maps, []
        try:
            for mm in maps:
                mm.close()
        finally:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)
