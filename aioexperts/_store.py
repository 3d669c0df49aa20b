"""The expert store: a facade over one expert source, behind ``experts()``.

:func:`open` builds an :class:`ExpertStore` over the source of its mode (the slab source,
:mod:`aioexperts._sources.slab`, or the page-cache source, :mod:`aioexperts._sources.mapped`; both
behind :class:`~aioexperts._sources.base.ExpertSource`); ``async with`` starts it (parse, then the
source's set-up: open, probe, map, set up the backend) and closes it. The store keeps the argument
checks, the lifecycle (including holding a cancellation through the release) and the public views.
The store knows nothing about computing: an
:class:`~aioexperts.MoERunner` runs MoE layers on top of it, and hosts with their own kernels use
:meth:`ExpertStore.experts` directly.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import numpy as np
from gguf import GGMLQuantizationType

from ._cache.cache import Key
from ._cache.stats import StoreStatistics
from ._errors import ConfigError, InvalidRequestError, StoreClosedError, UnsupportedTypeError
from ._format.expert_map import check_map_matches_layout, read_expert_map
from ._format.hparams import MoEHParams
from ._format.layout import ExpertLayout, build_layout
from ._format.model import GGUFModel, open_model
from ._format.tier_sidecar import read_tier_sidecar
from ._format.views import ExpertTable, ExpertView
from ._io.loop import LoopAdapter, current_loop, wait_through_cancellation
from ._options import CacheOptions, IOOptions, MissTier, PageCacheOptions
from ._sources.base import ExpertSource, HeldLayers, Pinned, build_and_keep, finish_in_thread
from ._sources.mapped import MappedSource
from ._sources.rows import RowStatistics, RowsView
from ._sources.slab import SlabSource
from ._timeline import Timeline

__all__ = ("MODES", "ExpertStore", "open")

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
    miss_tier: MissTier | None = None,
) -> ExpertStore:
    """Prepare an expert store for the GGUF model at ``path``; start it with ``async with``.

    Example::

        import asyncio
        import aioexperts
        from aioexperts.testing import builtin_model_path

        async def main() -> None:
            async with aioexperts.open(builtin_model_path(), slots=256) as store:
                async with store.experts(layer=0, ids=[0, 1]) as views:
                    gate_bytes = views[0].gate.data

        asyncio.run(main())

    Args:
        path: a ``.gguf`` file, or any shard of a split set ``NAME-0000k-of-0000n.gguf`` (``str``,
            ``bytes`` or path-like; a leading ``~`` is expanded).
        slots: shorthand for ``cache=CacheOptions(slots=...)``.
        cache_bytes: shorthand for ``cache=CacheOptions(bytes=...)`` (slab size in bytes).
        cache: the slab and cache options (size, eviction policy, waiting for slots).
        io: the read options (backend, direct I/O, queue depth).
        expert_map: a ``WEEPF001`` map to check against the model (refused if stale).
        miss_tier: the low-precision miss tier (:class:`~aioexperts.MissTier`; slab mode only):
            its sidecar is checked against the model when the store starts (refused if stale);
            :meth:`ExpertStore.start_loads` reads the ``low_ids`` it is given from it. When the
            slab holds every routed expert at full precision, the tier switches itself off at
            start (one INFO line on the ``aioexperts`` logger; ``statistics().miss_tier_off_reason``).
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
    if miss_tier is not None and not isinstance(miss_tier, MissTier):
        raise ConfigError(f"miss_tier must be a MissTier, got {miss_tier!r}")
    if miss_tier is not None and mode != "slab":
        raise ConfigError("the miss tier needs the slab mode (the page-cache mode reads no slots)")
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
        miss_tier,
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
        miss_tier: the :class:`~aioexperts.MissTier` in force, else None; None also once
            :meth:`start` switched it off because the slab holds every routed expert at full
            precision (``statistics().miss_tier_off_reason`` says so).
    """

    def __init__(
        self,
        path: str,
        cache: CacheOptions,
        io: IOOptions,
        expert_map: str | None,
        include_nextn: bool = False,
        pagecache: PageCacheOptions | None = None,
        miss_tier: MissTier | None = None,
    ) -> None:
        self.path = path
        self.miss_tier = miss_tier
        self._include_nextn = include_nextn
        self.pagecache_options = pagecache
        self.cache_options = cache
        self.io_options = io
        self._expert_map = expert_map
        self._started = False
        self._closed = False
        self._released = False
        self._start_done: anyio.Event | None = None  # set when a running start() has ended
        self._model: GGUFModel | None = None
        self._layout: ExpertLayout | None = None
        self._experts_total = 0  # layout.n_experts_total, once known (model_resident asks per layer step)
        self._hparams: MoEHParams | UnsupportedTypeError | None = None
        self._loop: LoopAdapter | None = None
        self._source: ExpertSource = (
            SlabSource(cache, io, self._check_running) if pagecache is None else MappedSource(pagecache, io.queue_depth)
        )
        self._release: _Release | None = None
        self._key_tables: dict[int, tuple[Key, ...]] = {}  # layer -> its keys, made once

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
            StoreClosedError: :meth:`aclose` was called before or during the start (everything the
                start made is released).
            BackendUnavailableError: a forced backend or ``direct_io=True`` cannot work here.
        """
        if self._started:
            raise ConfigError("the store was already started")
        if self._closed:
            raise StoreClosedError("the store was closed before it started: open a new one")
        self._started = True
        self._loop = loop = current_loop()
        done = self._start_done = anyio.Event()
        try:
            model, layout, hparams = await finish_in_thread(self._parse)
            self._model, self._layout, self._hparams = model, layout, hparams
            await self._source.start(model, layout, loop, build_and_keep)
            if isinstance(self._source, SlabSource) and self._source.tier_off_reason is not None:
                self.miss_tier = None  # nothing below asks which reads go low
            if self._closed:  # aclose() ran meanwhile (another task): it waits for this release
                raise StoreClosedError("the store was closed while it started")
        except BaseException:
            self._release_resources()
            self._closed = True
            raise
        finally:
            done.set()

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
        if self.miss_tier is not None and isinstance(self._source, SlabSource):
            self._source.tier = read_tier_sidecar(self.miss_tier.path, model, layout)
            self._source.tier_policy = self.miss_tier
        return model, layout, hparams

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
        held: BaseException | None = None
        starting = self._start_done
        if starting is not None and not starting.is_set():  # start() runs in another task: it sees the
            # close when its set-up ends and releases what it built; wait for that (never under it)
            held = await wait_through_cancellation(starting.wait, starting.is_set)
            if self._released:
                if held is not None:
                    raise held
                return
        self._source.close()  # nothing queued is submitted any more
        for wait_idle in self._source.idle_waits():
            held = await wait_through_cancellation(wait_idle) or held
        self._source.detach()
        # ring exit and munmap of the slab block: in a thread of their own, waited for to the end.
        # One release at a time: a concurrent aclose() waits for the one running instead of
        # releasing the same ring, descriptors and slab again from a second thread.
        release = self._release
        if release is None or release.done.is_set():  # none yet, or the last one failed: try again
            release = self._release = _Release(self._release_resources)
        wait_release = functools.partial(anyio.to_thread.run_sync, release.done.wait)
        held = await wait_through_cancellation(wait_release, release.done.is_set) or held
        if release.failure is not None:
            raise release.failure
        if held is not None:
            raise held

    def _release_resources(self) -> None:
        """Release what the source opened (rings, mappings, files, slabs), in its order.

        Every part is attempted (each is idempotent), even after one of them raised; the first
        exception is raised once all were tried, and the store counts as released only when none
        raised (a later :meth:`aclose` tries the rest again).
        """
        failures: list[BaseException] = []
        for part in self._source.release_parts():
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
    def miss_tier_type(self) -> GGMLQuantizationType | None:
        """The ggml type of the miss tier's experts (``Q2_K``, ``Q3_K`` or ``IQ4_XS``) while the tier
        is on; None without one, or when start switched it off (``statistics().miss_tier_off_reason``)."""
        self._check_started()
        tier = self._source.tier if isinstance(self._source, SlabSource) else None
        return None if tier is None else tier.ggml_type

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
        return self._source.n_slots

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose` (or a failed :meth:`start`)."""
        return self._closed

    def _check_started(self) -> None:
        if self._layout is None:
            raise StoreClosedError("the store is not started: use `async with aioexperts.open(...)`")

    def check_running(self) -> None:
        """Raise unless the store is started, open and used from its own event loop.

        Raises:
            StoreClosedError: the store is closed or not started.
            ConfigError: called from another event loop than the one the store was started in.
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        self._check_started()
        if self._loop is not None and not self._loop.is_current():
            raise ConfigError(
                "the store is used from another event loop than the one it was started in; "
                "open one store per event loop"
            )

    _check_running = check_running

    def _running_source(self) -> ExpertSource:
        self.check_running()
        return self._source

    # -- statistics -----------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        """A frozen snapshot of the counters and the store's I/O set-up."""
        self._check_started()
        return self._source.statistics()

    def reset_statistics(self) -> None:
        """Zero the counters (the cache contents stay)."""
        self._source.reset_statistics()

    def record_timeline(self, timeline: Timeline | None) -> bool:
        """Record every expert load from now on into ``timeline`` (an :class:`aioexperts.Timeline`:
        the layer and expert, bytes, and when it was queued, submitted to the backend and completed;
        a load that failed is not recorded); None stops. :meth:`aioexperts.MoERunner.record_timeline`
        calls this with the runner's layer steps.

        Returns:
            True when loads will be recorded; False in page-cache mode (it reads into no slot).

        Raises:
            ConfigError: ``timeline`` is not a Timeline or None.
            StoreClosedError: the store is closed or not started.
        """
        if timeline is not None and not isinstance(timeline, Timeline):
            raise ConfigError(f"timeline must be an aioexperts.Timeline or None, got {timeline!r}")
        return self._running_source().record_timeline(timeline)

    # -- experts --------------------------------------------------------------------------------

    def _layer_keys(self, layer: int) -> tuple[Key, ...]:
        """Every key of MoE layer ``layer``, expert by expert (made once per layer: a hit allocates no key).

        Raises:
            InvalidRequestError: no such layer.
        """
        table = self._key_tables.get(layer) if type(layer) is int else None
        if table is None:
            moe = self.layout.layer(layer)
            table = self._key_tables[moe.index] = _key_table(moe.index, moe.n_experts)
        return table

    def _request_keys(self, layer: int, ids: Sequence[object]) -> tuple[list[Key], list[int] | None]:
        """The unique keys of ``ids`` in first-seen order, and where each id's view is among them.

        Returns:
            ``(keys, None)`` when the ids are distinct and active (``views[i]`` is ``ids[i]``'s),
            else ``(keys, positions)`` with the index into ``keys`` of each id, ``-1`` for ``-1``.

        Raises:
            InvalidRequestError: no such layer or expert, or an id that is not an int.
        """
        table = self._layer_keys(layer)
        n = len(table)
        keys: list[Key] = []
        inactive = False
        for i in ids:
            if type(i) is not int:
                if isinstance(i, bool) or not isinstance(i, int | np.integer):
                    raise InvalidRequestError(f"expert ids must be ints, got {i!r}")
                i = int(i)
            if 0 <= i < n:
                keys.append(table[i])
            elif i == -1:
                inactive = True
            else:
                raise InvalidRequestError(
                    f"layer {table[0][0] if n else layer} has experts 0..{n - 1}; expert {i} does not exist"
                )
        if not inactive and (len(keys) < 2 or len(set(keys)) == len(keys)):
            return keys, None
        unique = list(dict.fromkeys(keys))
        index = {key: k for k, key in enumerate(unique)}
        it = iter(keys)
        positions = [-1 if int(i) == -1 else index[next(it)] for i in ids]  # type: ignore[call-overload]
        return unique, positions

    def experts(
        self, layer: int, ids: Iterable[int], *, wait: bool | None = None, prefetch: Iterable[Key] = ()
    ) -> AbstractAsyncContextManager[list[ExpertView | None]]:
        """Pin experts of one layer and give zero-copy views of their raw bytes.

        ``async with store.experts(layer, ids) as views:`` -- ``views[i]`` describes ``ids[i]``
        (``None`` for the inactive id ``-1``); its ``gate``/``up``/``down`` ``data`` are
        read-only memoryviews into slot memory, identical to a plain ``pread`` of the file. The
        slots stay pinned inside the block. In slab mode the views of an expert are made once per
        slot load and shared by every request that pins it (a warm hit builds none): after the
        block they stay readable until the slot is reused for another expert, then they are
        released (using one raises ``ValueError``); an array made from them (``np.frombuffer``)
        cannot be released and reads whatever the slot holds next, so keep bytes past the block
        with ``ExpertView.copy()``. In page-cache mode the views are released on exit.

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
            All raised when the block is entered.

        Warns:
            ResourceWarning: as the last pin of an expert ends, an array made from its views
                (``np.frombuffer``) is still alive (an error under ``-W error``).

        Cancellation handling:
            Cancelling while waiting unpins everything this call pinned; reads already submitted
            complete in the background and their slots stay LOADING until then.
        """
        return _ExpertsBlock(self, layer, ids, wait, prefetch)

    def prefetch(self, keys: Iterable[Key], *, low: Iterable[Key] = ()) -> int:
        """Start loading ``(layer, expert)`` keys that are not cached, without waiting.

        Never evicts a pinned or loading expert, nor any expert of a layer it is prefetching
        for; stops quietly when no slot is left. The keys of ``low`` (of ``keys``) that are not
        cached are read from the miss tier (ignored without a :class:`~aioexperts.MissTier`).

        Returns:
            The number of loads started.

        Raises:
            InvalidRequestError: a key the model does not have (nothing was started).
            StoreClosedError: the store is closed.
        """
        source = self._running_source()
        checked = _checked_keys(keys, "keys")
        low_keys = _checked_keys(low, "low") if self.miss_tier is not None else []
        return source.prefetch(checked, low_keys) if low_keys else source.prefetch(checked)

    def start_loads(
        self,
        layer: int,
        ids: Iterable[int],
        *,
        prefetch: Iterable[Key] = (),
        low_ids: Iterable[int] = (),
        low_prefetch: Iterable[Key] = (),
        speculative: Iterable[Key] = (),
    ) -> int:
        """Start reading experts a request is about to pin, and its prefetch, submitted at once.

        For a caller that knows a layer's experts before it can pin them all (the runner starts
        a layer's misses the moment its routing is known, then computes the resident experts):
        the experts of ``ids`` that are not cached are read as demand loads (ahead of every
        prefetch), then the ``prefetch`` keys as prefetches, and the reads are submitted in this
        call rather than at the end of the loop tick, so a compute job started right after cannot
        delay them. Never waits; stops quietly when no slot is left (the later
        :meth:`experts` call loads the rest). Never evicts an expert of ``ids`` (the cached ones
        stay for the request), a pinned or loading expert, nor (for the prefetch) an expert of a
        layer in ``prefetch``. The :meth:`experts` call that pins an expert started here counts
        it as a miss. The page-cache mode prefetches both.

        Args:
            layer: block index of a MoE layer.
            ids: every expert the request will pin (global ids, ``-1`` = inactive, duplicates
                allowed); the cached ones are not read.
            prefetch: ``(layer, expert)`` keys to load after them.
            low_ids: of ``ids``, the experts to read from the miss tier if they are not cached
                (ignored without a :class:`~aioexperts.MissTier`); a cached one is used as it is.
            low_prefetch: of ``prefetch`` and ``speculative``, the keys to read from the miss
                tier if they are not cached (ignored without a :class:`~aioexperts.MissTier`).
            speculative: ``(layer, expert)`` keys predicted further ahead, read only while the
                device would otherwise sit idle (nothing else queued, a few reads in flight); one
                asked for later as a prefetch or an expert of ``ids`` moves up to that queue. The
                page-cache mode ignores them.

        Returns:
            The number of loads started.

        Raises:
            InvalidRequestError: no such layer or expert, or a non-int id (nothing started).
            StoreClosedError: the store is closed.
        """
        source = self._running_source()
        keys = self._request_keys(layer, _id_list(ids, "ids"))[0]  # unique, the layer's shared keys
        low = _id_list(low_ids, "low_ids")
        low_keys = self._request_keys(layer, low)[0] if low and self.miss_tier is not None else []
        low_ahead = _checked_keys(low_prefetch, "low_prefetch") if self.miss_tier is not None else []
        further = _checked_keys(speculative, "speculative") if speculative else []
        return source.start_loads(keys, _checked_keys(prefetch, "prefetch"), low_keys, low_ahead, further)

    def read_backlog_seconds(self) -> float | None:
        """Seconds the reads queued and in flight would take at the device rate measured so far:
        how far the reads are behind (None before the first read completed, and in page-cache mode).

        Raises:
            StoreClosedError: the store is closed.
        """
        return self._running_source().read_backlog_seconds()

    def resident(self, layer: int, ids: Iterable[int]) -> list[bool]:
        """Which of ``ids`` (experts of ``layer``) are in memory now: pinning them waits for no read.

        A snapshot for scheduling (the runner computes these experts first while the others are
        read); an expert may be evicted right after. The page-cache mode answers False.

        Raises:
            InvalidRequestError: no such layer or expert, or a non-int id.
            StoreClosedError: the store is closed.
        """
        source = self._running_source()
        keys, positions = self._request_keys(layer, _id_list(ids, "ids"))  # the layer's shared keys: none made here
        ready = source.ready(keys)  # one call for the lot, not one chain of calls per expert
        if positions is None:
            return ready
        return [p >= 0 and ready[p] for p in positions]

    @contextmanager
    def hold_resident(self) -> Iterator[ResidentExperts | None]:
        """Hold the resident experts in memory without pins, when the slab has room for every routed
        expert of the model (it never evicts).

        ``with store.hold_resident() as held:`` -- ``held`` is a :class:`ResidentExperts`, or None
        when the slab may have to evict (it is smaller than the model) or in page-cache mode. While
        the block lasts no expert is evicted and no slot is reused (an upgrade of a low-tier copy evicts nothing; reads
        into free slots go on), so a compute thread may use :meth:`ResidentExperts.views` with no
        pin and no await: the decode pass of a model that fits runs its layers in one compute job
        this way, as long as the experts it routes to are resident. Enter and leave it on the event
        loop.

        Raises:
            StoreClosedError: the store is closed.
        """
        source = self._running_source()
        held = source.hold_resident(self.layout.n_experts_total)
        if held is None:
            yield None
            return
        resident = ResidentExperts(self, held)
        try:
            yield resident
        finally:
            held.end(resident.requests)

    def layer_resident(self, layer: int) -> bool:
        """Whether every expert of MoE layer ``layer`` is in memory at full precision now (a
        snapshot the router reads from a compute-pool thread: it predicts no experts for such a
        layer, since no read could help). False before start, after close and in page-cache mode.

        Raises:
            InvalidRequestError: no such MoE layer.
        """
        if self.closed or not self._source.started:
            return False
        moe = self.layout.layer(layer)
        return self._source.layer_ready(moe.index, moe.n_experts)

    def model_resident(self) -> bool:
        """Whether every routed expert of the model is in memory at full precision now (every
        :meth:`layer_resident`, in one call: the router asks once per layer step). False before
        start, after close and in page-cache mode."""
        if self.closed or not self._source.started:
            return False
        total = self._experts_total
        if not total:
            total = self._experts_total = self.layout.n_experts_total
        return self._source.model_ready(total)

    def drop_prefetches(self, keep: Callable[[Key], bool] = lambda key: False) -> int:
        """Forget prefetches still queued (not submitted) whose key ``keep`` rejects.

        Returns:
            The number dropped; their slots are free again.

        Raises:
            StoreClosedError: the store is closed.
        """
        if not callable(keep):
            raise InvalidRequestError(f"keep must be a callable (layer, expert) -> bool, got {keep!r}")
        return self._running_source().drop_prefetches(keep)

    # -- rows -----------------------------------------------------------------------------------

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
        source = self._running_source()
        async with source.rows(tensor, ids) as view:
            yield view

    async def read_rows(self, tensor: str, row_ids: Iterable[int], *, dequantize: bool = True) -> np.ndarray:
        """Rows of a 2-D tensor as an array of their own (see :meth:`rows`).

        Returns:
            float32 ``(n_rows, n_cols)`` (``dequantize``, bit-exact with ``gguf.quants.dequantize``),
            or uint8 ``(n_rows, row_bytes)`` raw ggml bytes; the conversion runs in a worker thread.

        Raises:
            As :meth:`rows`.

        Cancellation handling:
            A cancellation that arrives while the worker thread converts (a plain asyncio
            ``Task.cancel()`` or a ``wait_for`` timeout included) is held until the thread is done
            with the rows, then raised; the rows stay pinned until then.
        """
        async with self.rows(tensor, row_ids) as rows:
            convert = rows.dequantize if dequantize else rows.copy_bytes
            return await finish_in_thread(convert)

    def row_statistics(self) -> RowStatistics | None:
        """The row reads' counters, or None before the first :meth:`rows` call (page-cache mode: None)."""
        return self._source.row_statistics()

    def __repr__(self) -> str:
        running = self._source.started
        state = "closed" if self._closed else "running" if running else "not started"
        return f"<aioexperts.ExpertStore {self.path!r} {state}>"


class ResidentExperts:
    """The experts of a model held in memory by :meth:`ExpertStore.hold_resident` (no pins).

    :meth:`views` may be called from a compute thread while the hold lasts; the views are those
    :meth:`ExpertStore.experts` gives and stay valid until the hold ends.

    Attributes:
        requests: experts served so far (counted as cached hits in the store's statistics when the
            hold ends).
    """

    __slots__ = ("_held", "_store", "requests")

    def __init__(self, store: ExpertStore, held: HeldLayers) -> None:
        self._store = store
        self._held = held
        self.requests = 0

    def views(self, layer: int, ids: Sequence[int]) -> list[ExpertView] | None:
        """Views of the experts ``ids`` (distinct, active) of MoE layer ``layer``, in that order, or
        None when one of them is not resident at full precision (not read yet, loading, low tier).

        Raises:
            InvalidRequestError: no such layer or expert, or an id that is not an int (a bool, a
                float, a string).
            RuntimeError: the hold has ended.
            StoreClosedError: the store closed during the hold.
        """
        table = self._store._layer_keys(layer)
        n = len(table)
        view = self._held.view
        out = []
        for i in _id_list(ids, "ids"):
            if isinstance(i, bool) or not isinstance(i, int | np.integer):
                raise InvalidRequestError(f"expert ids must be ints, got {i!r}")
            if not 0 <= i < n:
                raise InvalidRequestError(f"layer {layer} has experts 0..{n - 1}; expert {i} does not exist")
            v = view(table[i])
            if v is None:
                return None
            out.append(v)
        self.requests += len(out)
        return out

    def table(self, layer: int) -> ExpertTable | None:
        """Where every expert of MoE layer ``layer`` lies (:class:`~aioexperts._format.views.ExpertTable`:
        ``(3, n_experts)`` int64 addresses of each expert's gate, up and down, valid while the hold
        lasts) when all are resident at full precision with one layout, else None. Kept by the
        source until one of the layer's experts is loaded or leaves its slot
        (``ExpertCache.placements(layer)``), so a decode step looks its experts up with one array
        index instead of a view each; the table keeps the slab mapped while it lives, as views
        do. Experts computed from it are counted by adding them to :attr:`requests`.

        Raises:
            InvalidRequestError: no such layer.
            RuntimeError: the hold has ended.
            StoreClosedError: the store closed during the hold.
        """
        return self._held.table(self._store._layer_keys(layer))


class _ExpertsBlock:
    """The ``async with`` of :meth:`ExpertStore.experts`: pins on entry, unpins on exit.

    A class rather than an async generator: a warm hit then costs no generator and no asyncgen
    hooks of the loop, one checkpoint (a cancelled task stops there; other tasks run) and a pin of
    every expert at once (:meth:`ExpertSource.pin_ready`).
    """

    __slots__ = (
        "_entered",
        "_entries",
        "_ids",
        "_layer",
        "_owner",
        "_prefetch",
        "_source",
        "_store",
        "_views",
        "_wait",
    )

    def __init__(self, store: ExpertStore, layer: int, ids: Iterable[int], wait: bool | None, prefetch: object) -> None:
        self._store = store
        self._layer = layer
        self._ids = ids
        self._wait = wait
        self._prefetch = prefetch
        self._entered = False
        self._source: ExpertSource | None = None
        self._entries: Sequence[Pinned] = ()
        self._views: list[ExpertView] = []
        self._owner: object = None  # the task that pinned (the exit may run in another one)

    async def __aenter__(self) -> list[ExpertView | None]:
        if self._entered:
            raise RuntimeError("an experts() block can be entered once; call store.experts() again")
        self._entered = True
        store = self._store
        source = store._running_source()
        ids = _id_list(self._ids, "ids")  # iterated twice below: accept generators and other one-shot iterables
        keys, positions = store._request_keys(self._layer, ids)
        prefetch = self._prefetch
        prefetch_keys = [] if type(prefetch) in (tuple, list) and not prefetch else _checked_keys(prefetch, "prefetch")
        wait = self._wait
        if wait is not None and not isinstance(wait, bool):
            raise InvalidRequestError(f"wait must be True, False or None, got {wait!r}")
        entries = source.pin_ready(keys)
        if entries is not None:
            # every expert resident: still a checkpoint (a cancelled task stops here, a loop of warm
            # hits lets the other tasks run), after the pins (what the caller queued before, such
            # as prefetches, is not submitted ahead of these requests)
            try:
                await anyio.lowlevel.checkpoint()
                store._running_source()  # StoreClosedError if the store closed meanwhile
            except BaseException:
                source.release(entries)
                raise
        else:
            if wait is None:
                wait = store.cache_options.wait_for_slots

            def start_prefetch() -> None:
                if prefetch_keys:
                    source.prefetch(prefetch_keys)

            entries = await source.acquire(
                keys,
                wait=wait,
                after_pin=start_prefetch,
                slot_timeout=store.cache_options.slot_timeout if wait else None,
            )
            prefetch_keys = []  # started by acquire, right after pinning
        try:
            if prefetch_keys:  # every expert was resident: the prefetch starts after the pins, as in acquire
                source.prefetch(prefetch_keys)
            views = source.views(entries)
        except BaseException:
            source.release(entries)
            raise
        self._source, self._entries, self._views = source, entries, views
        loop = store._loop
        self._owner = loop.current_task() if loop is not None else None
        if positions is None:
            return views  # type: ignore[return-value]
        return [None if p < 0 else views[p] for p in positions]

    async def __aexit__(self, *exc_info: object) -> None:
        source = self._source
        if source is None:
            return
        self._source = None
        entries = self._entries
        try:
            source.end_views(entries, self._views)  # warns when the host still uses the bytes: an error under -W error
        finally:
            source.release(entries, self._owner)


@functools.lru_cache(maxsize=1024)
def _key_table(layer: int, n_experts: int) -> tuple[Key, ...]:
    """``((layer, 0), ..., (layer, n_experts - 1))``, shared by every store (keys are immutable):
    a fresh store does not build 128 tuples per layer on its first request of it."""
    return tuple(zip(itertools.repeat(layer), range(n_experts)))


def _id_list(ids: Iterable[Any], name: str) -> list[Any]:
    """``ids`` as a list (its items checked by ``_request_keys``), or InvalidRequestError."""
    if isinstance(ids, str | bytes):
        raise InvalidRequestError(f"{name} must be an iterable of expert ids, got {ids!r}")
    try:
        return list(ids)
    except TypeError:
        raise InvalidRequestError(f"{name} must be an iterable of expert ids, got {ids!r}") from None


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
