"""The page-cache mode: the kernel's page cache is the expert cache; prefetch only warms it.

Views point into read-only shared mappings of the shards (:class:`~aioexperts._io.mapping
.MappedShards`), valid while pinned (a mapping is never unmapped under a view). Before warming,
``mincore`` tells which ranges are resident already: those are skipped and counted (unless
``mincore`` cannot be trusted for a shard, :func:`~aioexperts._io.mapping.residency_trusted`: then
every range of it is warmed, and the statistics say ``residency="untrusted"``). A request
(demand) warms what it needs ahead of every queued prefetch and, with the ``read`` method, waits
until the data is in the page cache; with the advice methods it waits only for the advice, and the
compute faults in what readahead did not bring in yet. Prefetches queue behind demand and can be
dropped while still queued.

Warming runs on ``n_threads`` worker threads (``read``, ``parallel-advice``) or one (``advice``),
completions coming back to the event loop in batches as the thread backend's do; or, with
``uring``, as buffered io_uring reads into a small scratch slab (the data is thrown away: only the
page cache keeps it), submitted and reaped on the loop like the slab mode's reads.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio

from .._errors import ExpertReadError, StoreClosedError
from .._format.layout import ExpertLayout, ExpertLocation
from .._io.backends.base import IOBackend, ReadOp, ReadResult, SubmitError
from .._io.loop import AsyncEvent, LoopAdapter
from .._io.mapping import SCRATCH_BYTES, MappedShards, WarmRange, merge_ranges, warm_advice, warm_read

__all__ = ("PageCacheCounters", "MappedExpertCache", "PageCacheStatistics", "PinnedExpert")

_CHUNKS_PER_JOB = 4
"""With ``uring``: ranges warmed at once is the ring depth over this (a range is a few chunks)."""

Key = tuple[int, int]


@dataclass(slots=True)
class PageCacheCounters:
    """What the page-cache mode did (the source design's statistics).

    Attributes:
        requests, hits, misses: experts asked for; fully resident ones; the others.
        ranges_issued: merged ranges handed to a warming call (demand and prefetch).
        bytes_warmed: bytes those calls covered (read, or advised).
        resident_skipped: merged ranges found fully resident by ``mincore`` and not warmed.
        errors: warming calls that failed.
        prefetch_seconds: time spent in :meth:`MappedExpertCache.prefetch` itself (residency checks
            and queueing, on the loop thread).
        prefetch_calls: prefetch calls per MoE layer predicted.
        prefetch_ranges: merged ranges queued by prefetch (the unit of ``dropped`` too).
        dropped: queued prefetch ranges dropped before a worker took them.
    """

    requests: int = 0
    hits: int = 0
    misses: int = 0
    ranges_issued: int = 0
    bytes_warmed: int = 0
    resident_skipped: int = 0
    errors: int = 0
    prefetch_seconds: float = 0.0
    prefetch_calls: dict[int, int] = field(default_factory=dict)
    prefetch_ranges: int = 0
    dropped: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__slots__:
            setattr(self, name, {} if name == "prefetch_calls" else 0)

    def snapshot(self, method: str, residency: str = "mincore") -> PageCacheStatistics:
        """A frozen copy."""
        return PageCacheStatistics(
            method,
            residency,
            self.ranges_issued,
            self.bytes_warmed,
            self.resident_skipped,
            self.errors,
            self.prefetch_seconds,
            dict(self.prefetch_calls),
            self.dropped,
        )


@dataclass(frozen=True, slots=True)
class PageCacheStatistics:
    """The page-cache mode's counters (``store.statistics().pagecache``); see :class:`PageCacheCounters`.

    Attributes:
        method: the warming method that really runs (``"read"``, ``"advice"``, ``"parallel-advice"``,
            ``"uring"``; ``"read"`` when ``"uring"`` was asked for without io_uring).
        residency: how resident ranges were found: ``"mincore"`` (trusted: resident ranges are
            skipped), or ``"untrusted"`` when the kernel's ``mincore`` would report every page
            resident for this process (it neither owns nor may write a shard, Linux 5.0+; or
            ``cachestat(2)`` refused): nothing is skipped then, every requested range is warmed,
            ``resident_skipped`` stays 0 and every request counts as a miss.
        ranges_issued: merged ranges handed to a warming call.
        bytes_warmed: bytes those calls covered.
        resident_skipped: merged ranges found resident (``mincore``) and not warmed.
        errors: warming calls that failed.
        prefetch_seconds: time spent in the prefetch step itself (seconds).
        prefetch_calls: prefetch calls per predicted MoE layer (block index -> calls).
        dropped: queued prefetch ranges dropped as no longer wanted.
    """

    method: str
    residency: str
    ranges_issued: int
    bytes_warmed: int
    resident_skipped: int
    errors: int
    prefetch_seconds: float
    prefetch_calls: dict[int, int]
    dropped: int


@dataclass(slots=True, eq=False)
class PinnedExpert:
    """An expert a request holds: its location (views are made from the mappings)."""

    key: Key
    location: ExpertLocation


@dataclass(slots=True, eq=False)
class _Job:
    warm: WarmRange
    keys: frozenset[Key]
    demand: bool
    event: AsyncEvent | None = None
    error: BaseException | None = None
    started: bool = False
    pending: int = 0  # method "uring": reads not completed yet


class MappedExpertCache:
    """Serves experts from the page cache, warming what is not resident.

    The page-cache mode's counterpart of :class:`~aioexperts._cache.cache.ExpertCache` (pins, demand
    before prefetch, drops); the expert source around it is
    :class:`~aioexperts._sources.mapped.MappedSource`.

    Args:
        layout: the expert layout.
        shards: the read-only mappings of the shards.
        fds: the shards' descriptors (buffered), for warming.
        loop: the event loop adapter.
        method: ``"read"``, ``"advice"`` or ``"parallel-advice"``.
        n_threads: worker threads of ``read`` and ``parallel-advice``.
        max_gap: ranges at most this many bytes apart are warmed as one.
        counters: where to count.
        residency_trusted: per shard, whether ``mincore`` may be believed
            (:func:`~aioexperts._io.mapping.residency_trusted`); None: every shard.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        shards: MappedShards,
        fds: Sequence[int],
        loop: LoopAdapter,
        method: str,
        n_threads: int,
        max_gap: int,
        counters: PageCacheCounters,
        uring: IOBackend | None = None,
        residency_trusted: Sequence[bool] | None = None,
    ) -> None:
        self.layout = layout
        #: per shard: whether mincore is believed (else every range of the shard is warmed)
        self.residency_trusted = tuple(residency_trusted) if residency_trusted is not None else (True,) * len(fds)
        #: ``"mincore"``, or ``"untrusted"`` when some shard's residency cannot be trusted
        self.residency = "mincore" if all(self.residency_trusted) else "untrusted"
        self.shards = shards
        self.fds = tuple(fds)
        self.loop = loop
        self.method = method
        self.max_gap = max_gap
        self.counters = counters
        #: worker threads that warm (0 with io_uring: the ring reads, no thread does)
        self.n_threads = 0 if uring is not None else 1 if method == "advice" else n_threads
        #: ranges warmed at once: one per thread, or as many as the ring's depth takes
        self.max_ranges = uring.depth // _CHUNKS_PER_JOB if uring is not None else self.n_threads
        self._pool = ThreadPoolExecutor(max(1, self.n_threads), thread_name_prefix="aioexperts-warm")
        self._uring = uring  # method "uring": reads into its scratch slab
        if uring is not None:
            uring.set_sink(self._uring_done)
        self._local = threading.local()
        self._queue: deque[_Job] = deque()  # not started yet: demand first, then prefetch
        self._running = 0
        self._checking = 0  # size checks running in a thread (_check_sizes_in_thread)
        self._lock = threading.Lock()
        self._done: list[_Job] = []
        self._wake_pending = False
        self._idle: AsyncEvent | None = None
        self.pinned: dict[Key, int] = {}
        self.closed = False

    # -- requests -------------------------------------------------------------------------------

    def _locate(self, keys: Iterable[Key]) -> list[ExpertLocation]:
        return [self.layout.locate(layer, expert) for layer, expert in keys]

    def _missing_ranges(self, locations: Iterable[ExpertLocation]) -> tuple[list[WarmRange], int]:
        """Merged ranges of ``locations`` not fully resident, and how many resident ones were skipped."""
        merged = merge_ranges(
            ((s.shard, s.offset, s.n_bytes) for loc in locations for s in loc.segments), self.shards.sizes, self.max_gap
        )
        missing = []
        for r in merged:
            if not self.residency_trusted[r.shard]:
                missing.append(r)  # mincore would say resident whatever the truth: warm it
                continue
            resident, total = self.shards.residency(r.shard, r.offset, r.n_bytes)
            if resident < total:
                missing.append(r)
        return missing, len(merged) - len(missing)

    async def acquire(
        self,
        keys: Sequence[Key],
        *,
        wait: bool = False,
        after_pin: Callable[[], object] | None = None,
        slot_timeout: float | None = None,
    ) -> list[PinnedExpert]:
        """Pin ``keys`` (duplicates allowed) and warm what is not resident; see ``ExpertCache.acquire``.

        There are no slots to wait for: ``wait`` and ``slot_timeout`` change nothing.

        Raises:
            InvalidRequestError: a key the model does not have.
            ExpertReadError: a warming read failed (cause attached).
            StoreClosedError: the source was closed.
        """
        self._check_open()
        unique = list(dict.fromkeys(keys))
        locations = self._locate(unique)
        pinned = [PinnedExpert(k, loc) for k, loc in zip(unique, locations, strict=True)]
        for p in pinned:
            self.pinned[p.key] = self.pinned.get(p.key, 0) + 1
        try:
            missing, skipped = self._missing_ranges(locations)
            if missing:
                await self._check_sizes_in_thread([loc for loc in locations if _touches(missing, loc)])
                self._check_open()
            c = self.counters
            c.requests += len(unique)
            c.resident_skipped += skipped
            missed = {k for k, loc in zip(unique, locations, strict=True) if _touches(missing, loc)}
            c.misses += len(missed)
            c.hits += len(unique) - len(missed)
            jobs = [self._enqueue(r, frozenset(), demand=True) for r in missing]
            if after_pin is not None:
                after_pin()
            for job in jobs:
                assert job.event is not None
                await job.event.wait()
                if isinstance(job.error, StoreClosedError):
                    raise job.error
                if job.error is not None:
                    raise ExpertReadError(
                        f"warming {job.warm.n_bytes} bytes at offset {job.warm.offset} of shard {job.warm.shard} "
                        f"failed: {job.error}"
                    ) from job.error
            self._check_open()
        except BaseException:
            self.release(pinned)
            raise
        return pinned

    async def _check_sizes_in_thread(self, locations: Sequence[ExpertLocation]) -> None:
        """:meth:`_check_sizes` off the loop (``fstat`` can wait on the file system: NFS, FUSE); the
        source's close waits for it (:meth:`wait_idle`), so the descriptors stay open meanwhile."""
        self._checking += 1
        try:
            await anyio.to_thread.run_sync(self._check_sizes, locations)  # a cancel waits for the thread
        finally:
            self._checking -= 1
            self._wake_idle()

    def _check_sizes(self, locations: Sequence[ExpertLocation]) -> None:
        """Refuse experts past the current end of their file: reading them through the mapping would
        kill the process (``SIGBUS``). A file truncated after this check still can: the page-cache
        mode trusts the model file not to shrink while it is open (the slab mode does not need to).

        Runs in a worker thread, for the experts that are not resident only: a truncation drops the
        pages past the new end from the page cache, so an expert whose pages are all resident cannot
        lie past it (a resident page never raises ``SIGBUS``)."""
        sizes: dict[int, int] = {}
        for loc in locations:
            for seg in loc.segments:
                size = sizes.get(seg.shard)
                if size is None:
                    size = sizes[seg.shard] = os.fstat(self.fds[seg.shard]).st_size
                if seg.end > size:
                    raise ExpertReadError(
                        f"reading layer {loc.layer} expert {loc.expert} failed: the file ends at byte {size}, before "
                        f"the expert's data at bytes [{seg.offset}, {seg.end}) (the model file shrank while open)"
                    )

    def release(self, pinned: Sequence[PinnedExpert]) -> None:
        """Unpin experts from :meth:`acquire` (synchronous)."""
        for p in pinned:
            n = self.pinned.get(p.key, 0) - 1
            if n > 0:
                self.pinned[p.key] = n
            else:
                self.pinned.pop(p.key, None)

    @property
    def running(self) -> int:
        """Warming calls running now."""
        return self._running

    @property
    def pinned_count(self) -> int:
        """Experts with at least one pin."""
        return len(self.pinned)

    # -- prefetch -------------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[Key]) -> int:
        """Queue warming of the non-resident ranges of ``keys``; returns the ranges queued."""
        self._check_open()
        t0 = time.perf_counter()
        unique = list(dict.fromkeys(keys))
        locations = self._locate(unique)
        missing, skipped = self._missing_ranges(locations)
        self.counters.resident_skipped += skipped
        for layer in {k[0] for k in unique}:
            self.counters.prefetch_calls[layer] = self.counters.prefetch_calls.get(layer, 0) + 1
        for r in missing:
            owners = frozenset(k for k, loc in zip(unique, locations, strict=True) if _covers(r, loc))
            self._enqueue(r, owners, demand=False)
        self.counters.prefetch_ranges += len(missing)
        self.counters.prefetch_seconds += time.perf_counter() - t0
        return len(missing)

    def drop_prefetches(self, keep: Callable[[Key], bool] = lambda key: False) -> int:
        """Drop queued prefetch ranges none of whose experts ``keep`` accepts; returns how many."""
        kept: deque[_Job] = deque()
        dropped = 0
        for job in self._queue:
            if job.demand or any(keep(k) for k in job.keys):
                kept.append(job)
            else:
                dropped += 1
        self._queue = kept
        self.counters.dropped += dropped
        return dropped

    # -- warming --------------------------------------------------------------------------------

    def _enqueue(self, warm: WarmRange, keys: frozenset[Key], *, demand: bool) -> _Job:
        job = _Job(warm, keys, demand, self.loop.new_event() if demand else None)
        if demand:
            i = 0
            while i < len(self._queue) and self._queue[i].demand:
                i += 1
            self._queue.insert(i, job)
        else:
            self._queue.append(job)
        self._start_jobs()
        return job

    def _start_jobs(self) -> None:
        while self._queue and self._running < self.max_ranges and not self.closed:
            job = self._queue.popleft()
            job.started = True
            self._running += 1
            self.counters.ranges_issued += 1
            if self._uring is not None:
                self._submit_uring(job)
            else:
                self._pool.submit(self._warm, job)

    def _submit_uring(self, job: _Job) -> None:
        """The range as reads of at most one scratch slot each; the job finishes with its last read."""
        uring = self._uring
        assert uring is not None
        r, chunk = job.warm, uring.slab.slot_bytes
        ops = [
            ReadOp(r.shard, off, min(chunk, r.end - off), i % uring.slab.n_slots, 0, job)
            for i, off in enumerate(range(r.offset, r.end, chunk))
        ]
        job.pending = len(ops)
        try:
            uring.submit(ops)
        except SubmitError as exc:  # the untaken reads never run: account for them now
            job.error = exc
            job.pending -= len(ops) - exc.taken
            if job.pending == 0:
                self._finish_jobs([job])

    def _uring_done(self, op: ReadOp, result: ReadResult) -> None:  # loop thread
        job: _Job = op.context
        if isinstance(result, BaseException) and job.error is None:
            job.error = result
        job.pending -= 1
        if job.pending == 0:
            self._finish_jobs([job])

    def _scratch(self) -> memoryview:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = memoryview(bytearray(SCRATCH_BYTES))
        return scratch

    def _warm(self, job: _Job) -> None:  # worker thread
        r = job.warm
        try:
            if self.method == "read":
                n = warm_read(self.fds[r.shard], r.offset, r.n_bytes, self._scratch())
                if n < r.n_bytes and r.end <= self.shards.sizes[r.shard]:
                    raise OSError(errno.EIO, f"end of file after {n} of {r.n_bytes} bytes (the file shrank?)")
            else:
                warm_advice(self.fds[r.shard], r.offset, r.n_bytes)
        except BaseException as exc:  # every failure reaches the waiter
            job.error = exc
        with self._lock:
            self._done.append(job)
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # loop thread
        with self._lock:
            done, self._done = self._done, []
            self._wake_pending = False
        self._finish_jobs(done)

    def _finish_jobs(self, done: list[_Job]) -> None:  # loop thread
        for job in done:
            self._running -= 1
            if job.error is None:
                self.counters.bytes_warmed += job.warm.n_bytes
            else:
                self.counters.errors += 1
            if job.event is not None:
                job.event.set()
        self._start_jobs()
        self._wake_idle()

    def _wake_idle(self) -> None:  # loop thread
        if self._running == 0 and self._checking == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    # -- closing --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("the store is closed")

    def close(self) -> None:
        """Refuse new requests; fail queued demand warmings with ``StoreClosedError``; drop prefetches."""
        self.closed = True
        queue, self._queue = self._queue, deque()
        for job in queue:
            if job.event is not None:
                job.error = StoreClosedError("the store was closed before this range was warmed")
                job.event.set()

    async def wait_idle(self) -> None:
        """Return once no warming call or size check runs (none starts after :meth:`close`)."""
        while self._running or self._checking:
            self._idle = event = self.loop.new_event()
            await event.wait()

    def detach(self) -> None:
        """Stop watching the event loop (loop thread; after :meth:`wait_idle`, before :meth:`shutdown`)."""
        if self._uring is not None:
            self._uring.detach()

    def shutdown(self) -> None:
        """Stop the worker threads and release the ring (after :meth:`wait_idle` and :meth:`detach`)."""
        self._pool.shutdown(wait=False)
        if self._uring is not None:
            self._uring.close()
            self._uring.slab.close()


def _covers(r: WarmRange, loc: ExpertLocation) -> bool:
    return any(s.shard == r.shard and s.offset < r.end and s.end > r.offset for s in loc.segments)


def _touches(ranges: Sequence[WarmRange], loc: ExpertLocation) -> bool:
    return any(_covers(r, loc) for r in ranges)
