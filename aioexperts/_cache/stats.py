"""Counters and latency samples of an expert store, and the frozen record ``statistics()`` returns."""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .mapped_cache import PageCacheStatistics

__all__ = ("Counters", "StoreStatistics", "LatencyWindow", "to_ms")


class LatencyWindow:
    """The last ``capacity`` latency samples (seconds), for percentiles without unbounded memory."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        # array.array, not numpy: one store per expert read on the loop thread, ~5x cheaper
        self._samples = array.array("d", bytes(8 * capacity))
        self._capacity = capacity
        self._n = 0

    def add(self, seconds: float) -> None:
        """Record one sample."""
        n = self._n
        self._samples[n % self._capacity] = seconds
        self._n = n + 1

    @property
    def count(self) -> int:
        """Samples ever recorded."""
        return self._n

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0..100) in seconds of the kept samples, or None if there are none."""
        if self._n == 0:
            return None
        kept = np.frombuffer(self._samples, dtype=np.float64)[: min(self._n, self._capacity)]
        return float(np.percentile(kept, q))

    def clear(self) -> None:
        """Forget every sample."""
        self._n = 0


@dataclass(slots=True)
class Counters:
    """Mutable counters updated on the loop thread by the cache and the scheduler."""

    requests: int = 0
    hits: int = 0
    inflight_joins: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_dropped: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0
    reads: int = 0
    read_retries: int = 0
    read_errors: int = 0
    bytes_read: int = 0
    payload_bytes: int = 0
    submissions: int = 0
    max_batch: int = 0
    cached_hits: int = 0
    prefetched_in_time: int = 0
    prefetched_late: int = 0
    demand_misses: int = 0
    low_tier_misses: int = 0
    tier_upgrades: int = 0
    low_tier_prefetches: int = 0
    low_tier_prefetch_hits: int = 0
    tier_upgrades_deferred: int = 0
    device_busy_seconds: float = 0.0
    expert_latency: LatencyWindow = field(default_factory=LatencyWindow)

    def reset(self) -> None:
        """Zero every counter and forget the latency samples."""
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, LatencyWindow):
                value.clear()
            else:
                setattr(self, name, type(value)())  # 0 or 0.0


