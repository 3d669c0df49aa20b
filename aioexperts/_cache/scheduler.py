"""The read scheduler: batches loads per loop tick, demand before prefetch, bounded in flight.

A *load* is every read of one expert into its slot. Loads wait in three queues: re-reads after a
short read, demand loads, then prefetches. Once per loop tick (``call_soon``) :meth:`flush`
takes loads in that order while the reads in flight stay within ``depth`` and the bytes in
flight within ``max_bytes_in_flight``, and hands them to the backend as one submission. A load
still queued can be dropped (a stale prefetch); once submitted it runs to its completion.

Completion rules for one read of ``n`` bytes: complete when ``n`` is the full length, or when
the read ended exactly at end of file after every payload byte; ``0`` before that is an error
(the file was truncated); any other short read is re-queued for the remainder (from the last
aligned byte under direct I/O).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import Enum

from .._errors import ExpertReadError
from .._io.align import align_down
from .._io.backends.base import IOBackend, ReadOp
from .._io.loop import AsyncEvent, LoopAdapter
from .._io.plan import ExpertPlan, PlannedRead
from .stats import Counters

__all__ = ("Load", "LoadState", "Priority", "ReadScheduler")

#: A load that makes no progress for this many re-reads in a row fails.
MAX_STALLED_RETRIES = 8


class Priority(Enum):
    """Queue of a load: demand loads go before prefetches."""

    DEMAND = 0
    PREFETCH = 1


class LoadState(Enum):
    """Where a load is: QUEUED -> SUBMITTED -> DONE, or QUEUED -> DROPPED."""

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
        error: the failure, once one read failed.
        on_done: called on the loop thread once, after the last read completed (successful or
            not); never called for a dropped load.
    """

    __slots__ = ("_stalls", "error", "on_done", "ops_left", "plan", "priority", "slot", "started_ns", "state")

    def __init__(self, plan: ExpertPlan, slot: int, priority: Priority, on_done: Callable[[Load], None]) -> None:
        self.plan = plan
        self.slot = slot
        self.priority = priority
        self.on_done = on_done
        self.state = LoadState.QUEUED
        self.error: ExpertReadError | None = None
        self.ops_left = 0
        self.started_ns = 0
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
        alignment: re-reads restart at a multiple of this under direct I/O.
        max_bytes_in_flight: bound on requested bytes in flight (at least one load always fits).
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
        self._queues: dict[Priority, deque[Load]] = {Priority.DEMAND: deque(), Priority.PREFETCH: deque()}
        self._ops_in_flight = 0
        self._bytes_in_flight = 0
        self._flush_scheduled = False
        self._idle_event: AsyncEvent | None = None
        backend.set_sink(self._on_read)

    # -- queueing (loop thread) ------------------------------------------------------------

    def enqueue(self, load: Load) -> None:
        """Queue ``load``; it is submitted at the end of this loop tick at the earliest."""
        self._queues[load.priority].append(load)
        self._schedule_flush()

    def promote(self, load: Load) -> None:
        """Move a queued prefetch to the demand queue (someone now waits for it)."""
        if load.state is LoadState.QUEUED and load.priority is Priority.PREFETCH:
            self._queues[Priority.PREFETCH].remove(load)
            load.priority = Priority.DEMAND
            self._queues[Priority.DEMAND].append(load)
            self._schedule_flush()
        else:
            load.priority = Priority.DEMAND

    def drop(self, load: Load) -> bool:
        """Remove a load that was not submitted yet; True if it was dropped (its slot is unused)."""
        if load.state is not LoadState.QUEUED:
            return False
        self._queues[load.priority].remove(load)
        load.state = LoadState.DROPPED
        return True

    def queued_prefetches(self) -> list[Load]:
        """Prefetch loads not submitted yet, oldest first."""
        return list(self._queues[Priority.PREFETCH])

    @property
    def reads_in_flight(self) -> int:
        """Reads submitted and not completed."""
        return self._ops_in_flight

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not (self._ops_in_flight or self._retries or any(self._queues.values()))

    async def wait_no_reads_in_flight(self) -> None:
        """Return once no read is in flight (queued loads are not waited for)."""
        while self._ops_in_flight:
            self._idle_event = event = self.loop.new_event()
            await event.wait()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    # -- submission -------------------------------------------------------------------------

    def _fits(self, n_ops: int, n_bytes: int) -> bool:
        """``n_ops`` more reads of ``n_bytes`` stay within the bounds (the batch so far is counted)."""
        if self._ops_in_flight + n_ops > self.depth:
            return False
        return self._ops_in_flight == 0 or self._bytes_in_flight + n_bytes <= self.max_bytes_in_flight

    def flush(self) -> None:
        """Submit as many queued reads as the bounds allow, in priority order, as one batch."""
        batch: list[ReadOp] = []
        now = time.perf_counter_ns()
        while self._retries and self._fits(1, self._retries[0].n_bytes):
            op = self._retries.popleft()
            self._account(op, batch)
        for priority in (Priority.DEMAND, Priority.PREFETCH):
            queue = self._queues[priority]
            while queue:
                load = queue[0]
                reads = load.plan.reads
                if not self._fits(len(reads), load.read_bytes):
                    break
                queue.popleft()
                load.state = LoadState.SUBMITTED
                load.ops_left = len(reads)
                load.started_ns = now
                for read in reads:
                    op = ReadOp(read.shard, read.file_offset, read.n_bytes, load.slot, read.slot_offset, (load, read))
                    self._account(op, batch)
            else:
                continue
            break  # a demand load that does not fit blocks the prefetches behind it
        if batch:
            self.counters.reads += len(batch)
            self.counters.submissions += 1
            self.counters.max_batch = max(self.counters.max_batch, len(batch))
            try:
                self.backend.submit(batch)
            except OSError as exc:
                for op in batch:  # the backend took none of them
                    self._ops_in_flight -= 1
                    self._bytes_in_flight -= op.n_bytes
                    self._fail(op.context[0], exc, op)
                    self._op_finished(op.context[0])

    def _account(self, op: ReadOp, batch: list[ReadOp]) -> None:
        op.submitted_ns = time.perf_counter_ns()
        self._ops_in_flight += 1
        self._bytes_in_flight += op.n_bytes
        batch.append(op)

    # -- completion (loop thread) ------------------------------------------------------------

    def _on_read(self, op: ReadOp, result: int | OSError) -> None:
        self._ops_in_flight -= 1
        self._bytes_in_flight -= op.n_bytes
        load, read = op.context
        if isinstance(result, OSError):
            self._fail(load, result, op)
        else:
            self.counters.bytes_read += result
            self._check_length(load, read, op, result)
        self._op_finished(load)
        if self._ops_in_flight == 0 and self._idle_event is not None:
            self._idle_event.set()
            self._idle_event = None
        if self._retries or self._queues[Priority.DEMAND] or self._queues[Priority.PREFETCH]:
            self._schedule_flush()

    def _check_length(self, load: Load, read: PlannedRead, op: ReadOp, n: int) -> None:
        if n >= op.n_bytes:
            return
        end = op.file_offset + n
        file_size = self.file_sizes[op.shard]
        if end == file_size:
            if end - read.file_offset >= read.needed:
                return  # the short read that ends exactly at end of file, after all the payload
            self._fail(
                load,
                None,
                op,
                f"the file ends at byte {file_size}, before the end of the expert's data at byte "
                f"{read.file_offset + read.needed} (truncated?)",
            )
            return
        if n == 0:
            self._fail(load, None, op, f"unexpected end of file at byte {op.file_offset} (file shrank?)")
            return
        advance = align_down(n, self.alignment)
        load._stalls = load._stalls + 1 if advance == 0 else 0
        if load._stalls > MAX_STALLED_RETRIES:
            self._fail(
                load, None, op, f"{MAX_STALLED_RETRIES} short reads in a row made no progress (was the file truncated?)"
            )
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

    def _fail(self, load: Load, cause: OSError | None, op: ReadOp, what: str | None = None) -> None:
        if load.error is not None:
            return
        loc = load.plan.location
        where = self.shard_names[op.shard] if op.shard < len(self.shard_names) else f"shard {op.shard}"
        what = what or (cause.strerror or str(cause) if cause is not None else "error")
        load.error = ExpertReadError(
            f"reading layer {loc.layer} expert {loc.expert} failed: {what} "
            f"({where}, {op.n_bytes} bytes at offset {op.file_offset})"
        )
        load.error.__cause__ = cause

    def _op_finished(self, load: Load) -> None:
        load.ops_left -= 1
        if load.ops_left == 0:
            load.state = LoadState.DONE
            if load.error is None:
                self.counters.expert_latency.add((time.perf_counter_ns() - load.started_ns) / 1e9)
            load.on_done(load)
