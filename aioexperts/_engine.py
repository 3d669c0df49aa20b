"""The engine: the public object that composes model, layout, slab, backend, scheduler and cache."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any

import anyio
import numpy as np

from ._cache.cache import Entry, ExpertCache, Key
from ._cache.eviction import EvictionPolicy, make_policy
from ._cache.scheduler import ReadScheduler
from ._cache.stats import Counters, EngineStatistics
from ._errors import ConfigError, EngineClosedError, InvalidRequestError
from ._format.expert_map import check_map_matches_layout, read_expert_map
from ._format.layout import ExpertLayout, build_layout
from ._format.model import GGUFModel, open_model
from ._format.views import ExpertView, ProjectionView
from ._io.backends.base import IOBackend
from ._io.files import ShardFiles, open_shards
from ._io.loop import LoopAdapter, current_loop
from ._io.plan import ExpertPlan, max_plan_bytes, plan_expert
from ._io.select import BackendFactory, create_backend
from ._io.slab import Slab

__all__ = ("DEFAULT_CACHE_BYTES", "Engine", "open")

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_QUEUE_DEPTH = 64
DEFAULT_MAX_BYTES_IN_FLIGHT = 256 << 20


def open(  # noqa: A001 - mirrors the builtin on purpose: aioexperts.open(path)
    path: str | os.PathLike[str],
    *,
    slots: int | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    backend: str | BackendFactory = "auto",
    direct_io: bool | None = None,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
    policy: str | EvictionPolicy = "lru",
    wait_for_slots: bool = False,
    expert_map: str | os.PathLike[str] | None = None,
    hugepages: bool = False,
    lock_memory: bool = False,
    fixed_buffers: bool = True,
    sqe_async: bool = False,
    n_threads: int | None = None,
) -> Engine:
    """Prepare an engine for the GGUF model at ``path``; start it with ``async with``.

    Example::

        async with aioexperts.open("model.gguf", slots=256) as engine:
            async with engine.experts(layer=3, ids=[5, 17]) as views:
                gate_bytes = views[0].gate.data

    Args:
        path: a ``.gguf`` file, or any shard of a split set ``NAME-0000k-of-0000n.gguf``.
        slots: slab slots, each holding one expert. Default: as many as fit in ``cache_bytes``,
            at least ``2 * expert_used_count`` and at most every expert of the model.
        cache_bytes: slab size in bytes used when ``slots`` is None (default 1 GiB).
        backend: ``"auto"`` (io_uring, else a thread pool, with one log line saying why),
            ``"io_uring"``, ``"threads"``, or a factory ``(files, slab, loop, depth) -> IOBackend``.
        direct_io: True to require ``O_DIRECT``, False for buffered reads, None to use
            ``O_DIRECT`` where a probe read works.
        queue_depth: reads in flight at most (the io_uring ring size).
        max_bytes_in_flight: requested bytes in flight at most (one expert always fits).
        policy: eviction policy name (``"lru"``, ``"lfu"``, ``"lfuda"``) or an instance.
        wait_for_slots: when every slot is pinned, wait for one instead of raising
            ``SlabExhaustedError``.
        expert_map: a ``WEEPF001`` map to check against the model (refused if stale).
        hugepages: advise transparent huge pages for the slab.
        lock_memory: ``mlock`` the slab.
        fixed_buffers: register the slab with io_uring (``READV_FIXED``) where allowed.
        sqe_async: io_uring ``IOSQE_ASYNC`` (submit returns at once; kernel workers issue reads).
        n_threads: worker threads of the thread backend.

    Raises:
        ConfigError: an argument is out of range (raised here, before any I/O).
    """
    if slots is not None and slots < 1:
        raise ConfigError(f"slots must be >= 1, got {slots}")
    if cache_bytes < 1:
        raise ConfigError(f"cache_bytes must be >= 1, got {cache_bytes}")
    if not 1 <= queue_depth <= 4096:
        raise ConfigError(f"queue_depth must be in 1..4096, got {queue_depth}")
    if max_bytes_in_flight < 1:
        raise ConfigError(f"max_bytes_in_flight must be >= 1, got {max_bytes_in_flight}")
    eviction = make_policy(policy) if isinstance(policy, str) else policy
    options: dict[str, Any] = {"fixed_buffers": fixed_buffers, "sqe_async": sqe_async}
    if n_threads is not None:
        options["n_threads"] = n_threads
    return Engine(
        os.fspath(path),
        slots=slots,
        cache_bytes=cache_bytes,
        backend=backend,
        direct_io=direct_io,
        queue_depth=queue_depth,
        max_bytes_in_flight=max_bytes_in_flight,
        policy=eviction,
        wait_for_slots=wait_for_slots,
        expert_map=None if expert_map is None else os.fspath(expert_map),
        hugepages=hugepages,
        lock_memory=lock_memory,
        backend_options=options,
    )


class Engine:
    """Streams the routed experts of one model into a slab of slots. Create it with :func:`open`.

    Use it from one event loop (asyncio, uvloop or trio) and one thread. ``async with`` starts it
    and closes it; :meth:`start` and :meth:`aclose` do the same by hand.
    """

    def __init__(
        self,
        path: str,
        *,
        slots: int | None,
        cache_bytes: int,
        backend: str | BackendFactory,
        direct_io: bool | None,
        queue_depth: int,
        max_bytes_in_flight: int,
        policy: EvictionPolicy,
        wait_for_slots: bool,
        expert_map: str | None,
        hugepages: bool,
        lock_memory: bool,
        backend_options: dict[str, Any],
    ) -> None:
        self.path = path
        self._slots_arg = slots
        self._cache_bytes = cache_bytes
        self._backend_arg = backend
        self._direct_io_arg = direct_io
        self._queue_depth = queue_depth
        self._max_bytes_in_flight = max_bytes_in_flight
        self._policy = policy
        self.wait_for_slots = wait_for_slots
        self._expert_map = expert_map
        self._hugepages = hugepages
        self._lock_memory = lock_memory
        self._backend_options = backend_options
        self._started = False
        self._closed = False
        self.counters = Counters()
        self._model: GGUFModel | None = None
        self._layout: ExpertLayout | None = None
        self._files: ShardFiles | None = None
        self._slab: Slab | None = None
        self._backend: IOBackend | None = None
        self._fallback_reason: str | None = None
        self._loop: LoopAdapter | None = None
        self._scheduler: ReadScheduler | None = None
        self._cache: ExpertCache | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
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
            ConfigError: a bad argument (e.g. an unknown policy or backend name).
            BackendUnavailableError: a forced backend or ``direct_io=True`` cannot work here.
        """
        if self._started:
            raise ConfigError("the engine was already started")
        self._started = True
        self._loop = loop = current_loop()
        try:
            self._model, self._layout = await anyio.to_thread.run_sync(self._parse)
            self._files = await anyio.to_thread.run_sync(open_shards, self._model, self._direct_io_arg)
            alignment = self._files.alignment
            slot_bytes = await anyio.to_thread.run_sync(max_plan_bytes, self._layout, alignment)
            n_slots = self._n_slots(slot_bytes)
            self._slab = await anyio.to_thread.run_sync(
                lambda: Slab(n_slots, slot_bytes, hugepages=self._hugepages, lock=self._lock_memory)
            )
            self._backend, self._fallback_reason = create_backend(
                self._backend_arg, self._files, self._slab, loop, self._queue_depth, **self._backend_options
            )
            self._scheduler = ReadScheduler(
                self._backend,
                loop,
                self.counters,
                self._files.sizes,
                alignment,
                self._max_bytes_in_flight,
                tuple(s.path for s in self._model.shards),
            )
            self._plan = lru_cache(maxsize=None)(self._make_plan)
            self._cache = ExpertCache(n_slots, self._plan, self._scheduler, self._policy, loop, self.counters)
        except BaseException:
            self._release_resources()
            self._closed = True
            raise

    def _parse(self) -> tuple[GGUFModel, ExpertLayout]:
        model = open_model(self.path)
        layout = build_layout(model)
        if self._expert_map is not None:
            if len(model.shards) != 1:
                raise ConfigError("a WEEPF001 expert map describes one file; this model is a split set")
            emap = read_expert_map(self._expert_map, model.shards[0])
            check_map_matches_layout(emap, layout, self._expert_map)
        return model, layout

    def _n_slots(self, slot_bytes: int) -> int:
        layout = self.layout
        if self._slots_arg is not None:
            return self._slots_arg
        by_budget = self._cache_bytes // slot_bytes
        return max(min(by_budget, layout.n_experts_total), min(2 * layout.n_expert_used, layout.n_experts_total))

    def _make_plan(self, layer: int, expert: int) -> ExpertPlan:
        assert self._files is not None
        return plan_expert(self.layout.locate(layer, expert), self._files.alignment)

    async def aclose(self) -> None:
        """Close the engine: refuse new requests, wait for every read in flight, free everything.

        Idempotent. Waiters of experts not read yet get ``EngineClosedError``.

        Cancellation handling:
            The wait for reads in flight is shielded: memory the kernel may still write into is
            never unmapped, so a cancelled ``aclose`` still finishes before returning.
        """
        if self._closed:
            return
        self._closed = True
        if self._cache is not None:
            self._cache.close()
        if self._scheduler is not None:
            with anyio.CancelScope(shield=True):
                await self._scheduler.wait_no_reads_in_flight()
        self._release_resources()

    def _release_resources(self) -> None:
        if self._backend is not None:
            self._backend.close()
        if self._files is not None:
            self._files.close()
        if self._slab is not None:
            self._slab.close()

    # -- properties -----------------------------------------------------------------------------

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
    def cache(self) -> ExpertCache:
        """The expert cache (for prefetching and inspection)."""
        self._check_running()
        assert self._cache is not None
        return self._cache

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose`."""
        return self._closed

    def _check_started(self) -> None:
        if self._layout is None:
            raise EngineClosedError("the engine is not started: use `async with aioexperts.open(...)`")

    def _check_running(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        self._check_started()

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the counters and the engine's I/O set-up."""
        self._check_started()
        assert self._files is not None and self._slab is not None and self._backend is not None
        assert self._scheduler is not None
        return EngineStatistics.snapshot(
            self.counters,
            backend=self._backend.name,
            direct_io=self._files.direct_io,
            fallback_reason=self._fallback_reason,
            buffered_reason=self._files.buffered_reason,
            backend_features=self._backend.features(),
            n_slots=self._slab.n_slots,
            slot_bytes=self._slab.slot_bytes,
            alignment=self._files.alignment,
            in_flight=self._scheduler.reads_in_flight,
        )

    def reset_statistics(self) -> None:
        """Zero the counters (the cache contents stay)."""
        self.counters.reset()

    # -- experts --------------------------------------------------------------------------------

    def _keys(self, layer: int, ids: Sequence[int]) -> list[Key]:
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
                    f"layer {layer} has experts 0..{moe.n_experts - 1}; expert {i} does not exist"
                )
            keys.append((layer, i))
        return keys

    def _view(self, entry: Entry) -> ExpertView:
        assert self._slab is not None
        loc = entry.plan.location
        projections = [
            ProjectionView(self._slab.view(entry.slot, off, seg.n_bytes), seg.ggml_type, seg.shape)
            for off, seg in zip(entry.plan.payload_offsets, loc.segments, strict=True)
        ]
        return ExpertView(loc.layer, loc.expert, loc.bank, *projections)

    @asynccontextmanager
    async def experts(
        self, layer: int, ids: Sequence[int], *, wait: bool | None = None
    ) -> AsyncIterator[list[ExpertView | None]]:
        """Pin experts of one layer and give zero-copy views of their raw bytes.

        ``async with engine.experts(layer, ids) as views:`` -- ``views[i]`` describes ``ids[i]``
        (``None`` for the inactive id ``-1``); its ``gate``/``up``/``down`` ``data`` are
        read-only memoryviews into slot memory, identical to a plain ``pread`` of the file. The
        slots stay pinned inside the block; on exit the views are released (a view still exported
        to, e.g., a numpy array stays readable but may be overwritten once the slot is reused).

        Args:
            layer: block index of a MoE layer.
            ids: global expert ids (duplicates allowed; ``-1`` = inactive).
            wait: wait for a free slot instead of raising ``SlabExhaustedError``
                (default: the engine's ``wait_for_slots``).

        Raises:
            InvalidRequestError: no such layer or expert, or a non-int id (the engine stays usable).
            SlabExhaustedError: the slab is too small for this request right now.
            ExpertReadError: a read failed (cause attached); the engine stays usable.
            EngineClosedError: the engine is closed.

        Cancellation handling:
            Cancelling while waiting unpins everything this call pinned; reads already submitted
            complete in the background and their slots stay LOADING until then.
        """
        self._check_running()
        keys = self._keys(layer, ids)
        cache = self.cache
        entries = await cache.acquire(keys, wait=self.wait_for_slots if wait is None else wait)
        by_key = {e.key: self._view(e) for e in entries}
        views = [None if int(i) == -1 else by_key[(layer, int(i))] for i in ids]
        try:
            yield views
        finally:
            for view in by_key.values():
                for projection in (view.gate, view.up, view.down):
                    try:
                        projection.data.release()
                    except BufferError:
                        pass
            cache.release(entries)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._cache is not None else "not started"
        return f"<aioexperts.Engine {self.path!r} {state}>"
