"""The expert store: files, slab, read backend, scheduler and cache of one model, behind ``experts()``.

:func:`open` builds an :class:`ExpertStore`; ``async with`` starts it (parse, open, probe, map,
set up the backend) and closes it. The store knows nothing about computing: an
:class:`~aioexperts.MoERunner` runs MoE layers on top of it, and hosts with their own kernels use
:meth:`ExpertStore.experts` directly.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import numpy as np
from gguf import GGMLQuantizationType

from ._cache.cache import Entry, ExpertCache, Key
from ._cache.eviction import make_policy
from ._cache.pagecache import PageCacheCounters, PageCacheSource, PinnedExpert
from ._cache.scheduler import ReadScheduler
from ._cache.stats import Counters, StoreStatistics
from ._errors import (
    BackendUnavailableError,
    ConfigError,
    ExpertReadError,
    InvalidRequestError,
    StoreClosedError,
    UnsupportedTypeError,
)
from ._format.expert_map import check_map_matches_layout, read_expert_map
from ._format.hparams import MoEHParams
from ._format.layout import ExpertLayout, MoELayer, build_layout
from ._format.model import GGUFModel, open_model
from ._format.views import ExpertView, ProjectionView, release_view
from ._io.backends.base import IOBackend
from ._io.files import ShardFiles, open_shards
from ._io.loop import LoopAdapter, current_loop, wait_through_cancellation
from ._io.pagecache import MappedShards, residency_facts, residency_trusted
from ._io.plan import ExpertPlan, plan_all_experts
from ._io.rowplan import RowTable
from ._io.select import create_backend
from ._io.slab import Slab, exported_view, slot_stride
from ._options import DEFAULT_CACHE_BYTES, CacheOptions, IOOptions, PageCacheOptions
from ._rows import RowReader, RowStatistics, RowsView

__all__ = ("MODES", "ExpertStore", "open")

WARM_SCRATCH_SLOTS = 8
WARM_SCRATCH_BYTES = 1 << 20
"""The page-cache mode's ``uring`` warming reads into 8 scratch slots of 1 MiB (the data is thrown away)."""

MODES = ("slab", "pagecache")

log = logging.getLogger("aioexperts")

T = TypeVar("T")


def open(  # noqa: A001 - mirrors the builtin on purpose: aioexperts.open(path)
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    *,
    slots: int | None = None,
    cache_bytes: int | None = None,
    cache: CacheOptions | None = None,
    io: IOOptions | None = None,
    expert_map: str | bytes | os.PathLike[str] | os.PathLike[bytes] | None = None,
    include_nextn: bool = False,
    mode: str = "slab",
    pagecache: PageCacheOptions | None = None,
) -> ExpertStore:
    """Prepare an expert store for the GGUF model at ``path``; start it with ``async with``.

    Example::

        async with aioexperts.open("model.gguf", slots=256) as store:
            async with store.experts(layer=3, ids=[0, 1]) as views:
                gate_bytes = views[0].gate.data

    Args:
        path: a ``.gguf`` file, or any shard of a split set ``NAME-0000k-of-0000n.gguf`` (``str``,
            ``bytes`` or path-like; a leading ``~`` is expanded).
        slots: shorthand for ``cache=CacheOptions(slots=...)``.
        cache_bytes: shorthand for ``cache=CacheOptions(bytes=...)`` (slab size in bytes).
        cache: the slab and cache options (size, eviction policy, waiting for slots).
        io: the read options (backend, direct I/O, queue depth).
        expert_map: a ``WEEPF001`` map to check against the model (refused if stale).
        include_nextn: also serve the experts of the NextN / multi-token-prediction blocks, which
            llama.cpp (and the runner) leave out (see :func:`aioexperts.build_layout`).
        mode: ``"slab"`` (default: experts are read, ``O_DIRECT`` where possible, into a slab of
            slots the store manages) or ``"pagecache"`` (the kernel's page cache is the cache:
            views point into a read-only mapping of the model and prefetch only warms the page
            cache; for models that mostly fit in RAM, several processes sharing one model, or
            file systems without ``O_DIRECT``). ``cache`` and ``io`` apply to the slab mode only.
            In page-cache mode a model file truncated in place while the store is open kills
            the process with ``SIGBUS`` on the next touch past its new end (a mapping cannot
            be guarded); replace model files by renaming, never by writing into them.
        pagecache: the page-cache mode's options (warming method, threads, merge gap).

    Raises:
        ConfigError: an argument is out of range, or the cache is sized twice (``slots`` or
            ``cache_bytes`` together with ``cache``, or both shorthands). Raised here, before any I/O.
    """
    if cache is not None and not isinstance(cache, CacheOptions):
        raise ConfigError(f"cache must be a CacheOptions, got {cache!r}")
    if io is not None and not isinstance(io, IOOptions):
        raise ConfigError(f"io must be an IOOptions, got {io!r}")
    if not isinstance(include_nextn, bool):
        raise ConfigError(f"include_nextn must be True or False, got {include_nextn!r}")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if pagecache is not None and not isinstance(pagecache, PageCacheOptions):
        raise ConfigError(f"pagecache must be a PageCacheOptions, got {pagecache!r}")
    if pagecache is not None and mode != "pagecache":
        raise ConfigError('pagecache options need mode="pagecache"')
    if mode == "pagecache" and (cache is not None or slots is not None or cache_bytes is not None):
        raise ConfigError(
            "the page-cache mode has no slab: slots, cache_bytes and cache do not apply (the page cache is the "
            "cache; PageCacheOptions set its warming)"
        )
    if slots is not None or cache_bytes is not None:
        if cache is not None:
            raise ConfigError("give the cache size either as slots=/cache_bytes= or inside cache=, not both")
        cache = CacheOptions(slots=slots, bytes=cache_bytes)
    return ExpertStore(
        _path_arg("path", path),
        cache or CacheOptions(),
        io or IOOptions(),
        None if expert_map is None else _path_arg("expert_map", expert_map),
        include_nextn,
        pagecache or PageCacheOptions() if mode == "pagecache" else None,
    )


