"""io_uring through raw system calls (:class:`~aioexperts._io.uring_raw.RawRing`), no ``liburing``.

The same contract and behaviour as :mod:`.uring` (one ring of ``depth`` entries, completions reaped
through an eventfd the event loop watches, registered buffers where the kernel allows), for
machines where the ``liburing`` wheel cannot run. Reads are ``IORING_OP_READ_FIXED`` into the
registered slab, or ``IORING_OP_READ`` when registration is refused, straight into slot memory
(the slab's address; no buffer export).

Memory safety, the first requirement:

- Every op is bounds-checked against its slot before any entry is written; a batch with one bad
  op is refused whole (``SubmitError(taken=0)``).
- A slot is written by the kernel from the ``io_uring_enter`` that consumed its entry until its
  CQE is reaped; the op is delivered (and the slot can be freed) only from that CQE. No cancel is
  issued while the store runs (a cancel never means "done" for O_DIRECT reads).
- Entries the kernel did not consume after a failed ``io_uring_enter`` are taken back
  (tail := head) before the failure is reported, so no read of a failed batch can start later.
- :meth:`RawUringBackend.close` with reads still in flight takes back the unconsumed entries,
  issues ``IORING_OP_ASYNC_CANCEL`` for every read the kernel has, and waits for every read's
  (and every cancel's) CQE before it unregisters the buffers or unmaps anything. The backend also
  holds an exporter of the slab from set-up until then, so even a slab closed too early stays
  mapped (``Slab.close`` leaves a mapping with live exporters to the garbage collector). If the
  reads do not complete within :attr:`RawUringBackend.drain_timeout`, nothing is released (the
  ring, the buffers and the slab stay mapped for the life of the process) and ``close`` raises.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, cast

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab
from ..uring_raw import (
    IORING_ENTER_GETEVENTS,
    IORING_OP_ASYNC_CANCEL,
    IORING_OP_READ,
    IORING_OP_READ_FIXED,
    IOSQE_ASYNC,
    READ_SQE_STRUCT,
    RawRing,
)
from .base import ReadOp, ReadResult, SubmitError
from .waiter import BatchedWakeupBackend

__all__ = ("RawUringBackend",)

log = logging.getLogger("aioexperts")

MAX_REGISTERED_BUFFER = 1 << 30  # the kernel's limit for one registered buffer
MAX_REGISTERED_BUFFERS = 1 << 14
#: the largest read one SQE may ask for (the kernel's MAX_RW_COUNT)
MAX_READ_BYTES = 0x7FFFF000
#: ``io_uring_enter`` errors that mean "not now": the entries stay published and go out later.
TRANSIENT_ERRNOS = frozenset((errno.EAGAIN, errno.EBUSY))
#: Submit attempts in a row that hand nothing to the kernel before the published reads are failed.
MAX_SUBMIT_STALLS = 64
#: user_data bit of the ``ASYNC_CANCEL`` entries issued by :meth:`RawUringBackend.close`.
CANCEL_BIT = 1 << 63
#: Processes keep what a close that timed out could not release safely (never collected).
_LEAKED: list[Any] = []


class RawUringBackend(BatchedWakeupBackend):
    """One raw io_uring of ``depth`` entries; every :meth:`submit` is one ``io_uring_enter``.

    The constructor sets up the ring, its eventfd and the registered buffers and touches no event
    loop, so it can run in a worker thread; :meth:`attach` (loop thread) starts watching the
    eventfd.

    Args:
        fixed_buffers: register the slab (in chunks of whole slots up to 1 GiB) and read with
            ``IORING_OP_READ_FIXED``; off (reason in :meth:`features`) where the kernel lacks the
            opcode or registration is refused (``RLIMIT_MEMLOCK``).
        sqe_async: set ``IOSQE_ASYNC``: kernel workers issue the reads, submit returns at once.
        ring_reason: why the raw ring serves rather than ``liburing`` (reported in :meth:`features`).
        cq_entries: CQ size (default: the kernel's, twice the SQ); tests use a small one.
        batch_wakeups: wake the event loop once per batch of completions rather than once per
            completion: a waiter thread blocks in ``io_uring_enter`` (GIL released) until as many
            completions as the scheduler's wake hint asks for (:meth:`IOBackend.set_wake_hint`: the
            fewest after which a waiting request can go on) are in the CQ, then writes the eventfd
            the loop watches. Without a hint, or where the kernel has no wait timeout
            (``IORING_FEAT_EXT_ARG``, Linux 5.11), every completion wakes the loop (the kernel
            writes the eventfd).

    Raises:
        OSError: ``io_uring_setup`` or a registration failed (``EPERM``: disabled by sysctl or
            seccomp; ``ENOSYS``: no io_uring, or no ``IORING_OP_READ`` before Linux 5.6;
            ``ENOTSUP``: no ``IORING_FEAT_NODROP``). Nothing is left open.
    """

    name = "io_uring"
    ends_batches = True

    def __init__(
        self,
        files: ShardFiles,
        slab: Slab,
        loop: LoopAdapter,
        depth: int,
        *,
        fixed_buffers: bool = True,
        sqe_async: bool = False,
        ring_reason: str | None = None,
        cq_entries: int | None = None,
        batch_wakeups: bool = True,
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self._init_wakeups()
        self.ring_reason = ring_reason
        self.drain_timeout = 30.0
        self._ops: dict[int, ReadOp] = {}
        # entries published and not consumed by the kernel: always the last ones published, whose
        # user_data are the last ones handed out (a take-back takes every one of them)
        self._n_unconsumed = 0
        self._taken_back: list[tuple[int, ReadOp]] = []  # reads unpublished by the last failed enter
        self._next_user_data = 1
        self._stalls = 0
        self._closed = False
        self._released = False
        self._chunk_slots = 0
        self._sqe_flags = IOSQE_ASYNC if sqe_async else 0
        self.fixed_buffers_reason: str | None = None if fixed_buffers else "fixed_buffers=False"
        self.submit_calls = 0
        self.unexpected_completions = 0
        self.cancelled_at_close = 0
        # held until every CQE is reaped: a slab closed meanwhile stays mapped (Slab.close)
        self._slab_pin: Any = slab.exporter(0, 0, 1, held_refs=1)
        self._ring = RawRing(depth, cq_entries=cq_entries)
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            if batch_wakeups and self._ring.can_wait_with_timeout:
                self._batching = True
            else:
                self._ring.register_eventfd(self._efd)
            opcodes = self._ring.supported_opcodes()
            if IORING_OP_READ not in opcodes:
                raise OSError(errno.ENOSYS, "the kernel has no IORING_OP_READ (Linux < 5.6)")
            self._can_cancel = IORING_OP_ASYNC_CANCEL in opcodes
            if fixed_buffers:
                if IORING_OP_READ_FIXED in opcodes:
                    self._chunk_slots = self._register_buffers()
                else:
                    self.fixed_buffers_reason = "the kernel has no IORING_OP_READ_FIXED"
        except BaseException:
            self._release()
            raise

    def _register_buffers(self) -> int:
        """Register the slab; the slots per registered chunk, or 0 (reason kept) when not possible."""
        slab = self.slab
        chunk_slots = MAX_REGISTERED_BUFFER // slab.slot_bytes
        if chunk_slots == 0:
            self.fixed_buffers_reason = f"a slot of {slab.slot_bytes} bytes is larger than a registered buffer"
            return 0
        n_chunks = -(-slab.n_slots // chunk_slots)
        if n_chunks > MAX_REGISTERED_BUFFERS:
            self.fixed_buffers_reason = (
                f"the slab needs {n_chunks} registered buffers (at most {MAX_REGISTERED_BUFFERS})"
            )
            return 0
        spans = []
        for c in range(n_chunks):
            first = c * chunk_slots
            n_bytes = min(chunk_slots, slab.n_slots - first) * slab.slot_bytes
            spans.append((slab.address + first * slab.slot_bytes, n_bytes))
        try:
            self._ring.register_buffers(spans)
        except OSError as exc:  # ENOMEM beyond RLIMIT_MEMLOCK: plain READ works
            self.fixed_buffers_reason = f"buffer registration refused ({exc})"
            log.debug("io_uring: %s; reading with IORING_OP_READ", self.fixed_buffers_reason)
            return 0
        return chunk_slots

    def features(self) -> dict[str, Any]:
        return {
            "ring": "raw system calls",
            "ring_reason": self.ring_reason,
            "fixed_buffers": self._chunk_slots > 0,
            "fixed_buffers_reason": None if self._chunk_slots else self.fixed_buffers_reason,
            "sqe_async": bool(self._sqe_flags),
            "batch_wakeups": self._batching,
            "wakeups": self.wakeups,
            "depth": self.depth,
            "submit_calls": self.submit_calls,
        }

    @property
    def ring(self) -> RawRing:
        """The ring (for tests and statistics)."""
        return self._ring

    @property
    def queued_entries(self) -> int:
        """Entries published but not consumed by the kernel yet (they go with the next enter)."""
        return self._n_unconsumed

    @property
    def nops_in_flight(self) -> int:
        """Always 0: this backend never leaves a NOP in the ring (same face as the liburing backend)."""
        return 0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` released the ring."""
        return self._released

    # -- loop attachment (loop thread) ----------------------------------------------------------

    def attach(self) -> None:
        if self._attached:
            return
        if self._ring.closed:
            raise RuntimeError("attach on a closed io_uring backend")
        self.loop.add_reader(self._efd, self._reap)
        self._attached = True
        if self._batching:
            self._start_waiter()

    def detach(self) -> None:
        if not self._attached:
            return
        self._attached = False
        self.loop.remove_reader(self._efd)
        if self._batching:
            self._stop_waiter()

    # -- batched wake-ups (loop thread; the waiter thread is BatchedWakeupBackend's) ----------------

    def _waiter_ring_fd(self) -> int:
        return self._ring.fd

    def _reads_in_kernel(self) -> int:
        return self._in_flight - self._n_unconsumed

    def _wake_per_completion(self) -> None:
        try:
            self._ring.register_eventfd(self._efd)
        except OSError:
            log.exception("io_uring: registering the eventfd again failed")
            self.loop.call_soon(self._reap)  # at least what is in the CQ now

    # -- submission (loop thread) ---------------------------------------------------------------

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self._closed:
            raise SubmitError("submit on a closed io_uring backend", 0)
        n = len(ops)
        if not n:
            return
        if self._in_flight + n > self.depth:
            raise SubmitError(f"{n} more reads would exceed the ring depth {self.depth}", 0)
        first = self._next_user_data
        try:
            self._write_entries(ops, first)
        except Exception as exc:  # nothing was published
            raise SubmitError(f"io_uring took 0 of {n} reads: {exc!r}", 0) from exc
        self._next_user_data = first + n
        self._ops.update(zip(range(first, first + n), ops, strict=True))
        self._n_unconsumed += n
        self._in_flight += n
        cause = self._enter()
        if cause is None:
            if self._batching:
                self._arm()
            return
        mine = [(ud, op) for ud, op in self._taken_back if ud >= first]
        earlier = [(op, cause) for ud, op in self._taken_back if ud < first]
        self._taken_back = []
        self._in_flight -= len(mine)
        if self._batching:
            self._arm()
        if earlier:
            self._fail_later(earlier)
        taken = n - len(mine)
        raise SubmitError(f"io_uring took {taken} of {n} reads: {cause!r}", taken) from cause

    def _write_entries(self, ops: Sequence[ReadOp], first_user_data: int) -> None:
        """Write and publish one SQE per op (user_data from ``first_user_data`` up), each op checked
        against its slot before its entry is written; any failure publishes none of the batch.

        One ``struct.pack_into`` of the read's eight fields per op straight into the SQE array (no
        tuple per entry; the other fields are written as zeros).
        """
        slab, fds = self.slab, self.files.fds
        if slab.closed:
            raise ValueError("the slab is closed")
        base, stride, n_slots, n_fds = slab.address, slab.slot_bytes, slab.n_slots, len(fds)
        chunk, flags = self._chunk_slots, self._sqe_flags
        opcode = IORING_OP_READ_FIXED if chunk else IORING_OP_READ
        sqes, tail, mask = self._ring.reserve(len(ops))
        pack = READ_SQE_STRUCT.pack_into
        user_data = first_user_data
        for op in ops:
            slot, start, n_bytes, shard, file_offset = op.slot, op.slot_offset, op.n_bytes, op.shard, op.file_offset
            if not (
                0 <= slot < n_slots and 0 <= start and 0 <= n_bytes <= MAX_READ_BYTES and start + n_bytes <= stride
            ):
                raise IndexError(f"{op!r} is outside its slot of {stride} bytes (or the slab of {n_slots} slots)")
            if not 0 <= shard < n_fds or file_offset < 0:
                raise IndexError(f"{op!r} names no open shard or a negative offset")
            pack(
                sqes,
                (tail & mask) << 6,
                opcode,
                flags,
                fds[shard],
                file_offset,
                base + slot * stride + start,
                n_bytes,
                user_data,
                slot // chunk if chunk else 0,
            )
            tail += 1
            user_data += 1
        self._ring.publish(len(ops))

    def _enter(self) -> Exception | None:
        """Hand every published entry to the kernel.

        Returns None when every entry went out, or when the kernel said "not now" (they go out on
        a later tick or completion). On a hard failure, takes back every entry the kernel did not
        consume (their reads go to ``_taken_back``) and returns the error.
        """
        ring = self._ring
        while self._n_unconsumed:
            before = self._n_unconsumed
            ret = ring.enter(before)
            self.submit_calls += 1
            self._n_unconsumed = left = ring.sq_unconsumed()
            consumed = before - left
            if consumed > 0:
                self._stalls = 0
                continue
            err = -ret if ret < 0 else errno.EAGAIN
            if err == errno.EINTR and self._stalls < MAX_SUBMIT_STALLS:
                self._stalls += 1
                continue
            if err in TRANSIENT_ERRNOS and self._stalls < MAX_SUBMIT_STALLS:
                self._stalls += 1
                self._schedule_submit()
                return None
            self._take_back()
            if ret >= 0:
                return OSError(errno.EBUSY, f"io_uring_enter made no progress {MAX_SUBMIT_STALLS} times")
            return OSError(err, f"io_uring_enter: {os.strerror(err)}")
        return None

    def _take_back(self) -> None:
        """Unpublish every entry the kernel has not consumed; those reads never happen."""
        taken_back = self._ring.unpublish()
        assert taken_back == self._n_unconsumed, (taken_back, self._n_unconsumed)
        last = self._next_user_data
        self._taken_back = [(ud, self._ops.pop(ud)) for ud in range(last - taken_back, last)]
        self._n_unconsumed = 0

    def _submit_pending(self) -> None:
        if not self._n_unconsumed:
            return
        cause = self._enter()
        if cause is not None:
            taken_back, self._taken_back = self._taken_back, []
            self._fail_later([(op, cause) for _, op in taken_back])
        if self._batching:
            self._arm()

    # -- completion (loop thread) ---------------------------------------------------------------

    def _reap(self) -> None:
        if not self._attached:
            return
        self._reaping()
        try:
            os.eventfd_read(self._efd)
        except OSError:  # BlockingIOError: nothing new
            pass
        try:
            users, results = self._ring.reap()
        except Exception:  # an overflow flush failed: what was reaped is lost to this call only
            log.exception("io_uring: reaping the completion queue failed")
            if self._batching:
                self._arm()
            return
        if users:
            in_flight = self._ops
            known = len(in_flight)
            pop = in_flight.pop
            found = [pop(user_data, None) for user_data in users]
            if known - len(in_flight) != len(found):  # a stranger or a duplicate: its read was accounted for
                kept = [(op, res) for op, res in zip(found, results, strict=True) if op is not None]
                self.unexpected_completions += len(found) - len(kept)
                found = [op for op, _ in kept]
                results = [res for _, res in kept]
            ops = cast(list[ReadOp], found)  # no None left
            outcomes = cast(list[ReadResult], results)  # the usual batch: every read returned its byte count
            if results and min(results) < 0:
                outcomes = [res if res >= 0 else OSError(-res, os.strerror(-res)) for res in results]
            if ops:
                self._deliver_reaped(ops, outcomes)
        if self._n_unconsumed:
            self._stalls = 0
            self._schedule_submit()
        if users:
            self._end_batch()
        if self._batching:
            self._arm()

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the ring; with reads in flight, cancel them and wait for every CQE first.

        The store calls this only once nothing is in flight; with reads in flight (an interrupted
        close, a host driving the backend itself) their completions are reaped here and not
        delivered. Blocking (up to :attr:`drain_timeout` seconds): call it off the loop.

        Raises:
            RuntimeError: attached and not on the loop thread; or the reads did not complete in
                :attr:`drain_timeout` (then nothing is released, see the module docstring).
        """
        if self._released:
            return
        if self._attached:
            if not self.loop.is_current():
                raise RuntimeError("the io_uring backend is attached: detach() it on the loop thread first")
            self.detach()
        self._closed = True
        self._join_waiter()
        if self._ops:
            self._drain()
        self._release()

    def _drain(self) -> None:
        ring = self._ring
        if self._n_unconsumed:  # never reached the kernel: take them back
            self._take_back()
            self._in_flight -= len(self._taken_back)
            self._taken_back = []
        n_reads = len(self._ops)
        cancels = 0
        if self._can_cancel:
            targets = list(self._ops)
            while targets:
                batch, targets = targets[: ring.sq_space()], targets[ring.sq_space() :]
                ring.queue([(IORING_OP_ASYNC_CANCEL, 0, -1, 0, ud, 0, CANCEL_BIT | ud, 0) for ud in batch])
                before = ring.sq_unconsumed()
                ret = ring.enter(before)
                consumed = before - ring.sq_unconsumed()
                cancels += consumed
                if consumed < len(batch):  # the kernel took no more: wait for the reads alone
                    ring.unpublish()
                    log.debug("io_uring: ASYNC_CANCEL not submitted (%d)", ret)
                    break
        deadline = time.monotonic() + self.drain_timeout
        while self._ops or cancels:
            ring.enter(0, 0, IORING_ENTER_GETEVENTS)  # runs this thread's completion work, flushes overflow
            users, results = ring.reap()
            for user_data, res in zip(users, results, strict=True):
                if user_data & CANCEL_BIT:
                    cancels -= 1
                elif self._ops.pop(user_data, None) is not None:
                    self._in_flight -= 1
                    self.cancelled_at_close += res == -errno.ECANCELED
            if not (self._ops or cancels):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _LEAKED.append((self._ring, self._efd, self._slab_pin, self.slab))
                self._released = True
                raise RuntimeError(
                    f"{len(self._ops)} io_uring reads did not complete in {self.drain_timeout:.0f} s; the ring and "
                    "the slab stay mapped for the life of the process"
                )
            if self._batching:  # the kernel does not write the eventfd: wait in the ring itself
                ring.wait_cqes(1, min(remaining, 0.05))
            else:
                ring.wait(self._efd, min(remaining, 0.05))
        log.warning(
            "io_uring closed with %d reads in flight: cancelled or waited for, every completion reaped",
            n_reads,
        )

    def _release(self) -> None:
        """Unregister the buffers, unmap the ring, close the eventfd, drop the slab pin; each once."""
        self._released = True
        try:
            if self._chunk_slots and not self._ring.closed:
                self._chunk_slots = 0
                try:
                    self._ring.unregister_buffers()
                except OSError:  # closing the ring unregisters them too
                    log.debug("io_uring: unregistering the buffers failed", exc_info=True)
            self._ring.close()
        finally:
            try:
                if self._efd >= 0:
                    efd, self._efd = self._efd, -1
                    os.close(efd)
                if self._go >= 0:
                    go, self._go = self._go, -1
                    os.close(go)
            finally:
                self._slab_pin = None
                self._n_unconsumed = 0
