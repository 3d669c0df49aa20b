"""io_uring through the ``liburing`` wrapper: one ring, completions reaped via an eventfd.

Sharp edges of the wrapper this module is built around (measured, see docs/architecture.md):

- ``Iovec`` keeps raw pointers and never releases the buffer it took, so one ``Iovec`` per
  (slot, offset, length) is built once from :meth:`Slab.raw_buffer` (no export of the mmap) and
  kept for the backend's lifetime.
- ``io_uring_get_sqe`` does not clear the entry it returns: a prep that raises leaves whatever
  the entry held before in the queue (a zeroed NOP on first use, *the previous read* with its old
  user_data once the ring has wrapped). Such an entry is rewritten as an explicit NOP with
  user_data 0 at once, and real reads use user_data from 1 up, never reused.
- A prepared entry that ``io_uring_submit`` did not hand to the kernel stays in the queue and
  goes out with the next submit. When submitting fails for good, every entry the kernel has not
  consumed is rewritten as a NOP in place (the kernel reads entries only inside
  ``io_uring_enter``, on this thread), so no read of a failed batch can land later in a slot
  that was given to another expert. If even that fails, the ring is marked broken and never
  entered again (``io_uring_queue_exit`` discards what is left in the queue).
- ``submit`` holds the GIL while it runs; nothing on the loop thread ever waits in the kernel: the
  event loop watches the ring's eventfd and :meth:`UringBackend._reap` walks the ready completions
  without blocking. With batched wake-ups (:mod:`.waiter`) the kernel's writes of that eventfd are
  switched off (``io_uring_cq_eventfd_toggle``) and a waiter thread writes it once per batch of
  completions instead; the eventfd is registered all the same, so a dead waiter hands the
  wake-ups back to the kernel by switching them on again.
- A cancel never means "done": a slot is free only after its own completion arrived.

Every call into the wrapper goes through the module-level name ``lu``, so tests can replace it
with a fault-injecting proxy (``tests/faults/ringproxy.py``).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import liburing as lu

from ..files import ShardFiles
from ..loop import LoopAdapter
from ..slab import Slab
from ..uring_probe import liburing_unusable_reason
from .base import ReadOp, SubmitError
from .waiter import BatchedWakeupBackend

__all__ = ("UringBackend",)

log = logging.getLogger("aioexperts")

MAX_REGISTERED_BUFFER = 1 << 30  # the kernel's limit for one registered buffer
MAX_REGISTERED_BUFFERS = 1 << 14
MAX_PREPARED_IOVECS = 1 << 17
"""Iovecs :meth:`UringBackend.prepare` makes at most ahead (about 200 B each)."""
#: user_data of every NOP this backend leaves in the queue; reads use 1, 2, ...
NOP_USER_DATA = 0
#: ``io_uring_submit`` errors that mean "not now": the entries stay queued and go out later.
TRANSIENT_SUBMIT_ERRNOS = frozenset((errno.EAGAIN, errno.EBUSY, errno.EINTR))
#: Submit attempts in a row that hand nothing to the kernel before the queued reads are failed.
MAX_SUBMIT_STALLS = 64


class UringBackend(BatchedWakeupBackend):
    """One io_uring of ``depth`` entries; every :meth:`submit` is one ``io_uring_submit``.

    The constructor sets up the ring, its eventfd and the registered buffers and touches no event
    loop, so it can run in a worker thread; :meth:`attach` (loop thread) starts watching the
    eventfd.

    Args:
        fixed_buffers: register the slab (in chunks of whole slots up to 1 GiB) and use
            ``READV_FIXED``, which about halves the kernel CPU per read; off (with the reason in
            :meth:`features`) where the kernel cannot be probed, lacks the opcode, or
            ``RLIMIT_MEMLOCK`` refuses.
        sqe_async: set ``IOSQE_ASYNC`` so that submit returns at once and kernel workers issue
            the reads (less time on the loop thread, more CPU in total).
        batch_wakeups: wake the event loop once per batch of completions (the scheduler's wake
            hint) through a waiter thread, rather than once per completion (:mod:`.waiter`); off
            where the kernel has no wait timeout (``IORING_FEAT_EXT_ARG``, Linux 5.11) or cannot
            switch the eventfd off (``IORING_CQ_EVENTFD_DISABLED``, Linux 5.8).

    Raises:
        OSError: ``io_uring_queue_init`` failed (``EPERM``: disabled by sysctl or seccomp;
            ``ENOSYS``: no io_uring in this kernel). Nothing is left open.
        Exception: anything else the wrapper raised while setting up; nothing is left open.
    """

    name = "io_uring"
    ends_batches = True
    #: the reads a reap made room for go out at the end of its loop tick, with those of the
    #: requests it woke: one ``io_uring_submit`` per batch instead of two (39 instead of 67 per
    #: GiB). Measured with bench/read_cpu.py's store reads, the two alternated in one process
    #: (issue 36): 1.8 ms less CPU per GiB (median of seven sets of eight runs, from 3.6 less to
    #: 0.9 more; about a tenth) on this backend; no change on the raw ring and more on the thread
    #: pool, which keep True.
    flush_at_batch_end = False

    def __init__(
        self,
        files: ShardFiles,
        slab: Slab,
        loop: LoopAdapter,
        depth: int,
        *,
        fixed_buffers: bool = True,
        sqe_async: bool = False,
        batch_wakeups: bool = True,
    ) -> None:
        super().__init__(files, slab, loop, depth)
        self._init_wakeups()
        self._iovecs: dict[tuple[int, int, int], tuple[Any, memoryview]] = {}
        self._ops: dict[int, ReadOp] = {}
        self._next_user_data = NOP_USER_DATA + 1
        # Entries taken from the submission queue that the kernel has not consumed yet, in queue
        # order: (sqe, user_data), NOPs included. len(_queued) == io_uring_sq_ready(ring).
        self._queued: list[tuple[Any, int]] = []
        self._neutralized: list[tuple[int, ReadOp]] = []  # reads turned into NOPs, to be failed
        self._nops = 0  # NOPs queued or in the kernel whose completion has not been reaped
        self._stalls = 0
        self._broken: Exception | None = None
        self._closed = False
        self._registered: tuple[Any, list[memoryview]] | None = None
        self._chunk_slots = 0
        self.fixed_buffers_reason: str | None = None if fixed_buffers else "fixed_buffers=False"
        self.submit_calls = 0
        self.unexpected_completions = 0
        self._ring_open = False
        self._sqe_flags = lu.IOSQE_ASYNC if sqe_async else 0
        unusable = liburing_unusable_reason()
        if unusable is not None:  # liburing.Ring() would kill the process (SIGILL): refuse instead
            raise OSError(errno.ENOTSUP, unusable)
        self._cqe = lu.Cqe()
        self._ring = lu.Ring()
        lu.io_uring_queue_init(depth, self._ring)
        self._ring_open = True
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            lu.io_uring_register_eventfd(self._ring, self._efd)
            if batch_wakeups and self._ring.features & lu.IORING_FEAT_EXT_ARG:
                self._batching = self._eventfd_writes(False)
            if fixed_buffers:
                self._chunk_slots = self._register_buffers()
        except BaseException:
            self._release()
            raise

    # -- set-up (any thread) --------------------------------------------------------------------

    def _eventfd_writes(self, on: bool) -> bool:
        """Have the kernel write the eventfd at every CQE (``on``) or not; False if it cannot."""
        try:
            ret = lu.io_uring_cq_eventfd_toggle(self._ring, on)
        except Exception as exc:  # EOPNOTSUPP before Linux 5.8 (the wrapper raises)
            log.debug("io_uring: the eventfd cannot be switched %s (%r)", "on" if on else "off", exc)
            return False
        return not (isinstance(ret, int) and ret < 0)

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
        try:
            supported = self._readv_fixed_supported()
        except Exception as exc:  # kernels 5.1-5.5 have no probe: the wrapper raises
            self.fixed_buffers_reason = f"the kernel cannot be probed for READV_FIXED ({exc!r})"
            log.debug("io_uring: %s; using plain readv", self.fixed_buffers_reason)
            return 0
        if not supported:
            self.fixed_buffers_reason = "the kernel has no READV_FIXED"
            return 0
        buffers = []
        for c in range(n_chunks):
            first = c * chunk_slots
            n = min(chunk_slots, slab.n_slots - first) * slab.slot_bytes
            buffers.append(_raw(slab, first, n))
        self._registered = (lu.Iovec(buffers), buffers)  # kept alive: the kernel holds the pointers
        try:
            lu.io_uring_register_buffers(self._ring, self._registered[0])
        except Exception as exc:  # ENOMEM beyond RLIMIT_MEMLOCK, or anything else: plain readv works
            self.fixed_buffers_reason = f"buffer registration refused ({exc!r})"
            log.debug("io_uring: %s; using plain readv", self.fixed_buffers_reason)
            return 0
        return chunk_slots

    def _readv_fixed_supported(self) -> bool:
        probe = lu.io_uring_get_probe_ring(self._ring)
        if probe is None:  # liburing's answer when the kernel has no probe
            raise OSError(errno.EINVAL, "io_uring_get_probe_ring returned no probe")
        try:
            return bool(lu.io_uring_opcode_supported(probe, lu.io_uring_op.IORING_OP_READV_FIXED))
        finally:
            lu.io_uring_free_probe(probe)

    def features(self) -> dict[str, Any]:
        return {
            "fixed_buffers": self._chunk_slots > 0,
            "fixed_buffers_reason": None if self._chunk_slots else self.fixed_buffers_reason,
            "sqe_async": bool(self._sqe_flags),
            "batch_wakeups": self._batching,
            "wakeups": self.wakeups,
            "depth": self.depth,
            "submit_calls": self.submit_calls,
        }

    @property
    def nops_in_flight(self) -> int:
        """NOPs (from failed preps or failed submits) handed to the kernel whose completion is not reaped yet."""
        return self._nops - sum(1 for _, user_data in self._queued if user_data == NOP_USER_DATA)

    @property
    def queued_entries(self) -> int:
        """Entries in the submission queue not handed to the kernel yet (they go with the next submit)."""
        return len(self._queued)

    @property
    def broken(self) -> bool:
        """True once the ring could not be made safe after a failed submit; every later submit fails."""
        return self._broken is not None

    # -- loop attachment (loop thread) ------------------------------------------------------------

    def attach(self) -> None:
        if self._attached:
            return
        if not self._ring_open:
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

    # -- batched wake-ups (loop thread) -------------------------------------------------------------

    def _waiter_ring_fd(self) -> int:
        return int(self._ring.ring_fd)

    def _reads_in_kernel(self) -> int:
        # reads and NOPs taken minus the entries still queued (NOPs complete too: they must wake the
        # loop to be reaped); reads failed by a neutralization count until their failure is delivered
        return self._in_flight + self._nops - len(self._queued)

    def _wake_per_completion(self) -> None:
        if not self._eventfd_writes(True):
            log.error("io_uring: the eventfd could not be switched on again; reaping what the CQ holds now")
            self.loop.call_soon(self._reap)  # at least what is in the CQ now

    # -- submission (loop thread) -----------------------------------------------------------------

    def prepare(self, shapes: Iterable[tuple[int, int]]) -> None:
        """One ``Iovec`` per slot and read shape, made now rather than on a slot's first read."""
        shapes = list(shapes)
        if len(shapes) * self.slab.n_slots > MAX_PREPARED_IOVECS:
            return  # many shapes (mixed tiers, split reads): made on first use instead
        for slot in range(self.slab.n_slots):
            for slot_offset, n_bytes in shapes:
                key = (slot, slot_offset, n_bytes)
                if key not in self._iovecs:
                    raw = self.slab.raw_buffer(slot, slot_offset, n_bytes)
                    self._iovecs[key] = (lu.Iovec([raw]), raw)

    def _iovec(self, op: ReadOp) -> Any:
        key = (op.slot, op.slot_offset, op.n_bytes)
        entry = self._iovecs.get(key)
        if entry is None:
            raw = self.slab.raw_buffer(op.slot, op.slot_offset, op.n_bytes)
            entry = self._iovecs[key] = (lu.Iovec([raw]), raw)
        return entry[0]

    def submit(self, ops: Sequence[ReadOp]) -> None:
        if self._closed or self._broken is not None:
            state = "closed" if self._closed else "broken"
            raise SubmitError(f"submit on a {state} io_uring backend", 0) from self._broken
        if self._in_flight + len(ops) > self.depth:
            raise SubmitError(f"{len(ops)} more reads would exceed the ring depth {self.depth}", 0)
        ring, fds, flags, chunk = self._ring, self.files.fds, self._sqe_flags, self._chunk_slots
        queued, by_user_data, iovecs = self._queued, self._ops, self._iovecs
        first_user_data = self._next_user_data
        taken = 0
        cause: Exception | None = None
        # the wrapper's functions, looked up once per batch (through ``lu``, which tests may replace)
        get_sqe, set_data64 = lu.io_uring_get_sqe, lu.io_uring_sqe_set_data64
        prep_fixed, prep = lu.io_uring_prep_readv_fixed, lu.io_uring_prep_readv
        try:
            for op in ops:
                found = iovecs.get((op.slot, op.slot_offset, op.n_bytes))
                iov = found[0] if found is not None else self._iovec(op)  # before taking an entry: nothing to undo
                sqe = get_sqe(ring)
                if sqe is None:  # the queue is full of entries not handed over yet: hand them over
                    cause = self._submit_queued()
                    if cause is not None:
                        break
                    sqe = get_sqe(ring)
                    if sqe is None:
                        cause = OSError(errno.EBUSY, "the io_uring submission queue is full")
                        break
                user_data = self._next_user_data
                try:
                    if chunk:
                        prep_fixed(sqe, fds[op.shard], iov, op.slot // chunk, op.file_offset)
                    else:
                        prep(sqe, fds[op.shard], iov, op.file_offset)
                    if flags:
                        lu.io_uring_sqe_set_flags(sqe, flags)
                    set_data64(sqe, user_data)
                except BaseException:
                    self._queue_nop(sqe)  # the entry may hold a stale read: make it a NOP
                    raise
                self._next_user_data = user_data + 1
                queued.append((sqe, user_data))
                by_user_data[user_data] = op
                self._in_flight += 1
                taken += 1
        except Exception as exc:
            cause = exc
        late = self._submit_queued()
        cause = cause or late
        if cause is None:
            self._arm()
            return
        # reads of this batch the kernel never saw were rewritten as NOPs: they are not taken;
        # earlier batches' reads among them were reported taken, so they fail through the sink
        mine = sum(1 for user_data, _ in self._neutralized if user_data >= first_user_data)
        self._fail_neutralized(cause, first_user_data)
        self._in_flight -= mine
        self._arm()
        raise SubmitError(f"io_uring took {taken - mine} of {len(ops)} reads: {cause!r}", taken - mine) from cause

    def _queue_nop(self, sqe: Any) -> None:
        """Rewrite ``sqe`` (already in the queue) as a NOP with user_data 0; mark the ring broken if that fails."""
        try:
            lu.io_uring_prep_nop(sqe)
            lu.io_uring_sqe_set_data64(sqe, NOP_USER_DATA)
        except Exception as exc:
            self._queued.append((sqe, NOP_USER_DATA))
            self._nops += 1
            self._mark_broken(exc)
            return
        self._queued.append((sqe, NOP_USER_DATA))
        self._nops += 1

    def _submit_queued(self) -> Exception | None:
        """Hand every queued entry to the kernel.

        Returns None when every entry went out, or when the kernel said "not now" (the rest go
        out on a later tick or completion). On a hard failure, rewrites every entry the kernel has
        not consumed as a NOP (their reads go to ``_neutralized``) and returns the error.
        """
        if self._broken is not None:
            return self._broken
        queued, ring = self._queued, self._ring
        while queued:
            error: Exception | None = None
            try:
                lu.io_uring_submit(ring)
                self.submit_calls += 1
            except Exception as exc:
                error = exc
            consumed = len(queued) - lu.io_uring_sq_ready(ring)
            if consumed > 0:
                del queued[:consumed]
                self._stalls = 0
                if error is None or not queued:
                    continue
            if error is not None and not (isinstance(error, OSError) and error.errno in TRANSIENT_SUBMIT_ERRNOS):
                self._neutralize_queued()
                return error
            self._stalls += 1
            if self._stalls > MAX_SUBMIT_STALLS:
                self._neutralize_queued()
                return error or OSError(errno.EBUSY, f"io_uring_submit made no progress {MAX_SUBMIT_STALLS} times")
            self._schedule_submit()
            return None
        return None

    def _neutralize_queued(self) -> None:
        """Rewrite every queued read the kernel has not consumed as a NOP; those reads never happen."""
        queued = self._queued
        for i, (sqe, user_data) in enumerate(queued):
            if user_data == NOP_USER_DATA:
                continue
            try:
                lu.io_uring_prep_nop(sqe)
                lu.io_uring_sqe_set_data64(sqe, NOP_USER_DATA)
            except Exception as exc:
                self._mark_broken(exc)
                return
            queued[i] = (sqe, NOP_USER_DATA)
            self._neutralized.append((user_data, self._ops.pop(user_data)))
            self._nops += 1

    def _mark_broken(self, cause: Exception) -> None:
        """The queue may hold an entry that is not safe to submit: never enter the ring again."""
        log.error(
            "io_uring: an entry of the submission queue could not be rewritten (%r); the ring is not used again", cause
        )
        self._broken = cause
        for _sqe, user_data in self._queued:
            if user_data == NOP_USER_DATA:
                self._nops -= 1  # never submitted now, so never completed
            elif user_data in self._ops:
                self._neutralized.append((user_data, self._ops.pop(user_data)))
        self._queued.clear()

    def _fail_neutralized(self, cause: Exception, first_user_data: int = 1 << 64) -> None:
        """Fail (through the sink, on a later tick) the neutralized reads older than ``first_user_data``."""
        earlier = [(op, cause) for user_data, op in self._neutralized if user_data < first_user_data]
        self._neutralized.clear()
        self._fail_later(earlier)

    def _submit_pending(self) -> None:
        if not self._queued:
            return
        cause = self._submit_queued()
        if cause is not None:
            self._fail_neutralized(cause)
        self._arm()

    # -- completion (loop thread) -------------------------------------------------------------------

    def _reap(self) -> None:
        if not self._attached:
            return
        self._reaping()
        try:
            os.eventfd_read(self._efd)
        except OSError:  # BlockingIOError: nothing new
            pass
        ring, cqe = self._ring, self._cqe
        pop = self._ops.pop
        ops: list[ReadOp] = []
        results: list[int | Exception] = []
        seen = 0  # CQEs walked: advanced past below
        try:
            for _ in lu.CqeIter(ring, cqe):
                entry = cqe[0]
                user_data = entry.user_data
                try:
                    result: int | Exception = entry.res
                except Exception as exc:  # a negative res is raised as OSError
                    result = exc
                seen += 1
                op = pop(user_data, None)  # in the same walk: no list of (user_data, result) pairs first
                if op is not None:
                    ops.append(op)
                    results.append(result)
                elif user_data == NOP_USER_DATA and self._nops > 0:
                    self._nops -= 1
                else:  # a duplicate or a stranger: its read (if any) was already accounted for
                    self.unexpected_completions += 1
        except Exception:  # deliver what was read; the rest is seen on the next wake-up
            log.exception("io_uring: walking the completion queue failed")
        if seen:
            try:
                lu.io_uring_cq_advance(ring, seen)
            except Exception:  # seen again next time: already delivered, so ignored then
                log.exception("io_uring: advancing the completion queue failed")
        if ops:  # one call of the scheduler's batch sink for the lot (IOBackend.set_batch_sink)
            self._deliver_reaped(ops, results)
        if self._queued:
            self._stalls = 0
            self._schedule_submit()
        if ops:  # the reads these completions made room for go out now, not one loop tick later
            self._end_batch()
        self._arm()

    # -- teardown -----------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed and not self._ring_open and self._efd < 0:
            return
        self._check_closable()
        self._closed = True
        self._join_waiter()
        self._release()

    def _release(self) -> None:
        """Exit the ring, close the eventfd, drop the iovecs; each at most once, each attempted."""
        try:
            if self._ring_open:
                self._ring_open = False  # a second io_uring_queue_exit raises: never retry one
                lu.io_uring_queue_exit(self._ring)
        finally:
            try:
                if self._efd >= 0:
                    efd, self._efd = self._efd, -1
                    os.close(efd)
            finally:
                self._iovecs.clear()
                self._registered = None
                self._queued.clear()
                self._nops = 0


def _raw(slab: Slab, first_slot: int, n_bytes: int) -> memoryview:
    """Slab memory from ``first_slot`` for ``n_bytes`` (may span slots), without a buffer export."""
    return slab.raw_span(first_slot * slab.slot_bytes, n_bytes)