def _path_arg(name: str, value: object) -> str:
    if not isinstance(value, str | bytes | os.PathLike):
        raise ConfigError(f"{name} must be a str, bytes or os.PathLike, got {value!r}")
    return os.path.expanduser(os.fsdecode(value))


class ExpertStore:
    """Streams the routed experts of one model into a slab of slots. Create it with :func:`open`.

    Use it from one event loop (asyncio, uvloop or trio) and one thread. ``async with`` starts and
    closes it; :meth:`start` and :meth:`aclose` do the same by hand.

    Attributes:
        path: the model file given to :func:`open`.
        cache_options: the :class:`~aioexperts.CacheOptions` in force.
        io_options: the :class:`~aioexperts.IOOptions` in force.
        pagecache_options: the :class:`~aioexperts.PageCacheOptions` in page-cache mode, else None.
    """

    def __init__(
        self,
        path: str,
        cache: CacheOptions,
        io: IOOptions,
        expert_map: str | None,
        include_nextn: bool = False,
        pagecache: PageCacheOptions | None = None,
    ) -> None:
        self.path = path
        self._include_nextn = include_nextn
        self.pagecache_options = pagecache
        self.cache_options = cache
        self.io_options = io
        self._expert_map = expert_map
        self._started = False
        self._closed = False
        self._released = False
        self._counters = Counters()
        self._model: GGUFModel | None = None
        self._layout: ExpertLayout | None = None
        self._hparams: MoEHParams | UnsupportedTypeError | None = None
        self._files: ShardFiles | None = None
        self._slab: Slab | None = None
        self._backend: IOBackend | None = None
        self._fallback_reason: str | None = None
        self._loop: LoopAdapter | None = None
        self._scheduler: ReadScheduler | None = None
        self._cache: ExpertCache | None = None
        self._shards: MappedShards | None = None
        self._pagecache: PageCacheSource | None = None
        self._pagecache_counters = PageCacheCounters()
        self._rows: RowReader | None = None
        self._rows_lock = anyio.Lock()
        self._release: _Release | None = None
        self._warming: IOBackend | None = None  # the page-cache mode's ring, until its source owns it
        self._rows_built: RowReader | None = None  # a row reader built, not attached yet

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> ExpertStore:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Parse the model, open the files, probe direct I/O, map the slab and set up the backend.

        The blocking parts (parsing, opening, pre-faulting the slab) run in a worker thread.

        Raises:
            FileNotFoundError: no such model file.
            FormatError: the model (or ``expert_map``) is malformed or stale.
            ConfigError: the store was started before, or a custom policy or backend is unusable.
            BackendUnavailableError: a forced backend or ``direct_io=True`` cannot work here.
        """
        if self._started:
            raise ConfigError("the store was already started")
        self._started = True
        self._loop = loop = current_loop()
        io, cache = self.io_options, self.cache_options
        try:
            model, layout, hparams = await _finish_in_thread(self._parse)
            self._model, self._layout, self._hparams = model, layout, hparams
            if self.pagecache_options is not None:
                await self._start_pagecache(model, layout, loop, self.pagecache_options)
                return
            files = await self._build("_files", lambda: open_shards(model, io.direct_io))
            if files.buffered_reason is not None and io.direct_io is None:
                log.warning("%s; using buffered reads (the page cache)", files.buffered_reason)
            # every expert's reads, planned once at open (off the loop): nothing is planned per read
            plans = await _finish_in_thread(
                lambda: plan_all_experts(layout, files.alignment, io.split_bytes, io.queue_depth)
            )
            slot_bytes = max(p.slot_bytes for p in plans.values())
            n_slots = self._n_slots(layout, slot_bytes)
            slab = await self._build(
                "_slab", lambda: Slab(n_slots, slot_bytes, hugepages=cache.hugepages, lock=cache.lock_memory)
            )
            # ring set-up, buffer registration and the per-slot iovecs are blocking work: off the loop
            shapes = {(r.slot_offset, r.n_bytes) for p in plans.values() for r in p.reads}

            def make_backend() -> tuple[IOBackend, str | None]:
                built, reason = create_backend(
                    io.backend, files, slab, loop, io.queue_depth, attach=False, **io.backend_options()
                )
                self._backend = built
                built.prepare(shapes)
                return built, reason

            backend, self._fallback_reason = await _finish_in_thread(make_backend)
            backend.attach()
            scheduler = self._scheduler = ReadScheduler(
                backend,
                loop,
                self._counters,
                files.sizes,
                files.dio_alignment,  # short reads continue at the kernel's alignment
                io.max_bytes_in_flight,
                tuple(s.path for s in model.shards),
            )

            def plan(layer: int, expert: int) -> ExpertPlan:
                found = plans.get((layer, expert))
                if found is None:
                    layout.locate(layer, expert)  # InvalidRequestError naming what does not exist
                    raise InvalidRequestError(f"no expert {expert} in layer {layer}")
                return found

            policy = make_policy(cache.policy) if isinstance(cache.policy, str) else cache.policy
            self._cache = ExpertCache(n_slots, plan, scheduler, policy, loop, self._counters)
        except BaseException:
            self._release_resources()
            self._closed = True
            raise

    async def _start_pagecache(
        self, model: GGUFModel, layout: ExpertLayout, loop: LoopAdapter, options: PageCacheOptions
    ) -> None:
        files = await self._build("_files", lambda: open_shards(model, False))
        shards = await self._build("_shards", lambda: MappedShards(files.fds, files.sizes))
        paths = [s.path for s in model.shards]
        trusted = await _finish_in_thread(
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
            uring = await self._build("_warming", lambda: self._warming_ring(files, loop))
            if uring is None:
                method = "read"
            else:
                uring.attach()
        self._pagecache = PageCacheSource(
            layout,
            shards,
            files.fds,
            loop,
            method,
            options.n_threads,
            options.max_gap,
            self._pagecache_counters,
            uring,
            trusted,
        )
        self._warming = None  # the source owns it now

    async def _build(self, attribute: str, build: Callable[[], T]) -> T:
        """``build()`` in a worker thread (:func:`_finish_in_thread`), its result stored as ``self.<attribute>``
        in that thread: files, mappings and rings opened by a ``start()`` that is cancelled meanwhile
        are still released by :meth:`_release_resources`."""

        def build_and_keep() -> T:
            value = build()
            setattr(self, attribute, value)
            return value

        return await _finish_in_thread(build_and_keep)

    def _warming_ring(self, files: ShardFiles, loop: LoopAdapter) -> IOBackend | None:
        """A buffered io_uring reading into a small scratch slab, or None (logged) where io_uring is not to be had."""
        slab = Slab(WARM_SCRATCH_SLOTS, WARM_SCRATCH_BYTES)
        try:
            backend, _ = create_backend(
                "io_uring", files, slab, loop, self.io_options.queue_depth, attach=False, fixed_buffers=False
            )
        except BackendUnavailableError as exc:
            slab.close()
            log.warning("%s; the page-cache mode warms with worker-thread reads instead", exc)
            return None
        return backend

    def _parse(self) -> tuple[GGUFModel, ExpertLayout, MoEHParams | UnsupportedTypeError]:
        model = open_model(self.path)
        layout = build_layout(model, include_nextn=self._include_nextn)
        hparams: MoEHParams | UnsupportedTypeError
        try:
            hparams = MoEHParams.from_metadata(model.architecture, model.metadata)
        except UnsupportedTypeError as exc:  # no compute for it; the raw expert bytes still stream
            hparams = exc
        if self._expert_map is not None:
            if len(model.shards) != 1:
                raise ConfigError("a WEEPF001 expert map describes one file; this model is a split set")
            emap = read_expert_map(self._expert_map, model.shards[0])
            check_map_matches_layout(emap, layout, self._expert_map)
        return model, layout, hparams

    def _n_slots(self, layout: ExpertLayout, slot_bytes: int) -> int:
        total = layout.n_experts_total
        slots = self.cache_options.slots
        if slots is not None:
            return min(slots, total)  # more could never be used
        budget = self.cache_options.bytes or DEFAULT_CACHE_BYTES
        stride = slot_stride(slot_bytes, hugepages=self.cache_options.hugepages)  # what each slot maps
        return max(min(budget // stride, total), min(2 * layout.n_expert_used, total))

    async def aclose(self) -> None:
        """Close the store: refuse new requests, wait for every read in flight, free everything.

        Requests waiting for experts that were not read yet get ``StoreClosedError``; queued
        reads (re-reads after a short read included) are never submitted. Calling it again is
        harmless: a call made while another one is releasing waits for that release (the
        resources are released once); after a call that failed, it completes the release.

        Cancellation handling:
            Memory the kernel may still write into is never unmapped: a cancellation (anyio/trio
            cancel scope, ``Task.cancel()``, an ``asyncio.wait_for`` timeout) that arrives while
            reads are in flight is held until they completed and the ring, eventfd, files and slab
            are released, then re-raised.

        Raises:
            ConfigError: called from another event loop (or thread) than the one the store was
                started in: close it where it lives.
            Exception: what releasing a resource raised (the ring exit, closing a descriptor);
                every other resource was released all the same.
        """
        if self._released:
            return
        if self._loop is not None and not self._loop.is_current():
            raise ConfigError(
                "aclose() was called from another event loop than the one the store was started in; "
                "close the store from its own loop"
            )
        self._closed = True
        if self._cache is not None:
            self._cache.close()  # closes the scheduler: nothing queued is submitted any more
        if self._pagecache is not None:
            self._pagecache.close()
        if self._rows is not None:
            self._rows.cache.close()
        held: BaseException | None = None
        for wait_idle in (
            self._scheduler.wait_idle if self._scheduler is not None else None,
            self._pagecache.wait_idle if self._pagecache is not None else None,
            self._rows.scheduler.wait_idle if self._rows is not None else None,
        ):
            if wait_idle is not None:
                held = await wait_through_cancellation(wait_idle) or held
        if self._backend is not None:
            self._backend.detach()
        if self._rows is not None:
            self._rows.backend.detach()
        if self._pagecache is not None:
            self._pagecache.detach()
        # ring exit and munmap of the slab block: in a thread of their own, waited for to the end.
        # One release at a time: a concurrent aclose() waits for the one running instead of
        # releasing the same ring, descriptors and slab again from a second thread.
        release = self._release
        if release is None or release.done.is_set():  # none yet, or the last one failed: try again
            release = self._release = _Release(self._release_resources)
        held = await wait_through_cancellation(lambda: anyio.to_thread.run_sync(release.done.wait)) or held
        if release.failure is not None:
            raise release.failure
        if held is not None:
            raise held

    def _release_resources(self) -> None:
        """Release the page-cache workers and mappings, the backend, the files and the slab.

        Every part is attempted (each is idempotent), even after one of them raised; the first
        exception is raised once all were tried, and the store counts as released only when none
        raised (a later :meth:`aclose` tries the rest again).
        """
        if self._cache is not None:  # the store's own cached exporters must not keep the slab mapped
            for entry in self._cache.entries.values():
                entry.exporters = None
        parts: list[Callable[[], None]] = []
        warming = self._warming
        if warming is not None:  # a start() cancelled before the page-cache source took it
            parts += [warming.close, warming.slab.close]
        for rows in (self._rows, self._rows_built):
            if rows is not None:
                parts += [rows.backend.close, rows.slab.close]
        if self._pagecache is not None:
            parts.append(self._pagecache.shutdown)
        if self._shards is not None:
            parts.append(self._shards.close)
        if self._backend is not None:
            parts.append(self._backend.close)
        if self._files is not None:
            parts.append(self._files.close)
        if self._slab is not None:
            parts.append(self._slab.close)
        failures: list[BaseException] = []
        for part in parts:
            try:
                part()
            except BaseException as exc:  # the other parts are still released
                failures.append(exc)
        self._released = not failures
        if failures:
            raise failures[0]

    def __del__(self) -> None:
        if self._started and not self._released:
            warnings.warn(
                f"{self!r} was not closed: use `async with aioexperts.open(...)` or await aclose()",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    # -- what the store holds -------------------------------------------------------------------

    @property
    def model(self) -> GGUFModel:
        """The parsed model (metadata, tensors, shards)."""
        self._check_started()
        assert self._model is not None
        return self._model

    @property
    def layout(self) -> ExpertLayout:
        """The expert layout (layers, banks, where every expert's bytes are)."""
        self._check_started()
        assert self._layout is not None
        return self._layout

    @property
    def hparams(self) -> MoEHParams:
        """The model's MoE hyper-parameters (gating, top-k, normalisation, scale).

        Raises:
            UnsupportedTypeError: the architecture routes in a way the executor does not compute
                (``docs/executor.md``); :meth:`experts` still serves its experts.
        """
        self._check_started()
        if isinstance(self._hparams, UnsupportedTypeError):
            raise UnsupportedTypeError(str(self._hparams)) from self._hparams
        assert self._hparams is not None
        return self._hparams

    @property
    def mode(self) -> str:
        """``"slab"`` or ``"pagecache"``."""
        return "slab" if self.pagecache_options is None else "pagecache"

    @property
    def n_slots(self) -> int:
        """The most distinct experts that can be pinned at once: the slab's slots (page-cache mode:
        every expert of the model)."""
        self._check_started()
        if self._slab is None:
            return self.layout.n_experts_total
        return self._slab.n_slots

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose` (or a failed :meth:`start`)."""
        return self._closed

    def _check_started(self) -> None:
        if self._layout is None:
            raise StoreClosedError("the store is not started: use `async with aioexperts.open(...)`")

    def _check_running(self) -> None:
        """Raise unless the store is started, open and used from its own event loop."""
        if self._closed:
            raise StoreClosedError("the store is closed")
        self._check_started()
        if self._loop is not None and not self._loop.is_current():
            raise ConfigError(
                "the store is used from another event loop than the one it was started in; "
                "open one store per event loop"
            )

    def _running_cache(self) -> ExpertCache | PageCacheSource:
        self._check_running()
        source = self._cache or self._pagecache
        assert source is not None
        return source

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        """A frozen snapshot of the counters and the store's I/O set-up."""
        self._check_started()
        if self._pagecache is not None:
            return self._pagecache_statistics()
        assert self._files is not None and self._slab is not None and self._backend is not None
        assert self._scheduler is not None and self._cache is not None
        return StoreStatistics.snapshot(
            self._counters,
            backend=self._backend.name,
            direct_io=self._files.direct_io,
            fallback_reason=self._fallback_reason,
            buffered_reason=self._files.buffered_reason,
            backend_features=self._backend.features(),
            n_slots=self._slab.n_slots,
            slot_bytes=self._slab.slot_bytes,
            alignment=self._files.alignment,
            in_flight=self._scheduler.reads_in_flight,
            pinned_slots=self._cache.pinned_slots,
        )

    def _pagecache_statistics(self) -> StoreStatistics:
        assert self._pagecache is not None and self.pagecache_options is not None and self._files is not None
        pc = self._pagecache_counters
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
            backend=f"pagecache ({self._pagecache.method})",
            direct_io=False,
            fallback_reason=None,
            buffered_reason="page-cache mode",
            backend_features={
                "threads": self._pagecache.n_threads,
                "ranges_at_once": self._pagecache.max_ranges,
                "max_gap": self.pagecache_options.max_gap,
            },
            n_slots=self.n_slots,
            slot_bytes=0,
            alignment=self._files.alignment,
            in_flight=self._pagecache.running,
            pinned_slots=self._pagecache.pinned_count,
            pagecache=pc.snapshot(self._pagecache.method, self._pagecache.residency),
        )

    def reset_statistics(self) -> None:
        """Zero the counters (the cache contents stay)."""
        self._counters.reset()
        self._pagecache_counters.reset()

    # -- experts --------------------------------------------------------------------------------

    def _keys(self, layer: int, ids: Sequence[object]) -> tuple[MoELayer, list[Key]]:
        moe = self.layout.layer(layer)
        keys = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int | np.integer):
                raise InvalidRequestError(f"expert ids must be ints, got {i!r}")
            i = int(i)
            if i == -1:
                continue
            if not 0 <= i < moe.n_experts:
                raise InvalidRequestError(
                    f"layer {moe.index} has experts 0..{moe.n_experts - 1}; expert {i} does not exist"
                )
            keys.append((moe.index, i))
        return moe, keys

    def _view(self, entry: Entry | PinnedExpert) -> ExpertView:
        if isinstance(entry, PinnedExpert):
            assert self._shards is not None
            loc = entry.location
            views = [
                ProjectionView(self._shards.view(seg.shard, seg.offset, seg.n_bytes), seg.ggml_type, seg.shape)
                for seg in loc.segments
            ]
            return ExpertView(loc.layer, loc.expert, loc.bank, *views)
        plan = entry.plan
        assert isinstance(plan, ExpertPlan)
        loc = plan.location
        exporters = entry.exporters
        if exporters is None:  # once per expert in its slot: each request only makes fresh views
            slab = self._slab
            assert slab is not None
            exporters = entry.exporters = tuple(
                slab.exporter(entry.slot, off, seg.n_bytes, held_refs=1)
                for off, seg in zip(plan.payload_offsets, loc.segments, strict=True)
            )
        gate, up, down = loc.segments
        return ExpertView(
            loc.layer,
            loc.expert,
            loc.bank,
            ProjectionView(exported_view(exporters[0]), gate.ggml_type, gate.shape),  # type: ignore[arg-type]
            ProjectionView(exported_view(exporters[1]), up.ggml_type, up.shape),  # type: ignore[arg-type]
            ProjectionView(exported_view(exporters[2]), down.ggml_type, down.shape),  # type: ignore[arg-type]
        )

    @asynccontextmanager
    async def experts(
        self, layer: int, ids: Iterable[int], *, wait: bool | None = None, prefetch: Iterable[Key] = ()
    ) -> AsyncIterator[list[ExpertView | None]]:
        """Pin experts of one layer and give zero-copy views of their raw bytes.

        ``async with store.experts(layer, ids) as views:`` -- ``views[i]`` describes ``ids[i]``
        (``None`` for the inactive id ``-1``); its ``gate``/``up``/``down`` ``data`` are
        read-only memoryviews into slot memory, identical to a plain ``pread`` of the file. The
        slots stay pinned inside the block; on exit the views are released (a view still exported
        to, e.g., a numpy array stays readable but may be overwritten once the slot is reused).

        Args:
            layer: block index of a MoE layer.
            ids: global expert ids (duplicates allowed; ``-1`` = inactive).
            wait: wait for a free slot instead of raising ``SlabExhaustedError``
                (default: ``CacheOptions.wait_for_slots``).
            prefetch: ``(layer, expert)`` keys to start loading right after ``ids`` are pinned
                and before waiting for them (so they cannot evict what this call needs), as
                :meth:`prefetch` does.

        Raises:
            InvalidRequestError: no such layer or expert, or a non-int id (the store stays usable).
            SlabExhaustedError: the slab is too small for this request right now (with ``wait``:
                more experts than slots, or the task already holds pins and would have to wait).
            SlotTimeoutError: no slot within ``CacheOptions.slot_timeout``.
            ExpertReadError: a read failed (cause attached); the store stays usable.
            StoreClosedError: the store is closed.

        Cancellation handling:
            Cancelling while waiting unpins everything this call pinned; reads already submitted
            complete in the background and their slots stay LOADING until then.
        """
        cache = self._running_cache()
        try:
            ids = list(ids)  # iterated twice below: accept generators and other one-shot iterables
        except TypeError:
            raise InvalidRequestError(f"ids must be an iterable of expert ids, got {ids!r}") from None
        moe, keys = self._keys(layer, ids)
        prefetch_keys = _checked_keys(prefetch, "prefetch")
        if wait is not None and not isinstance(wait, bool):
            raise InvalidRequestError(f"wait must be True, False or None, got {wait!r}")
        if wait is None:
            wait = self.cache_options.wait_for_slots

        def start_prefetch() -> None:
            if prefetch_keys:
                cache.prefetch(prefetch_keys)

        entries: Sequence[Entry | PinnedExpert] = await cache.acquire(
            keys, wait=wait, after_pin=start_prefetch, slot_timeout=self.cache_options.slot_timeout if wait else None
        )
        by_key = {e.key: self._view(e) for e in entries}
        views = [None if int(i) == -1 else by_key[(moe.index, int(i))] for i in ids]
        try:
            yield views
        finally:
            try:
                for view in by_key.values():
                    view.release()  # warns when the host still uses the bytes: an error under -W error
            finally:
                cache.release(entries)  # type: ignore[arg-type]

    def prefetch(self, keys: Iterable[Key]) -> int:
        """Start loading ``(layer, expert)`` keys that are not cached, without waiting.

        Never evicts a pinned or loading expert, nor any expert of a layer it is prefetching
        for; stops quietly when no slot is left.

        Returns:
            The number of loads started.

        Raises:
            InvalidRequestError: a key the model does not have (nothing was started).
            StoreClosedError: the store is closed.
        """
        return self._running_cache().prefetch(_checked_keys(keys, "keys"))

    def drop_prefetches(self, keep: Callable[[Key], bool] = lambda key: False) -> int:
        """Forget prefetches still queued (not submitted) whose key ``keep`` rejects.

        Returns:
            The number dropped; their slots are free again.

        Raises:
            StoreClosedError: the store is closed.
        """
        if not callable(keep):
            raise InvalidRequestError(f"keep must be a callable (layer, expert) -> bool, got {keep!r}")
        return self._running_cache().drop_prefetches(keep)

    # -- rows -----------------------------------------------------------------------------------

    async def _row_reader(self) -> RowReader:
        self._check_running()
        async with self._rows_lock:
            if self._rows is None and self._rows_built is None:
                assert self._model is not None and self._files is not None and self._loop is not None
                io, model, files, loop = self.io_options, self._model, self._files, self._loop
                await self._build(
                    "_rows_built",
                    lambda: RowReader(
                        model,
                        files,
                        loop,
                        io.backend,
                        io.backend_options(),
                        io.queue_depth,
                        io.max_bytes_in_flight,
                        self.cache_options.row_cache_bytes,
                    ),
                )
            if self._rows is None and self._rows_built is not None:
                self._rows_built.backend.attach()
                self._rows, self._rows_built = self._rows_built, None
            self._check_running()
            assert self._rows is not None
            return self._rows

    @asynccontextmanager
    async def rows(self, tensor: str, row_ids: Iterable[int]) -> AsyncIterator[RowsView]:
        """Pin rows of a 2-D tensor and give zero-copy views of their raw bytes.

        ``async with store.rows("token_embd.weight", ids) as rows:`` -- ``rows.data[i]`` is the raw
        ggml bytes of row ``ids[i]`` (``rows.row_bytes`` bytes, a read-only memoryview equal to a
        plain ``pread``), valid inside the block; ``rows.dequantize()`` gives float32
        ``(len(ids), n_cols)``. For tables too large to keep in memory that are read a few rows per
        token (token embeddings of large vocabularies, per-layer embedding tables). The rows are read
        by aligned direct reads of whole windows of about one alignment unit (rows that share a
        window are read once; every read of one call goes out in one submission) into a small row
        cache of their own (``CacheOptions.row_cache_bytes``), LRU-evicted. In page-cache mode
        the views point into the model's mapping.

        Args:
            tensor: a 2-D tensor's GGUF name.
            row_ids: row indices (duplicates allowed).

        Raises:
            InvalidRequestError: no such tensor, not 2-D, or a row out of range.
            SlabExhaustedError: the rows span more windows than the row cache holds.
            ExpertReadError: a read failed (cause attached).
            StoreClosedError: the store is closed.

        Cancellation handling:
            As :meth:`experts`.
        """
        try:
            ids = list(row_ids)
        except TypeError:
            raise InvalidRequestError(f"row_ids must be an iterable of row indices, got {row_ids!r}") from None
        if self._shards is not None:  # page-cache mode: straight from the mapping
            self._check_running()
            info = self.model.tensors.get(tensor) if isinstance(tensor, str) else None
            if info is None:
                raise InvalidRequestError(f"the model has no tensor {tensor!r}")
            table = RowTable.of(0, info, 4096, self._shards.sizes[info.shard])
            rows = RowReader.check_rows(table, ids)
            assert self._files is not None
            size = os.fstat(self._files.fds[info.shard]).st_size  # past the end, the mapping raises SIGBUS
            if rows and table.row_offset(max(rows)) + table.row_bytes > size:
                raise ExpertReadError(f"{info.name}: the file ends at byte {size}, before row {max(rows)} (it shrank)")
            views = tuple(
                self._shards.view(info.shard, info.data_offset + r * table.row_bytes, table.row_bytes) for r in rows
            )
            qtype = GGMLQuantizationType(info.ggml_type)
            view = RowsView(info.name, qtype, int(info.shape[1]), table.row_bytes, tuple(rows), views)
            try:
                yield view
            finally:
                for data in views:
                    release_view(data)
            return
        reader = await self._row_reader()
        table = reader.table(tensor)
        entries, view = await reader.acquire(table, reader.check_rows(table, ids))
        try:
            yield view
        finally:
            exported = reader.release(entries, view)
            if exported:
                warnings.warn(
                    f"{tensor}: rows {exported[:8]} are still exported (e.g. by np.frombuffer) as they are "
                    "unpinned; their slot may be reused under them: copy them inside the block",
                    ResourceWarning,
                    stacklevel=3,
                )

    async def read_rows(self, tensor: str, row_ids: Iterable[int], *, dequantize: bool = True) -> np.ndarray:
        """Rows of a 2-D tensor as an array of their own (see :meth:`rows`).

        Returns:
            float32 ``(n_rows, n_cols)`` (``dequantize``, bit-exact with ``gguf.quants.dequantize``),
            or uint8 ``(n_rows, row_bytes)`` raw ggml bytes; the conversion runs in a worker thread.

        Raises:
            As :meth:`rows`.
        """
        async with self.rows(tensor, row_ids) as rows:
            convert = rows.dequantize if dequantize else rows.copy_bytes
            return await anyio.to_thread.run_sync(convert)

    def row_statistics(self) -> RowStatistics | None:
        """The row reads' counters, or None before the first :meth:`rows` call (page-cache mode: None)."""
        return None if self._rows is None else self._rows.statistics()

    def __repr__(self) -> str:
        running = self._cache is not None or self._pagecache is not None
        state = "closed" if self._closed else "running" if running else "not started"
        return f"<aioexperts.ExpertStore {self.path!r} {state}>"


def _checked_keys(keys: object, name: str) -> list[Key]:
    """``keys`` as a list of ``(layer, expert)`` int pairs, or InvalidRequestError."""
    try:
        items = list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidRequestError(f"{name} must be an iterable of (layer, expert) pairs, got {keys!r}") from None
    out = []
    for key in items:
        if (
            not isinstance(key, tuple)
            or len(key) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in key)
        ):
            raise InvalidRequestError(f"{name} must hold (layer, expert) pairs of ints, got {key!r}")
        out.append((int(key[0]), int(key[1])))
    return out


async def _finish_in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, run to its end: what it builds is never lost to a cancellation.

    Cancellation handling:
        A cancellation that arrives while ``fn`` runs (a plain asyncio ``Task.cancel()`` or a
        ``wait_for`` timeout included: anyio does not shield those) is held until ``fn`` has
        returned, then raised; ``fn`` keeps what it opens on the store, which releases it. A
        cancellation before the thread took ``fn`` means it never runs.
    """
    lock = threading.Lock()
    state = ["queued"]  # -> "running" in the worker, or -> "abandoned" here
    done = threading.Event()

    def call() -> T | None:
        with lock:
            if state[0] == "abandoned":
                return None
            state[0] = "running"
        try:
            return fn()
        finally:
            done.set()

    try:
        return await anyio.to_thread.run_sync(call)  # type: ignore[arg-type]  # None only when abandoned
    except anyio.get_cancelled_exc_class():
        with lock:
            if state[0] == "queued":
                state[0] = "abandoned"
                raise
        await wait_through_cancellation(lambda: anyio.to_thread.run_sync(done.wait))  # a second cancel too
        raise


class _Release:
    """The release of a store's resources, running in a thread of its own (ring exit and munmap block).

    Attributes:
        done: set once the release has finished, successfully or not.
        failure: what it raised, or None.
    """

    def __init__(self, release: Callable[[], None]) -> None:
        self.done = threading.Event()
        self.failure: BaseException | None = None
        threading.Thread(target=self._run, args=(release,), name="aioexperts-close").start()

    def _run(self, release: Callable[[], None]) -> None:
        try:
            release()
        except BaseException as exc:  # raised on the loop by aclose()
            self.failure = exc
        finally:
            self.done.set()
