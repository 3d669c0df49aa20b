"""The read scheduler: batches loads per loop tick, demand before prefetch, bounded in flight.

A *load* is every read of one expert into its slot. Loads wait in three queues: re-reads after a
short read, demand loads, then prefetches. Once per loop tick (``call_soon``) :meth:`flush`
takes loads in that order while the reads in flight stay within ``depth`` and the bytes in
flight within ``max_bytes_in_flight``, and hands them to the backend as one submission. A load
still queued can be dropped (a stale prefetch); once submitted it runs to its completion.

Completion rules for one read of ``n`` bytes: complete when ``n`` is the full length, or when
the read ended exactly at end of file after every payload byte; ``0`` before that is an error
(the file was truncated); any other short read is re-queued for the remainder, from the last
byte that is a multiple of the kernel's direct-I/O alignment under direct I/O (from the last
byte read otherwise). A read that fails with ``EINTR`` or ``EAGAIN`` is re-queued whole.

Faults never strand a load: whatever a submission, a completion or a load's ``on_done`` raises
becomes the load's error (:class:`ExpertReadError`, cause attached), and a slot whose read the
backend took is released only by that read's own completion (see ``IOBackend.submit``).
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

from .._errors import AioExpertsError, ExpertReadError, StoreClosedError
from .._io.align import align_down
from .._io.backends.base import IOBackend, ReadOp, ReadResult, SubmitError
from .._io.loop import AsyncEvent, LoopAdapter
from .._io.plan import LoadPlan, PlannedRead
from .._timeline import Timeline
from .stats import Counters

__all__ = ("Load", "LoadState", "Priority", "ReadScheduler")

log = logging.getLogger("aioexperts")

#: A load that makes no progress for this many re-reads in a row fails.
MAX_STALLED_RETRIES = 8
#: Read errors that mean "try again" rather than "failed".
RETRY_ERRNOS = frozenset((errno.EINTR, errno.EAGAIN))
CLOSED_MESSAGE = "the store was closed before this expert was read"


class Priority(Enum):
    """Queue of a load: demand loads go before prefetches; speculative loads go only while the
    device would otherwise run dry (:data:`SPECULATIVE_MAX_OPS`)."""

    DEMAND = 0
    PREFETCH = 1
    SPECULATIVE = 2


#: Speculative loads are submitted only while nothing else is queued and fewer reads than this are
#: in flight, so a demand read that arrives later queues behind at most this many (a read of a
#: Q4_K expert projection of the built-in model is about 0.9 MB: well under a millisecond each).
SPECULATIVE_MAX_OPS = 6


class LoadState(Enum):
    """Where a load is: QUEUED -> SUBMITTED -> DONE, QUEUED -> DONE (closed), or QUEUED -> DROPPED."""

    QUEUED = 0
    SUBMITTED = 1
    DONE = 2
    DROPPED = 3


class Load:
    """Every read of one expert into one slot.

    Attributes:
        plan: the expert's reads and payload layout.
        slot: destination slot.
        priority: its queue.
        state: see :class:`LoadState`.
        error: the failure (an :class:`ExpertReadError`, or :class:`StoreClosedError` when the
            scheduler was closed first), once one read failed.
        ops_left: reads handed to the backend or queued for it whose completion is still due.
        on_done: called on the loop thread once, after the last read completed (successful or
            not) or when the scheduler was closed before the load was submitted; never called for
            a dropped load. It should not raise (what it raises is logged).
        owner: whatever the caller attached (the cache's entry), for ``on_done``.
    """

    __slots__ = (
        "_stalls",
        "error",
        "on_done",
        "ops_left",
        "owner",
        "plan",
        "priority",
        "queued_at",
        "slot",
        "started_ns",
        "state",
    )

    def __init__(
        self, plan: LoadPlan, slot: int, priority: Priority, on_done: Callable[[Load], None], owner: Any = None
    ) -> None:
        self.plan = plan
        self.owner = owner
        self.slot = slot
        self.priority = priority
        self.on_done = on_done
        self.state = LoadState.QUEUED
        self.error: AioExpertsError | None = None
        self.ops_left = 0
        self.started_ns = 0
        self.queued_at = math.nan  # perf_counter seconds of enqueue, set only while a timeline records
        self._stalls = 0

    @property
    def read_bytes(self) -> int:
        """Bytes the load's reads request."""
        return self.plan.read_bytes


class ReadScheduler:
    """Feeds loads to a backend and turns completions into finished loads.

    Args:
        backend: where reads go; its completions come back to :meth:`_on_read`.
        loop: the event loop adapter (for the once-per-tick flush).
        counters: statistics to update.
        file_sizes: size of each shard in bytes (for end-of-file short reads).
        alignment: the kernel's direct-I/O alignment (bytes, a power of two; ``ShardFiles.dio_alignment``):
            a re-read after a short read restarts at a multiple of it under direct I/O. This is
            not the plan's alignment (reads are planned page-aligned on purpose), only the rule
            the kernel enforces.
        max_bytes_in_flight: bound on requested bytes in flight (at least one load always fits).
        shard_names: file names for error messages.
    """

    def __init__(
        self,
        backend: IOBackend,
        loop: LoopAdapter,
        counters: Counters,
        file_sizes: tuple[int, ...],
        alignment: int,
        max_bytes_in_flight: int,
        shard_names: tuple[str, ...] = (),
    ) -> None:
        self.backend = backend
        self.loop = loop
        self.counters = counters
        self.file_sizes = file_sizes
        self.alignment = alignment if backend.direct_io else 1
        self.depth = backend.depth
        self.max_bytes_in_flight = max_bytes_in_flight
        self.shard_names = shard_names
        self._retries: deque[ReadOp] = deque()
        # one deque per priority, not a dict keyed by the Enum (whose hash runs in Python)
        self._demand: deque[Load] = deque()
        self._prefetch: deque[Load] = deque()
        self._speculative: deque[Load] = deque()
        self._ops_in_flight = 0
        self._bytes_in_flight = 0
        self._flush_scheduled = False
        # the backend ends its batches of completions (IOBackend.ends_batches): the reads they make
        # room for are submitted at the end of the batch, not on the next loop tick (unless the
        # backend would rather have them with the woken requests' reads: flush_at_batch_end)
        self._flush_at_batch_end = backend.ends_batches and backend.flush_at_batch_end
        self._flush_wanted = False  # a completion of the current batch left reads queued
        self._busy_since_ns = 0  # when the reads in flight last went from none to some
        self._quiet_event: AsyncEvent | None = None
        self._closed = False
        self.timeline: Timeline | None = None  # records each finished load (issue 36's timeline)
        #: the fewest completions after which a waiting request can go on, None when none waits
        #: (the cache sets it): the backend's wake hint (:meth:`wake_hint`)
        self.waiting_need: Callable[[], int | None] | None = None
        backend.set_sink(self._on_read, self._batch_ended)
        backend.set_batch_sink(self._on_reads, self._on_read)
        backend.set_wake_hint(self.wake_hint)

    # -- queueing (loop thread) ------------------------------------------------------------

    def enqueue(self, load: Load) -> None:
        """Queue ``load``; it is submitted at the end of this loop tick at the earliest.

        Raises:
            StoreClosedError: the scheduler is closed (nothing was queued).
        """
        self.enqueue_all([load], load.priority)

    def enqueue_all(self, loads: list[Load], priority: Priority) -> None:
        """:meth:`enqueue` each of ``loads`` (all of ``priority``), in order, with one check and
        at most one flush scheduled for the lot.

        Raises:
            StoreClosedError: the scheduler is closed (nothing was queued).
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        if not loads:
            return
        if self.timeline is not None:
            for load in loads:
                load.queued_at = time.perf_counter()
        self._queue_of(priority).extend(loads)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _queue_of(self, priority: Priority) -> deque[Load]:
        if priority is Priority.DEMAND:
            return self._demand
        return self._prefetch if priority is Priority.PREFETCH else self._speculative

    def promote(self, load: Load, to: Priority = Priority.DEMAND) -> None:
        """Move a load to the queue of ``to`` if that is nearer than its own: a prefetch or a
        speculative load someone now waits for (``DEMAND``), or a speculative load the pass is now
        within the prefetch depth of (``PREFETCH``). A load already submitted only takes the
        priority (it counts for nothing then)."""
        if load.priority.value <= to.value:
            return
        if load.state is LoadState.QUEUED:
            self._queue_of(load.priority).remove(load)
            load.priority = to
            self._queue_of(to).append(load)
            self._schedule_flush()
        else:
            load.priority = to

    def drop(self, load: Load) -> bool:
        """Remove a load that was not submitted yet; True if it was dropped (its slot is unused)."""
        if load.state is not LoadState.QUEUED:
            return False
        self._queue_of(load.priority).remove(load)
        load.state = LoadState.DROPPED
        self._notify_quiet()
        return True

    def queued_prefetches(self) -> list[Load]:
        """Prefetch and speculative loads not submitted yet, the prefetches first, each oldest first."""
        return [*self._prefetch, *self._speculative]

    @property
    def reads_in_flight(self) -> int:
        """Reads submitted and not completed."""
        return self._ops_in_flight

    @property
    def bytes_in_flight(self) -> int:
        """Bytes requested by the reads in flight."""
        return self._bytes_in_flight

    @property
    def queued_bytes(self) -> int:
        """Bytes of the loads queued and not submitted yet (re-reads included)."""
        return (
            sum(load.read_bytes for load in self._demand)
            + sum(load.read_bytes for load in self._prefetch)
            + sum(load.read_bytes for load in self._speculative)
            + sum(op.n_bytes for op in self._retries)
        )

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not (self._ops_in_flight or self._retries or self._queued_loads)

    @property
    def has_speculative(self) -> bool:
        """Whether a speculative load is queued (not submitted yet)."""
        return bool(self._speculative)

    @property
    def _queued_loads(self) -> bool:
        return bool(self._demand or self._prefetch or self._speculative)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def close(self, message: str = CLOSED_MESSAGE) -> None:
        """Submit nothing more: fail every queued load and queued re-read with ``StoreClosedError``.

        Loads not submitted yet finish at once (``on_done`` runs with the error; their slots are
        unused). A load with a re-read queued fails too, but finishes only when its reads in
        flight have completed. Completions keep being delivered; a short read completing after
        close fails its load instead of queuing a re-read. Idempotent; loop thread only.
        """
        if self._closed:
            return
        self._closed = True
        retries, self._retries = self._retries, deque()
        loads = [*self._demand, *self._prefetch, *self._speculative]
        self._demand.clear()
        self._prefetch.clear()
        self._speculative.clear()
        for op in retries:
            load = op.context[0]
            self._set_error(load, StoreClosedError(message))
            self._op_finished(load)
        for load in loads:
            self._set_error(load, StoreClosedError(message))
            self._finish(load)
        self._notify_quiet()

    async def wait_idle(self) -> None:
        """Return once no read is in flight and nothing is queued.

        After :meth:`close` nothing is queued, so this waits for the reads in flight: then no
        backend will write into the slab again and it can be closed.

        Cancellation handling:
            Cancelling the caller only stops its wait; nothing is changed. Shield the call to
            wait for sure before releasing the backend or the slab.
        """
        while not self.idle:
            await self._quiet().wait()

    async def wait_no_reads_in_flight(self) -> None:
        """Return once no read is in flight (queued loads are not waited for).

        Cancellation handling:
            Cancelling the caller only stops its wait; nothing is changed.
        """
        while self._ops_in_flight:
            await self._quiet().wait()

    def wake_hint(self) -> int:
        """How many completions the backend may wait for before it wakes the loop (at least 1).

        1 when nobody waits for a read (or the need is unknown); else the fewest completions after
        which a waiting request can go on (:attr:`waiting_need`), and, while reads are queued
        behind the depth, no more than lets the reads in flight fall to three quarters of it (so
        the queue is topped up in batches and the device stays busy); with only speculative loads
        queued, no more than lets the first of them go (:data:`SPECULATIVE_MAX_OPS`). Never raises.
        """
        need = self.waiting_need
        if need is None:
            return 1
        try:
            wanted = need()
        except Exception:
            log.exception("the cache's count of completions needed failed; waking per completion")
            return 1
        if wanted is None or wanted <= 1:
            return 1
        if self._retries or self._demand or self._prefetch:
            wanted = min(wanted, self._ops_in_flight - (3 * self.depth) // 4)
        elif self._speculative:
            room = SPECULATIVE_MAX_OPS - len(self._speculative[0].plan.reads)
            wanted = min(wanted, self._ops_in_flight - room)
        return max(1, min(wanted, self._ops_in_flight))

    def _quiet(self) -> AsyncEvent:
        if self._quiet_event is None:
            self._quiet_event = self.loop.new_event()
        return self._quiet_event

    def _notify_quiet(self) -> None:
        """Wake :meth:`wait_idle` / :meth:`wait_no_reads_in_flight` callers when nothing is in flight."""
        if self._quiet_event is not None and self._ops_in_flight == 0:
            self._quiet_event.set()
            self._quiet_event = None

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        try:
            self.flush()
        except Exception:  # flush turns faults into failed loads; this is the last resort
            log.exception("flushing the read queue failed")

    # -- submission -------------------------------------------------------------------------

    def _fits(self, n_ops: int, n_bytes: int) -> bool:
        """``n_ops`` more reads of ``n_bytes`` stay within the bounds (the batch so far is counted)."""
        if self._ops_in_flight + n_ops > self.depth:
            return False
        return self._ops_in_flight == 0 or self._bytes_in_flight + n_bytes <= self.max_bytes_in_flight

    def flush(self) -> None:
        """Submit as many queued reads as the bounds allow, in priority order, as one batch.

        Reads the backend does not take fail their loads (``ExpertReadError``, the backend's error
        as the cause); a load with some reads taken finishes when those complete.
        """
        if self._closed:
            return
        batch: list[ReadOp] = []
        accounted = 0  # ops of the batch counted in flight (a load's are counted once all are built)
        current: Load | None = None
        idle_before = self._ops_in_flight == 0
        try:
            now = time.perf_counter_ns()
            if idle_before:
                self._busy_since_ns = now
            while self._retries and self._fits(1, self._retries[0].n_bytes):
                self._account(self._retries.popleft(), batch, now)
            accounted = len(batch)
            depth, max_bytes = self.depth, self.max_bytes_in_flight
            n_ops, n_bytes = self._ops_in_flight, self._bytes_in_flight
            append, submitted = batch.append, LoadState.SUBMITTED
            # speculative loads only once the other queues are empty, and only while few reads are in flight
            queues = (
                (self._demand, depth),
                (self._prefetch, depth),
                (self._speculative, min(depth, SPECULATIVE_MAX_OPS)),
            )
            for queue, cap in queues:
                while queue:
                    load = queue[0]
                    plan = load.plan
                    reads = plan.reads
                    k, read_bytes = len(reads), plan.read_bytes  # read_bytes: the sum of the reads' n_bytes
                    # _fits, inlined: the in-flight counts are advanced once per load, below
                    if n_ops + k > cap or (n_ops and n_bytes + read_bytes > max_bytes):
                        break
                    current = queue.popleft()
                    load.state = submitted
                    load.started_ns = now
                    slot = load.slot
                    for read in reads:
                        append(
                            ReadOp(
                                read.shard, read.file_offset, read.n_bytes, slot, read.slot_offset, (load, read), now
                            )
                        )
                    n_ops += k
                    n_bytes += read_bytes
                    load.ops_left += k
                    self._ops_in_flight, self._bytes_in_flight = n_ops, n_bytes
                    accounted = len(batch)
                    current = None
                else:
                    continue
                break  # a load that does not fit blocks the queues behind it
        except Exception as exc:  # nothing of the batch went out: fail it whole
            del batch[accounted:]  # the failing load's ops were never counted: it fails below
            self._reject(batch, exc, "queuing the read failed")
            if current is not None and current.state is not LoadState.DONE and current.ops_left == 0:
                self._set_error(current, self._read_error(current, exc, None, "queuing the read failed"))
                self._finish(current)
            return
        if not batch:
            return
        before = self.backend.in_flight
        try:
            self.backend.submit(batch)
        except SubmitError as exc:
            taken, cause = exc.taken, exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        except Exception as exc:  # a backend outside the contract: trust its count of reads taken
            taken, cause = self.backend.in_flight - before, exc
        else:
            self._count_submission(len(batch))
            return
        taken = max(0, min(taken, len(batch)))
        if taken:
            self._count_submission(taken)
        self._reject(batch[taken:], cause, "the read could not be submitted")

    def _count_submission(self, n_ops: int) -> None:
        c = self.counters
        c.reads += n_ops
        c.submissions += 1
        if n_ops > c.max_batch:
            c.max_batch = n_ops

    def _account(self, op: ReadOp, batch: list[ReadOp], now: int) -> None:
        op.submitted_ns = now
        self._ops_in_flight += 1
        self._bytes_in_flight += op.n_bytes
        batch.append(op)

    def _reject(self, ops: list[ReadOp], cause: BaseException, what: str) -> None:
        """Fail ``ops``, which were accounted as in flight but never reached the backend."""
        for op in ops:
            self._ops_in_flight -= 1
            self._bytes_in_flight -= op.n_bytes
            if self._ops_in_flight == 0:
                self._busy_since_ns = 0  # these reads never ran: no device time
            load = op.context[0]
            self._set_error(load, self._read_error(load, cause, op, f"{what} ({cause!r})"))
            self._op_finished(load)
        if self._retries or self._queued_loads:
            self._schedule_flush()
        self._notify_quiet()

    # -- completion (loop thread) ------------------------------------------------------------

    def busy_in_progress(self) -> float:
        """Seconds since the reads in flight now went from none to some (0.0 when none are in
        flight): the part of the device's busy time :attr:`Counters.device_busy_seconds` does not
        hold yet (it adds an interval when its last read lands)."""
        since = self._busy_since_ns
        return (time.perf_counter_ns() - since) / 1e9 if since and self._ops_in_flight else 0.0

    def _landed(self, n_ops: int, n_bytes: int) -> None:
        """``n_ops`` reads of ``n_bytes`` in all are no longer in flight (the device's busy time ends
        with the last)."""
        self._ops_in_flight -= n_ops
        self._bytes_in_flight -= n_bytes
        if self._ops_in_flight == 0 and self._busy_since_ns:
            self.counters.device_busy_seconds += (time.perf_counter_ns() - self._busy_since_ns) / 1e9
            self._busy_since_ns = 0

    def _after_completions(self) -> None:
        """Completions made room: queued reads go out (at the batch's end when the backend says
        one), and a waiter for quiet is told."""
        if self._retries or self._queued_loads:
            if self._flush_at_batch_end:
                self._flush_wanted = True
            else:
                self._schedule_flush()
        if self._quiet_event is not None:
            self._notify_quiet()

    def _on_read(self, op: ReadOp, result: ReadResult) -> None:
        n_bytes = op.n_bytes
        self._landed(1, n_bytes)
        load, read = op.context
        try:
            if type(result) is int or isinstance(result, int):
                self.counters.bytes_read += result
                if result < n_bytes:
                    self._short_read(load, read, op, result)
            elif isinstance(result, OSError) and result.errno in RETRY_ERRNOS:
                self._requeue(load, op, 0, f"interrupted ({errno.errorcode[result.errno or 0]})", result)
            else:
                self._set_error(load, self._read_error(load, result, op))
        except Exception as exc:  # never strand the load: whatever went wrong is its error
            self._set_error(load, self._read_error(load, exc, op, f"handling the completion failed ({exc!r})"))
        load.ops_left -= 1  # _op_finished, inlined
        if load.ops_left == 0:
            self._finish(load)
        self._after_completions()

    def _on_reads(self, ops: list[ReadOp], results: list[ReadResult]) -> None:
        """:meth:`_on_read` for a batch of completions (the backend's batch sink): a read that
        returned its full length is counted here, every other one goes through :meth:`_on_read`;
        the loads whose last read this was finish after the batch is counted. Never raises."""
        full = full_bytes = 0
        finished: list[Load] = []
        for op, result in zip(ops, results, strict=True):
            if type(result) is int and result == op.n_bytes:
                full += 1
                full_bytes += result
                load = op.context[0]
                load.ops_left -= 1
                if load.ops_left == 0:
                    finished.append(load)
            else:
                self._on_read(op, result)
        if not full:
            return
        self._landed(full, full_bytes)
        self.counters.bytes_read += full_bytes
        if finished:
            now = time.perf_counter_ns()
            for load in finished:
                self._finish(load, now)
        self._after_completions()

    def _batch_ended(self) -> None:
        """The backend delivered a batch of completions: submit what they made room for now."""
        if self._flush_wanted:
            self._flush_wanted = False
            try:
                self.flush()
            except Exception:  # flush turns faults into failed loads; this is the last resort
                log.exception("flushing the read queue failed")

    def _short_read(self, load: Load, read: PlannedRead, op: ReadOp, n: int) -> None:
        end = op.file_offset + n
        file_size = self.file_sizes[op.shard]
        if end == file_size:
            if end - read.file_offset >= read.needed:
                return  # the short read that ends exactly at end of file, after all the payload
            self._set_error(
                load,
                self._read_error(
                    load,
                    None,
                    op,
                    f"the file ends at byte {file_size}, before the end of the expert's data at byte "
                    f"{read.file_offset + read.needed} (truncated?)",
                ),
            )
            return
        if n == 0:
            self._set_error(load, self._read_error(load, None, None, self._eof_text(op, file_size)))
            return
        self._requeue(load, op, align_down(n, self.alignment), "short reads")

    def _eof_text(self, op: ReadOp, opened_size: int) -> str:
        """Why ``op`` read 0 bytes before the end of its file (``opened_size`` bytes when the store
        opened it, as its header says). The file's size now is not asked for: an ``fstat`` on the
        loop thread can wait on the file system (NFS, FUSE)."""
        return (
            f"unexpected end of file: the read of {op.n_bytes} bytes at offset {op.file_offset} of "
            f"{self._name(op.shard)} returned 0 bytes, before the end of the file ({opened_size} bytes when the "
            "store opened it, as its header says): the file is shorter now (truncated, or being rewritten?)"
        )

    def _name(self, shard: int) -> str:
        return self.shard_names[shard] if shard < len(self.shard_names) else f"shard {shard}"

    def _requeue(self, load: Load, op: ReadOp, advance: int, what: str, cause: Exception | None = None) -> None:
        """Queue the rest of ``op`` from ``advance`` bytes on, unless the load stalls or the scheduler closed."""
        load._stalls = load._stalls + 1 if advance == 0 else 0
        if load._stalls > MAX_STALLED_RETRIES:
            self._set_error(
                load,
                self._read_error(
                    load, cause, op, f"{MAX_STALLED_RETRIES} {what} in a row made no progress (was the file truncated?)"
                ),
            )
            return
        if self._closed:
            self._set_error(load, StoreClosedError(CLOSED_MESSAGE))
            return
        self.counters.read_retries += 1
        load.ops_left += 1
        retry = ReadOp(
            op.shard,
            op.file_offset + advance,
            op.n_bytes - advance,
            op.slot,
            op.slot_offset + advance,
            op.context,
        )
        self._retries.append(retry)

    def _read_error(
        self, load: Load, cause: BaseException | None, op: ReadOp | None, what: str | None = None
    ) -> ExpertReadError:
        if what is None:
            if isinstance(cause, OSError) and cause.strerror:
                what = cause.strerror
            else:
                what = repr(cause) if cause is not None else "error"
        where = ""
        if op is not None:
            where = f" ({self._name(op.shard)}, {op.n_bytes} bytes at offset {op.file_offset})"
        error = ExpertReadError(f"reading {load.plan.what} failed: {what}{where}")
        error.__cause__ = cause
        return error

    @staticmethod
    def _set_error(load: Load, error: AioExpertsError) -> None:
        if load.error is None:
            load.error = error

    def _op_finished(self, load: Load) -> None:
        load.ops_left -= 1
        if load.ops_left == 0:
            self._finish(load)

    def _finish(self, load: Load, now: int = 0) -> None:
        """``load`` is done: record its latency (to ``now``, perf_counter ns, read here if 0), call ``on_done``."""
        load.state = LoadState.DONE
        if load.error is None:
            if not now:
                now = time.perf_counter_ns()
            self.counters.expert_latency.add((now - load.started_ns) / 1e9)
            timeline = self.timeline
            if timeline is not None and load.started_ns:
                layer, expert = load.plan.key
                kind = load.priority.value
                timeline.add_read(
                    layer, expert, load.read_bytes, kind, load.queued_at, load.started_ns / 1e9, now / 1e9
                )
        try:
            load.on_done(load)
        except Exception:  # the cache's on_done never raises; keep delivering the others
            log.exception("finishing the load of %s failed", load.plan.what)