def to_ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds, None passing through."""
    return None if seconds is None else seconds * 1e3


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of an expert store's counters (``store.statistics()``).

    Counts are since open (or the last ``reset_statistics()``). Every expert a request names once
    is one of ``hits`` (resident), ``inflight_joins`` (a read already under way was shared) or
    ``misses`` (a new read), so ``requests == hits + inflight_joins + misses``.

    Attributes:
        backend: ``"io_uring"``, ``"threads"``, a custom backend's ``name`` (``"fake"``), or in
            page-cache mode ``"pagecache (METHOD)"``.
        direct_io: reads bypass the page cache (``O_DIRECT``).
        fallback_reason: why ``backend="auto"`` did not get io_uring, else None.
        buffered_reason: why direct I/O is off, else None.
        backend_features: backend details (registered buffers, threads, ...).
        n_slots, slot_bytes: slab geometry (slot size in bytes).
        alignment: bytes reads are aligned to.
        requests, hits, inflight_joins, misses: see above.
        prefetch_issued: expert loads started by prefetch.
        prefetch_hits: requests served by a prefetched expert (resident or in flight).
        prefetch_dropped: prefetches dropped before submission (no longer wanted).
        prefetch_wasted: prefetched experts evicted before any request used them.
        evictions: READY experts evicted to make room.
        reads: read operations submitted (an expert is one to three reads; retries included).
        read_retries: reads submitted again after a short read.
        read_errors: expert loads that failed.
        bytes_read: bytes the reads returned (alignment padding included).
        payload_bytes: expert bytes (gate + up + down) loaded.
        submissions: backend submit calls; ``reads / submissions`` is the batch size.
        max_batch: most reads in one submission.
        in_flight: reads in flight now.
        pinned_slots: slots pinned now (by open ``experts()`` blocks and running layer steps).
        pagecache: the page-cache mode's own counters (``open(mode="pagecache")``), else None;
            there, ``reads`` and ``bytes_read`` count warming calls and the bytes they covered, and
            ``prefetch_issued`` / ``prefetch_dropped`` count merged ranges.
        expert_latency_p50_ms, expert_latency_p99_ms: per expert load, submit to ready (ms).
        cached_hits: requests served by an expert resident before the request asked that no
            prefetch brought in since its last request (the cache's own work).
        prefetched_in_time: requests served by a prefetched expert already READY.
        prefetched_late: requests that found their prefetched expert still loading (the request waited).
        demand_misses: requests whose expert was not resident nor prefetched: a new read (or a
            join of another request's demand read). ``requests == cached_hits + prefetched_in_time
            + prefetched_late + demand_misses`` in slab mode (page-cache mode leaves all four 0).
        low_tier_misses: of ``demand_misses``, those whose read went to the low-precision miss tier
            (a read that failed counts: its request got the read's error).
        tier_upgrades: reads of low-tier copies again at full precision after a hit, started (one
            that fails keeps the low copy, which a later hit may upgrade again).
        low_tier_prefetches: of ``prefetch_issued``, the prefetches read from the low tier.
        low_tier_prefetch_hits: of ``prefetched_in_time + prefetched_late``, the requests served by
            a low-tier prefetch.
        tier_upgrades_deferred: upgrades put off because the reads were behind (each low copy
            counted once per wait; it is upgraded at a later release once they caught up).
        device_busy_seconds: wall time during which at least one read was in flight; the device
            rate is ``bytes_read / device_busy_seconds`` (:attr:`device_rate`).
        miss_tier_off_reason: why a :class:`~aioexperts.MissTier` given to ``open`` was switched
            off when the store started (the slab holds every routed expert at full precision),
            else None (no tier given, or the tier serves).
    """

    backend: str
    direct_io: bool
    fallback_reason: str | None
    buffered_reason: str | None
    backend_features: dict[str, Any]
    n_slots: int
    slot_bytes: int
    alignment: int
    requests: int
    hits: int
    inflight_joins: int
    misses: int
    prefetch_issued: int
    prefetch_hits: int
    prefetch_dropped: int
    prefetch_wasted: int
    evictions: int
    reads: int
    read_retries: int
    read_errors: int
    bytes_read: int
    payload_bytes: int
    submissions: int
    max_batch: int
    in_flight: int
    pinned_slots: int
    expert_latency_p50_ms: float | None
    expert_latency_p99_ms: float | None
    pagecache: PageCacheStatistics | None = None
    cached_hits: int = 0
    prefetched_in_time: int = 0
    prefetched_late: int = 0
    demand_misses: int = 0
    low_tier_misses: int = 0
    tier_upgrades: int = 0
    low_tier_prefetches: int = 0
    low_tier_prefetch_hits: int = 0
    tier_upgrades_deferred: int = 0
    device_busy_seconds: float = 0.0
    miss_tier_off_reason: str | None = None

    @property
    def device_rate(self) -> float | None:
        """Bytes per second the reads returned while at least one was in flight (None before any read)."""
        return self.bytes_read / self.device_busy_seconds if self.device_busy_seconds > 0 else None

    @property
    def hit_rate(self) -> float:
        """``hits / requests`` (0.0 with no requests)."""
        return self.hits / self.requests if self.requests else 0.0

    @classmethod
    def snapshot(cls, c: Counters, busy_in_progress: float = 0.0, **fixed: Any) -> StoreStatistics:
        """Build a record from live counters plus the fixed store facts in ``fixed``;
        ``busy_in_progress``: seconds of the device's busy interval still open (reads in flight now)."""
        return cls(
            **fixed,
            requests=c.requests,
            hits=c.hits,
            inflight_joins=c.inflight_joins,
            misses=c.misses,
            prefetch_issued=c.prefetch_issued,
            prefetch_hits=c.prefetch_hits,
            prefetch_dropped=c.prefetch_dropped,
            prefetch_wasted=c.prefetch_wasted,
            evictions=c.evictions,
            reads=c.reads,
            read_retries=c.read_retries,
            read_errors=c.read_errors,
            bytes_read=c.bytes_read,
            payload_bytes=c.payload_bytes,
            submissions=c.submissions,
            max_batch=c.max_batch,
            cached_hits=c.cached_hits,
            prefetched_in_time=c.prefetched_in_time,
            prefetched_late=c.prefetched_late,
            demand_misses=c.demand_misses,
            low_tier_misses=c.low_tier_misses,
            tier_upgrades=c.tier_upgrades,
            low_tier_prefetches=c.low_tier_prefetches,
            low_tier_prefetch_hits=c.low_tier_prefetch_hits,
            tier_upgrades_deferred=c.tier_upgrades_deferred,
            device_busy_seconds=c.device_busy_seconds + busy_in_progress,
            expert_latency_p50_ms=to_ms(c.expert_latency.percentile(50)),
            expert_latency_p99_ms=to_ms(c.expert_latency.percentile(99)),
        )
