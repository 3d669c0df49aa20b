"""The page-cache source (``mode="pagecache"``): the kernel's page cache is the expert cache.

Set-up: open the shards buffered, map each read-only (:class:`~aioexperts._io.mapping.MappedShards`),
and, for the ``uring`` warming method, a buffered io_uring over a small scratch slab. Views point
into the mappings; pinning and warming are :class:`~aioexperts._cache.mapped_cache.MappedExpertCache`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
from gguf import GGMLQuantizationType

from .._cache.cache import Key
from .._cache.mapped_cache import MappedExpertCache, PageCacheCounters, PinnedExpert
from .._cache.stats import Counters, StoreStatistics
from .._errors import BackendUnavailableError, ExpertReadError, InvalidRequestError
from .._format.layout import ExpertLayout
from .._format.model import GGUFModel
from .._format.views import ExpertView, ProjectionView, release_view
from .._io.backends.base import IOBackend
from .._io.files import ShardFiles, open_shards
from .._io.loop import LoopAdapter
from .._io.mapping import MappedShards, residency_facts, residency_trusted
from .._io.rowplan import RowTable
from .._io.select import create_backend
from .._io.slab import Slab
from .._options import PageCacheOptions
from .base import Build, ExpertSource, finish_in_thread
from .rows import RowReader, RowStatistics, RowsView

__all__ = ("WARM_SCRATCH_BYTES", "WARM_SCRATCH_SLOTS", "MappedSource")

WARM_SCRATCH_SLOTS = 8
WARM_SCRATCH_BYTES = 1 << 20
"""The page-cache mode's ``uring`` warming reads into 8 scratch slots of 1 MiB (the data is thrown away)."""

log = logging.getLogger("aioexperts")


