"""The slab source (``mode="slab"``): experts read, ``O_DIRECT`` where possible, into a slab of slots.

Set-up: open the shards (probing direct I/O), plan every expert's reads once, size the slab, build
the read stack (:class:`~aioexperts._sources.stack.ReadStack`: slab, backend, scheduler) and the
cache over it (:class:`~aioexperts._cache.cache.ExpertCache`). Row reads get a stack of their own on
the first :meth:`SlabSource.rows` call (:class:`~aioexperts._sources.rows.RowReader`).
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar, cast

import anyio
import numpy as np

from .._cache.cache import Entry, ExpertCache, Key, SlotState
from .._cache.eviction import make_policy
from .._cache.scheduler import ReadScheduler
from .._cache.stats import Counters, StoreStatistics
from .._errors import InvalidRequestError, StoreClosedError
from .._format.layout import ExpertLayout
from .._format.model import GGUFModel
from .._format.tier_sidecar import TierSidecar
from .._format.views import ExpertTable, ExpertView, ProjectionView, warn_exported
from .._io.files import ShardFiles, open_shards
from .._io.loop import LoopAdapter
from .._io.plan import ExpertPlan, plan_all_experts, plan_expert
from .._io.slab import slot_stride
from .._options import DEFAULT_CACHE_BYTES, CacheOptions, IOOptions, MissTier
from .._timeline import Timeline
from .base import Build, ExpertSource, HeldLayers
from .rows import RowReader, RowStatistics, RowsView
from .shared_views import SharedExpertView, SharedViews
from .stack import ReadStack
from .tier_files import add_sidecar

__all__ = ("SlabSource",)

T = TypeVar("T")

log = logging.getLogger("aioexperts")
#: where a slab other than the one asked for is said (the CLIs say it themselves, with the option's name)
SLAB_LOGGER = "aioexperts.slab"


class SlabSource(ExpertSource):
    """Experts in a slab of slots the source manages.

    Args:
        cache: the slab and cache options.
        io: the read options.
        check_running: raises unless the store may serve (closed, wrong loop); called before work.

    Attributes:
        files: the open shard files (None until opened).
        stack: the expert slab's read stack.
        cache: the expert cache (None until started).
        counters: the store's counters.
    """

    kind = "slab"

    def __init__(self, cache: CacheOptions, io: IOOptions, check_running: Callable[[], None]) -> None:
        self.cache_options = cache
        self.io_options = io
        self._check_running = check_running
        self.files: ShardFiles | None = None
        self.stack = ReadStack()
        self.cache: ExpertCache | None = None
        self.counters = Counters()
        self._model: GGUFModel | None = None
        self._loop: LoopAdapter | None = None
        self._build: Build | None = None
        self._rows: RowReader | None = None
        self._rows_built: RowReader | None = None  # a row reader built, not attached yet
        self._rows_lock = anyio.Lock()
        # layer -> (the layer's placements when built, its table or None: layouts differ)
        self._tables: dict[int, tuple[int, ExpertTable | None]] = {}
        self.tier: TierSidecar | None = None  # the miss tier's sidecar, set before start
        self.tier_policy: MissTier | None = None  # the miss tier's rules, set with the sidecar
        self.tier_off_reason: str | None = None  # why start switched the tier off (None: on, or none given)

    @property
    def scheduler(self) -> ReadScheduler | None:
        """The expert slab's scheduler (None until started)."""
        return self.stack.scheduler

    async def start(self, model: GGUFModel, layout: ExpertLayout, loop: LoopAdapter, build: Build) -> None:
        io, cache = self.io_options, self.cache_options
        self._model, self._loop, self._build = model, loop, build
        files = await build(self, "files", lambda: open_shards(model, io.direct_io))
        if files.buffered_reason is not None and io.direct_io is None:
            log.warning("%s; using buffered reads (the page cache)", files.buffered_reason)
        paths = tuple(s.path for s in model.shards)
        # every expert's reads, planned once at open (off the loop): nothing is planned per read
        plans = await build(
            self, "_plans", lambda: plan_all_experts(layout, files.alignment, io.split_bytes, io.queue_depth)
        )
        tier = self.tier
        if tier is not None:
            full_slots = self._n_slots(layout, max(p.slot_bytes for p in plans.values()), quiet=True)
            if full_slots >= layout.n_experts_total:
                self._tier_off(full_slots, layout.n_experts_total)
                tier = None
        if tier is not None:  # the sidecar is read as one more shard, after the model's
            files = await build(self, "files", lambda: add_sidecar(files, tier))
            paths = (*paths, tier.path)
        low_plans: dict[Key, ExpertPlan] = {}
        if tier is not None:
            shard = len(model.shards)
            low_plans = await build(
                self,
                "_low_plans",
                lambda: {
                    key: plan_expert(tier.location(p.location, shard), files.alignment, io.split_bytes, io.queue_depth)
                    for key, p in plans.items()
                    if key in tier.segments  # a NextN block's experts have no low copy: read in full
                },
            )
        slot_bytes = max(p.slot_bytes for p in (*plans.values(), *low_plans.values()))
        n_slots = self._n_slots(layout, slot_bytes)
        stack = self.stack
        await build(
            stack,
            "slab",
            lambda: stack.build_slab(n_slots, slot_bytes, hugepages=cache.hugepages, lock=cache.lock_memory),
        )
        # ring set-up, buffer registration and the per-slot iovecs are blocking work: off the loop
        shapes = {(r.slot_offset, r.n_bytes) for p in plans.values() for r in p.reads}
        await build(
            stack,
            "backend",
            lambda: _settled(
                stack.build_backend(io.backend, files, loop, io.queue_depth, io.backend_options(), shapes),
                len(plans) + len(low_plans),
            ),
        )
        scheduler = stack.start(loop, self.counters, files, io.max_bytes_in_flight, paths)

        def plan(layer: int, expert: int) -> ExpertPlan:
            found = plans.get((layer, expert))
            if found is None:
                layout.locate(layer, expert)  # InvalidRequestError naming what does not exist
                raise InvalidRequestError(f"no expert {expert} in layer {layer}")
            return found

        def low_plan(layer: int, expert: int) -> ExpertPlan | None:
            return low_plans.get((layer, expert))  # the keys of a request were checked by its full plan

        tier_policy = self.tier_policy

        def reads_behind() -> bool:  # upgrades of low copies wait while this holds
            pending = scheduler.bytes_in_flight + scheduler.queued_bytes
            return tier_policy is not None and tier_policy.reads_behind(pending, self.read_backlog_seconds())

        policy = make_policy(cache.policy) if isinstance(cache.policy, str) else cache.policy
        self.cache = ExpertCache(
            n_slots,
            plan,
            scheduler,
            policy,
            loop,
            self.counters,
            low_plan if low_plans else None,
            tier_policy is None or tier_policy.upgrade,
            reads_behind if tier_policy is not None else None,
            plan_table=plans,
        )

    def _tier_off(self, n_slots: int, n_experts: int) -> None:
        """Switch the miss tier off: the slab holds every routed expert at full precision, so no
        expert is ever evicted and a low copy would only be read twice (low, then full on its hit)."""
        self.tier_off_reason = (
            f"the slab holds every routed expert of the model at full precision ({n_slots} slots for {n_experts} "
            "experts): nothing is ever evicted, so the miss tier is off (each low read would be read again in full)"
        )
        log.info("miss tier: %s", self.tier_off_reason)
        self.tier = None
        self.tier_policy = None

    def _n_slots(self, layout: ExpertLayout, slot_bytes: int, *, quiet: bool = False) -> int:
        total = layout.n_experts_total
        slots = self.cache_options.slots
        if slots is not None:
            return min(slots, total)  # more could never be used
        budget = self.cache_options.bytes or DEFAULT_CACHE_BYTES
        stride = slot_stride(slot_bytes, hugepages=self.cache_options.hugepages)  # what each slot maps
        least = min(2 * layout.n_expert_used, total)  # a layer step's experts and the next one's
        if budget // stride < least and not quiet:
            logging.getLogger(SLAB_LOGGER).warning(
                "cache_bytes=%d holds %d slots of %d bytes; the slab is raised to the minimum of %d slots "
                "(%d bytes: two layers' top-%d experts)",
                budget,
                budget // stride,
                stride,
                least,
                least * stride,
                layout.n_expert_used,
            )
        return max(min(budget // stride, total), least)

    @property
    def started(self) -> bool:
        return self.cache is not None

    @property
    def n_slots(self) -> int:
        assert self.stack.slab is not None
        return self.stack.slab.n_slots

    def _running(self) -> ExpertCache:
        assert self.cache is not None
        return self.cache

    # -- experts --------------------------------------------------------------------------------

    async def acquire(
        self, keys: Sequence[Key], *, wait: bool, after_pin: Callable[[], None], slot_timeout: float | None
    ) -> Sequence[Entry]:
        return await self._running().acquire(keys, wait=wait, after_pin=after_pin, slot_timeout=slot_timeout)

    def pin_ready(self, keys: Sequence[Key]) -> Sequence[Entry] | None:
        return self._running().pin_ready(keys)

    def view(self, pinned: Entry) -> ExpertView:
        return self.views([pinned])[0]

    def views(self, pinned: Sequence[Entry]) -> list[ExpertView]:
        out = []
        for entry in pinned:
            shared = entry.views
            if shared is None:  # once per slot load: every later hit gets the same views
                shared = entry.views = self._shared_views(entry)
            assert isinstance(shared, SharedViews)
            out.append(shared.expert)
        return out

    def _shared_views(self, pinned: Entry) -> SharedViews:
        plan = pinned.plan
        assert isinstance(plan, ExpertPlan)
        loc = plan.location
        slab = self.stack.slab
        assert slab is not None
        g, u, d = loc.gate, loc.up, loc.down  # not loc.segments: a property that builds a tuple
        gv, uv, dv = slab.projection_views(pinned.slot, plan.payload_spans)
        return SharedViews(
            SharedExpertView(
                loc.layer,
                loc.expert,
                loc.bank,
                ProjectionView(gv, g.ggml_type, g.shape),
                ProjectionView(uv, u.ggml_type, u.shape),
                ProjectionView(dv, d.ggml_type, d.shape),
            )
        )

    def end_views(self, pinned: Sequence[Entry], views: Sequence[ExpertView]) -> None:
        for entry in pinned:  # the views stay for the next hit; only the last pin checks what outlives it
            if entry.pins == 1:
                shared = entry.views
                if isinstance(shared, SharedViews):
                    exported = shared.exported()
                    if exported:
                        warn_exported(shared.expert, exported, stacklevel=3)

    def release(self, pinned: Sequence[Entry], owner: object | None = None) -> None:
        self._running().release(pinned, owner)

    def hold_resident(self, n_experts: int) -> HeldLayers | None:
        cache = self._running()
        if cache.n_slots < n_experts:  # it may evict: a hold would stall its reads
            return None
        cache.hold()
        return _HeldSlots(self, cache)

    def prefetch(self, keys: Sequence[Key], low: Sequence[Key] = ()) -> int:
        return self._running().prefetch(keys, low)

    def start_loads(
        self,
        demand: Sequence[Key],
        prefetch: Sequence[Key],
        low: Sequence[Key] = (),
        low_prefetch: Sequence[Key] = (),
        speculative: Sequence[Key] = (),
    ) -> int:
        return self._running().start_loads(demand, prefetch, low, low_prefetch, speculative)

    def read_backlog_seconds(self) -> float | None:
        scheduler, c = self.stack.scheduler, self.counters
        if scheduler is None or c.device_busy_seconds <= 0 or c.bytes_read <= 0:
            return None
        return (scheduler.bytes_in_flight + scheduler.queued_bytes) / (c.bytes_read / c.device_busy_seconds)

    def record_timeline(self, timeline: Timeline | None) -> bool:
        scheduler = self.stack.scheduler
        if scheduler is None:
            return False
        scheduler.timeline = timeline
        return True

    def drop_prefetches(self, keep: Callable[[Key], bool]) -> int:
        return self._running().drop_prefetches(keep)

    def is_ready(self, key: Key) -> bool:
        return self._running().state_of(key) is SlotState.READY

    def ready(self, keys: Sequence[Key]) -> list[bool]:
        return self._running().ready(keys)

    def layer_ready(self, layer: int, n_experts: int) -> bool:
        return self._running().full_ready(layer) >= n_experts

    def model_ready(self, n_experts: int) -> bool:
        return self._running().full_ready_total() >= n_experts

    # -- rows -----------------------------------------------------------------------------------

    async def _row_reader(self) -> RowReader:
        self._check_running()
        async with self._rows_lock:
            if self._rows is None and self._rows_built is None:
                assert self._model is not None and self.files is not None and self._loop is not None
                assert self._build is not None
                io, model, files, loop = self.io_options, self._model, self.files, self._loop
                await self._build(
                    self,
                    "_rows_built",
                    lambda: RowReader(model, files, loop, io, self.cache_options.row_cache_bytes),
                )
            if self._rows is None and self._rows_built is not None:
                self._rows_built.start()
                self._rows, self._rows_built = self._rows_built, None
            self._check_running()
            assert self._rows is not None
            return self._rows

    @asynccontextmanager
    async def rows(self, tensor: str, row_ids: Sequence[object]) -> AsyncIterator[RowsView]:
        reader = await self._row_reader()
        table = reader.table(tensor)
        entries, view = await reader.acquire(table, reader.check_rows(table, row_ids))
        try:
            yield view
        finally:
            exported = reader.release(entries, view)
            if exported:
                warnings.warn(
                    f"{tensor}: rows {exported[:8]} are still exported (e.g. by np.frombuffer) as they are "
                    "unpinned; their slot may be reused under them: copy them inside the block",
                    ResourceWarning,
                    stacklevel=4,
                )

    def row_statistics(self) -> RowStatistics | None:
        return None if self._rows is None else self._rows.statistics()

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        stack, files, cache = self.stack, self.files, self.cache
        assert files is not None and stack.slab is not None and stack.backend is not None
        assert stack.scheduler is not None and cache is not None
        return StoreStatistics.snapshot(
            self.counters,
            busy_in_progress=stack.scheduler.busy_in_progress(),
            backend=stack.backend.name,
            direct_io=files.direct_io,
            fallback_reason=stack.fallback_reason,
            buffered_reason=files.buffered_reason,
            backend_features=stack.backend.features(),
            n_slots=stack.slab.n_slots,
            slot_bytes=stack.slab.slot_bytes,
            alignment=files.alignment,
            in_flight=stack.scheduler.reads_in_flight,
            pinned_slots=cache.pinned_slots,
            miss_tier_off_reason=self.tier_off_reason,
        )

    def reset_statistics(self) -> None:
        self.counters.reset()

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()  # closes the scheduler: nothing queued is submitted any more
        if self._rows is not None:
            self._rows.cache.close()

    def idle_waits(self) -> list[Callable[[], Awaitable[None]]]:
        waits: list[Callable[[], Awaitable[None]]] = []
        if self.stack.scheduler is not None:
            waits.append(self.stack.scheduler.wait_idle)
        if self._rows is not None:
            waits.append(self._rows.stack.scheduler.wait_idle)  # type: ignore[union-attr]
        return waits

    def detach(self) -> None:
        self.stack.detach()
        if self._rows is not None:
            self._rows.stack.detach()

    def release_parts(self) -> list[Callable[[], None]]:
        self._tables.clear()  # they keep the slab mapped; one a held pass still uses keeps it until dropped
        if self.cache is not None:  # the source's own shared views must not keep the slab mapped
            held = self.cache.held  # a held pass uses every entry's views without pins
            for entry in self.cache.entries.values():
                if entry.pins or held:  # a block still uses them: they stay valid, and the mapping with them
                    entry.views = None
                else:
                    entry.drop_views()
        parts: list[Callable[[], None]] = []
        for rows in (self._rows, self._rows_built):
            if rows is not None:
                parts += rows.stack.release_parts()
        stack = self.stack
        if stack.backend is not None:
            parts.append(stack.backend.close)
        if self.files is not None:
            parts.append(self.files.close)
        if stack.slab is not None:
            parts.append(stack.slab.close)
        return parts


#: experts from which an open collects once (below, the objects it made are too few to matter, and
#: a full collection of a large host heap would cost more: 0.5 s with 3 million objects)
SETTLE_MIN_EXPERTS = 1024


def _settled(value: T, n_experts: int) -> T:
    """``value``, after one full garbage collection (in the open's worker thread) when the model has
    at least :data:`SETTLE_MIN_EXPERTS` experts.

    Opening builds about ten long-lived objects per expert (its location, segments and read plan):
    tens of thousands that count towards CPython's next full collection, which would otherwise
    run during the first reads on the loop thread (30-80 ms with a 6144-expert model, measured by
    bench/read_cpu.py). Collected here, at open, the next full collection waits for the heap to
    grow by a quarter again.
    """
    if n_experts >= SETTLE_MIN_EXPERTS:
        gc.collect()
    return value


class _HeldSlots(HeldLayers):
    """An :meth:`ExpertCache.hold` of a slab with room for every expert: views of READY entries, no pins."""

    __slots__ = ("_cache", "_ended", "_source")

    def __init__(self, source: SlabSource, cache: ExpertCache) -> None:
        self._source = source
        self._cache = cache
        self._ended = False

    def view(self, key: Key) -> ExpertView | None:
        self._check_open()
        entry = self._cache.ready_full(key)
        if entry is None:
            return None
        try:
            return self._source.view(entry)
        except ValueError:  # the slab closed since the check
            self._check_open()
            raise

    def _check_open(self) -> None:
        if self._ended:
            raise RuntimeError("the hold has ended")
        if self._cache.closed:
            raise StoreClosedError("the store closed during the hold")

    def table(self, keys: Sequence[Key]) -> ExpertTable | None:
        self._check_open()
        cache = self._cache
        layer = keys[0][0]
        placements = cache.placements(layer)  # read first: a load landing during the build makes it stale
        tables = self._source._tables
        kept = tables.get(layer)
        if kept is not None and kept[0] == placements:
            return kept[1]
        if cache.full_ready(layer) < len(keys):  # still reading the layer: no table yet, nothing kept
            return None
        entries = cache.ready_full_all(keys)
        if entries is None:
            return None
        slots = np.array([entry.slot for entry in entries], dtype=np.int64)
        plans = cast("list[ExpertPlan]", [entry.plan for entry in entries])  # a full entry's plan is one
        layout = plans[0].layout  # equal layouts are one object (ExpertPlan.layout)
        table = None
        if all(plan.layout is layout for plan in plans):  # one layout: slot addresses plus payload offsets
            offsets = np.array([plan.payload_offsets for plan in plans], dtype=np.int64).T
            slab = self._source.stack.slab
            assert slab is not None
            try:
                keep = slab.shared_bytes()  # the table keeps the slab mapped while it lives
            except ValueError:  # closed since the check
                self._check_open()
                raise
            addresses = np.ascontiguousarray((slots * slab.slot_bytes + slab.address)[None, :] + offsets)
            addresses.flags.writeable = False
            table = ExpertTable(addresses, layout, keep)
        tables[layer] = (placements, table)
        return table

    def end(self, requests: int) -> None:
        if self._ended:
            return
        self._ended = True
        cache = self._cache
        cache.end_hold()
        c = cache.counters
        c.requests += requests
        c.hits += requests
        c.cached_hits += requests