class MappedSource(ExpertSource):
    """Experts served from read-only mappings of the model, warmed into the page cache.

    Args:
        options: the page-cache mode's options.
        queue_depth: the ``uring`` warming ring's depth (``IOOptions.queue_depth``).

    Attributes:
        files: the open shard files (None until opened).
        shards: the mappings (None until mapped).
        pagecache: pins and warming (None until started).
        counters: the mode's counters.
    """

    kind = "pagecache"

    def __init__(self, options: PageCacheOptions, queue_depth: int) -> None:
        self.options = options
        self._queue_depth = queue_depth
        self.files: ShardFiles | None = None
        self.shards: MappedShards | None = None
        self.pagecache: MappedExpertCache | None = None
        self.counters = PageCacheCounters()
        self._warming: IOBackend | None = None  # the uring method's ring, until the source owns it
        self._layout: ExpertLayout | None = None
        self._model: GGUFModel | None = None

    async def start(self, model: GGUFModel, layout: ExpertLayout, loop: LoopAdapter, build: Build) -> None:
        self._model, self._layout = model, layout
        options = self.options
        files = await build(self, "files", lambda: open_shards(model, False))
        shards = await build(self, "shards", lambda: MappedShards(files.fds, files.sizes))
        paths = [s.path for s in model.shards]
        trusted = await finish_in_thread(
            lambda: [residency_trusted(residency_facts(fd, path)) for fd, path in zip(files.fds, paths, strict=True)]
        )
        if not all(trusted):
            log.warning(
                "page-cache mode: mincore would report every page of %s resident (this process neither owns "
                "nor may write it); nothing is skipped, every requested range is warmed",
                ", ".join(p for p, ok in zip(paths, trusted, strict=True) if not ok),
            )
        method, uring = options.method, None
        if method == "uring":
            uring = await build(self, "_warming", lambda: self._warming_ring(files, loop))
            if uring is None:
                method = "read"
            else:
                uring.attach()
        self.pagecache = MappedExpertCache(
            layout,
            shards,
            files.fds,
            loop,
            method,
            options.n_threads,
            options.max_gap,
            self.counters,
            uring,
            trusted,
        )
        self._warming = None  # the source owns it now

    def _warming_ring(self, files: ShardFiles, loop: LoopAdapter) -> IOBackend | None:
        """A buffered io_uring reading into a small scratch slab, or None (logged) where io_uring is not to be had."""
        slab = Slab(WARM_SCRATCH_SLOTS, WARM_SCRATCH_BYTES)
        try:
            backend, _ = create_backend(
                "io_uring", files, slab, loop, self._queue_depth, attach=False, fixed_buffers=False
            )
        except BackendUnavailableError as exc:
            slab.close()
            log.warning("%s; the page-cache mode warms with worker-thread reads instead", exc)
            return None
        return backend

    @property
    def started(self) -> bool:
        return self.pagecache is not None

    @property
    def n_slots(self) -> int:
        assert self._layout is not None
        return self._layout.n_experts_total

    def _running(self) -> MappedExpertCache:
        assert self.pagecache is not None
        return self.pagecache

    # -- experts --------------------------------------------------------------------------------

    async def acquire(
        self, keys: Sequence[Key], *, wait: bool, after_pin: Callable[[], None], slot_timeout: float | None
    ) -> Sequence[PinnedExpert]:
        return await self._running().acquire(keys, wait=wait, after_pin=after_pin, slot_timeout=slot_timeout)

    def view(self, pinned: PinnedExpert) -> ExpertView:
        assert self.shards is not None
        loc = pinned.location
        views = [
            ProjectionView(self.shards.view(seg.shard, seg.offset, seg.n_bytes), seg.ggml_type, seg.shape)
            for seg in loc.segments
        ]
        return ExpertView(loc.layer, loc.expert, loc.bank, *views)

    def release(self, pinned: Sequence[PinnedExpert], owner: object | None = None) -> None:
        self._running().release(pinned)  # no per-task count in page-cache mode

    def prefetch(self, keys: Sequence[Key], low: Sequence[Key] = ()) -> int:
        return self._running().prefetch(keys)  # no miss tier in page-cache mode

    def drop_prefetches(self, keep: Callable[[Key], bool]) -> int:
        return self._running().drop_prefetches(keep)

    # -- rows: straight from the mapping --------------------------------------------------------

    @asynccontextmanager
    async def rows(self, tensor: str, row_ids: Sequence[object]) -> AsyncIterator[RowsView]:
        assert self._model is not None and self.shards is not None and self.files is not None
        info = self._model.tensors.get(tensor) if isinstance(tensor, str) else None
        if info is None:
            raise InvalidRequestError(f"the model has no tensor {tensor!r}")
        table = RowTable.of(0, info, 4096, self.shards.sizes[info.shard])
        rows = RowReader.check_rows(table, row_ids)
        # past the end, the mapping raises SIGBUS; fstat off the loop (it can wait on NFS or FUSE)
        size = (await anyio.to_thread.run_sync(os.fstat, self.files.fds[info.shard])).st_size
        if rows and table.row_offset(max(rows)) + table.row_bytes > size:
            raise ExpertReadError(f"{info.name}: the file ends at byte {size}, before row {max(rows)} (it shrank)")
        views = tuple(
            self.shards.view(info.shard, info.data_offset + r * table.row_bytes, table.row_bytes) for r in rows
        )
        qtype = GGMLQuantizationType(info.ggml_type)
        view = RowsView(info.name, qtype, int(info.shape[1]), table.row_bytes, tuple(rows), views)
        try:
            yield view
        finally:
            for data in views:
                release_view(data)

    def row_statistics(self) -> RowStatistics | None:
        return None

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        pagecache, files = self.pagecache, self.files
        assert pagecache is not None and files is not None and self._layout is not None
        pc = self.counters
        counters = Counters(
            requests=pc.requests,
            hits=pc.hits,
            misses=pc.misses,
            prefetch_issued=pc.prefetch_ranges,
            prefetch_dropped=pc.dropped,
            reads=pc.ranges_issued,
            read_errors=pc.errors,
            bytes_read=pc.bytes_warmed,
        )
        return StoreStatistics.snapshot(
            counters,
            backend=f"pagecache ({pagecache.method})",
            direct_io=False,
            fallback_reason=None,
            buffered_reason="page-cache mode",
            backend_features={
                "threads": pagecache.n_threads,
                "ranges_at_once": pagecache.max_ranges,
                "max_gap": self.options.max_gap,
            },
            n_slots=self.n_slots,
            slot_bytes=0,
            alignment=files.alignment,
            in_flight=pagecache.running,
            pinned_slots=pagecache.pinned_count,
            pagecache=pc.snapshot(pagecache.method, pagecache.residency),
        )

    def reset_statistics(self) -> None:
        self.counters.reset()

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        if self.pagecache is not None:
            self.pagecache.close()

    def idle_waits(self) -> list[Callable[[], Awaitable[None]]]:
        return [] if self.pagecache is None else [self.pagecache.wait_idle]

    def detach(self) -> None:
        if self.pagecache is not None:
            self.pagecache.detach()

    def release_parts(self) -> list[Callable[[], None]]:
        parts: list[Callable[[], None]] = []
        warming = self._warming
        if warming is not None:  # a start() cancelled before the page-cache source took it
            parts += [warming.close, warming.slab.close]
        if self.pagecache is not None:
            parts.append(self.pagecache.shutdown)
        if self.shards is not None:
            parts.append(self.shards.close)
        if self.files is not None:
            parts.append(self.files.close)
        return parts
