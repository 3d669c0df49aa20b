"""The engine: the public object that composes model, layout, slab, backend, scheduler and cache."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import anyio
import numpy as np

from ._cache.cache import Entry, ExpertCache, Key
from ._cache.eviction import EvictionPolicy, make_policy
from ._cache.scheduler import ReadScheduler
from ._cache.stats import Counters, EngineStatistics
from ._compute.executor import ResidentLayer, moe_forward, route
from ._compute.fused import WarmupReport
from ._compute.resident import load_residents, warmup_kernels
from ._errors import ConfigError, EngineClosedError, InvalidRequestError
from ._format.expert_map import check_map_matches_layout, read_expert_map
from ._format.hparams import MoEHParams
from ._format.layout import ExpertLayout, MoELayer, build_layout
from ._format.model import GGUFModel, open_model
from ._format.views import ExpertView, ProjectionView
from ._io.backends.base import IOBackend
from ._io.files import ShardFiles, open_shards
from ._io.loop import LoopAdapter, current_loop
from ._io.plan import ExpertPlan, max_plan_bytes, plan_expert
from ._io.select import BackendFactory, create_backend
from ._io.slab import Slab
from ._pipeline import ComputeStep, TokenResult, run_layer_step
from ._predict.predictors import PREDICTORS, Predictor, make_predictor
from ._predict.trace import RoutingTrace, TraceRecorder

__all__ = ("DEFAULT_CACHE_BYTES", "Engine", "MoEResult", "open")

log = logging.getLogger("aioexperts")

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_QUEUE_DEPTH = 64
MIN_QUEUE_DEPTH = 3  # gate, up and down of one expert are submitted together
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
    prefetch: str | Predictor = "router",
    prefetch_budget: int | None = None,
    prefetch_depth: int = 2,
    record_trace: bool = False,
) -> Engine:
    """Prepare an engine for the GGUF model at ``path``; start it with ``async with``.

    Example::

        async with aioexperts.open("model.gguf", slots=256) as engine:
            async with engine.experts(layer=3, ids=[5, 17]) as views:
                gate_bytes = views[0].gate.data

    Args:
        path: a ``.gguf`` file, or any shard of a split set ``NAME-0000k-of-0000n.gguf``.
        slots: slab slots, each holding one expert (at most every expert of the model: a larger
            value is lowered to that). Default: as many as fit in ``cache_bytes``, at least
            ``2 * expert_used_count``.
        cache_bytes: slab size in bytes used when ``slots`` is None (default 1 GiB).
        backend: ``"auto"`` (io_uring, else a thread pool, with one log line saying why),
            ``"io_uring"``, ``"threads"``, or a factory ``(files, slab, loop, depth) -> IOBackend``.
        direct_io: True to require ``O_DIRECT``, False for buffered reads, None to use
            ``O_DIRECT`` where a probe read works.
        queue_depth: reads in flight at most (the io_uring ring size), 3..4096.
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
        prefetch: how :meth:`Engine.moe` predicts the next layer's experts: ``"router"`` (the next
            layer's router on the current hidden state), ``"previous"`` (the previous token's
            choice), ``"frequency"``, ``"none"``, or a ``Predictor`` instance.
        prefetch_budget: experts prefetched per predicted layer (default: ``expert_used_count``).
        prefetch_depth: how many MoE layers ahead to prefetch (default 2: the I/O queue never
            runs dry at a layer boundary; 1 synchronises I/O and compute at every layer).
        record_trace: record every routing decision of :meth:`Engine.moe` (see
            :meth:`Engine.routing_trace`).

    Raises:
        ConfigError: an argument is out of range (raised here, before any I/O).
    """
    for name, value, optional in (
        ("slots", slots, True),
        ("cache_bytes", cache_bytes, False),
        ("queue_depth", queue_depth, False),
        ("max_bytes_in_flight", max_bytes_in_flight, False),
        ("n_threads", n_threads, True),
        ("prefetch_budget", prefetch_budget, True),
        ("prefetch_depth", prefetch_depth, False),
    ):
        if (value is None and not optional) or (
            value is not None and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise ConfigError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
    if slots is not None and slots < 1:
        raise ConfigError(f"slots must be >= 1, got {slots}")
    if n_threads is not None and n_threads < 1:
        raise ConfigError(f"n_threads must be >= 1, got {n_threads}")
    if cache_bytes < 1:
        raise ConfigError(f"cache_bytes must be >= 1, got {cache_bytes}")
    if not isinstance(policy, str | EvictionPolicy):
        raise ConfigError(f"policy must be a policy name or an EvictionPolicy, got {policy!r}")
    if not isinstance(prefetch, str | Predictor):
        raise ConfigError(f"prefetch must be a predictor name or a Predictor, got {prefetch!r}")
    if not isinstance(backend, str) and not callable(backend):
        raise ConfigError(f"backend must be a name or a factory, got {backend!r}")
    if direct_io not in (None, True, False):
        raise ConfigError(f"direct_io must be None, True or False, got {direct_io!r}")
    if not MIN_QUEUE_DEPTH <= queue_depth <= 4096:
        raise ConfigError(
            f"queue_depth must be in {MIN_QUEUE_DEPTH}..4096 (one expert can need {MIN_QUEUE_DEPTH} reads), "
            f"got {queue_depth}"
        )
    if max_bytes_in_flight < 1:
        raise ConfigError(f"max_bytes_in_flight must be >= 1, got {max_bytes_in_flight}")
    eviction = make_policy(policy) if isinstance(policy, str) else policy
    if isinstance(prefetch, str) and prefetch not in PREDICTORS:
        raise ConfigError(f"prefetch must be one of {', '.join(sorted(PREDICTORS))} or a Predictor, got {prefetch!r}")
    if prefetch_budget is not None and prefetch_budget < 0:
        raise ConfigError(f"prefetch_budget must be >= 0, got {prefetch_budget}")
    if prefetch_depth < 0:
        raise ConfigError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
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
        prefetch=prefetch,
        prefetch_budget=prefetch_budget,
        prefetch_depth=prefetch_depth,
        record_trace=record_trace,
    )


@dataclass(frozen=True, slots=True, eq=False)
class MoEResult:
    """One MoE layer on a batch of tokens (:meth:`Engine.moe_result`).

    Attributes:
        ids: ``(n_tokens, k)`` int32 selected experts, llama.cpp's order.
        weights: ``(n_tokens, k)`` float32 routing weights (normalised and scaled).
        moe_out: ``(n_tokens, n_embd)`` float32 routed experts' weighted sum.
        shared_out: ``(n_tokens, n_embd)`` float32 shared expert output, or None.
        ffn_out: ``moe_out + shared_out``, ``(n_tokens, n_embd)`` float32.
        io_wait_seconds: time waited for experts after routing.
        compute_seconds: executor time in the worker thread.
    """

    ids: np.ndarray
    weights: np.ndarray
    moe_out: np.ndarray
    shared_out: np.ndarray | None
    ffn_out: np.ndarray
    io_wait_seconds: float
    compute_seconds: float


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
        prefetch: str | Predictor = "router",
        prefetch_budget: int | None = None,
        prefetch_depth: int = 2,
        record_trace: bool = False,
    ) -> None:
        self.path = path
        self._prefetch_arg = prefetch
        self._prefetch_budget_arg = prefetch_budget
        self.prefetch_depth = prefetch_depth
        self._record_trace = record_trace
        self._hparams: MoEHParams | None = None
        self._residents: dict[int, ResidentLayer] | None = None
        self._residents_lock = anyio.Lock()
        self._predictor: Predictor | None = None
        self._recorder: TraceRecorder | None = None
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
            model, layout = await anyio.to_thread.run_sync(self._parse)
            self._model, self._layout = model, layout
            files = self._files = await anyio.to_thread.run_sync(open_shards, model, self._direct_io_arg)
            if files.buffered_reason is not None and self._direct_io_arg is None:
                log.warning("aioexperts: %s; using buffered reads (the page cache)", files.buffered_reason)
            alignment = files.alignment
            slot_bytes = await anyio.to_thread.run_sync(max_plan_bytes, layout, alignment)
            n_slots = self._n_slots(slot_bytes)
            slab = self._slab = await anyio.to_thread.run_sync(
                lambda: Slab(n_slots, slot_bytes, hugepages=self._hugepages, lock=self._lock_memory)
            )
            backend, self._fallback_reason = create_backend(
                self._backend_arg, files, slab, loop, self._queue_depth, **self._backend_options
            )
            self._backend = backend
            scheduler = self._scheduler = ReadScheduler(
                backend,
                loop,
                self.counters,
                files.sizes,
                alignment,
                self._max_bytes_in_flight,
                tuple(s.path for s in model.shards),
            )
            self._plan = lru_cache(maxsize=None)(self._make_plan)
            self._cache = ExpertCache(n_slots, self._plan, scheduler, self._policy, loop, self.counters)
        except BaseException:
            self._release_resources()
            self._closed = True
            raise

    def _parse(self) -> tuple[GGUFModel, ExpertLayout]:
        model = open_model(self.path)
        layout = build_layout(model)
        self._hparams = MoEHParams.from_metadata(model.architecture, model.metadata)
        if self._record_trace:
            self._recorder = TraceRecorder(
                list(layout.layers),
                [m.n_experts for m in layout.layers.values()],
                layout.n_expert_used,
                metadata={"model": os.path.basename(self.path)},
            )
        if self._expert_map is not None:
            if len(model.shards) != 1:
                raise ConfigError("a WEEPF001 expert map describes one file; this model is a split set")
            emap = read_expert_map(self._expert_map, model.shards[0])
            check_map_matches_layout(emap, layout, self._expert_map)
        return model, layout

    def _n_slots(self, slot_bytes: int) -> int:
        layout = self.layout
        if self._slots_arg is not None:
            return min(self._slots_arg, layout.n_experts_total)  # more could never be used
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
        if self._loop is not None and not self._loop.is_current():
            raise ConfigError(
                "the engine is used from another event loop than the one it was started in; "
                "open one engine per event loop"
            )

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

    def _keys(self, moe: MoELayer, ids: Sequence[int]) -> list[Key]:
        layer = moe.index
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
        try:
            ids = list(ids)  # iterated twice below: accept generators and other one-shot iterables
        except TypeError:
            raise InvalidRequestError(f"ids must be an iterable of expert ids, got {ids!r}") from None
        moe = self.layout.layer(layer)
        layer = moe.index
        keys = self._keys(moe, ids)
        cache = self.cache
        entries = await cache.acquire(keys, wait=self.wait_for_slots if wait is None else wait)
        by_key = {e.key: self._view(e) for e in entries}
        views = [None if int(i) == -1 else by_key[(layer, int(i))] for i in ids]
        try:
            yield views
        finally:
            for view in by_key.values():
                view.release()
            cache.release(entries)

    # -- MoE execution ------------------------------------------------------------------------

    @property
    def hparams(self) -> MoEHParams:
        """The model's MoE hyper-parameters (gating, top-k, normalisation, scale)."""
        self._check_started()
        assert self._hparams is not None
        return self._hparams

    async def load_resident(self) -> Mapping[int, ResidentLayer]:
        """Read and dequantize every MoE layer's resident weights once (router, biases, shared expert).

        Runs in a worker thread the first time; :meth:`moe` calls it on first use.

        Raises:
            FormatError, ConfigError: a resident tensor is missing, truncated or misshaped.
        """
        self._check_running()
        async with self._residents_lock:
            if self._residents is None:
                if not self.hparams.verified:
                    log.warning(
                        "aioexperts: architecture %r is not one whose MoE routing was checked against "
                        "llama.cpp; computing with the generic rules (gating and normalisation from the "
                        "metadata, SwiGLU experts): outputs may differ from llama.cpp",
                        self.hparams.arch,
                    )
                self._residents = await anyio.to_thread.run_sync(load_residents, self.model, self.layout, self.hparams)
        return self._residents

    async def warmup(self) -> WarmupReport:
        """Compile, or load from the on-disk cache, the compute kernels of this model's ggml types.

        :meth:`load_resident` (hence the first :meth:`moe`) does it too; call this to pay the cost
        at a moment of your choosing. Runs in a worker thread; cheap once done.
        """
        self._check_running()
        return await anyio.to_thread.run_sync(warmup_kernels, self.layout)

    def next_moe_layer(self, layer: int, ahead: int = 1) -> int:
        """The block index of the MoE layer ``ahead`` layers after ``layer``, wrapping around.

        Prefetch wraps around: while the last layers compute, the next token's first layers are
        predicted.
        """
        self.layout.layer(layer)  # InvalidRequestError for a layer that is not a MoE layer
        layers = list(self.layout.layers)
        return layers[(layers.index(layer) + ahead) % len(layers)]

    def upcoming_layers(self, layer: int) -> list[int]:
        """The MoE layers prefetched while ``layer`` computes (``prefetch_depth`` of them, nearest first)."""
        n = len(self.layout.layers)
        return [self.next_moe_layer(layer, d) for d in range(1, min(self.prefetch_depth, n - 1) + 1)]

    @property
    def predictor(self) -> Predictor:
        """The next-layer predictor used for prefetching (built on first use)."""
        if self._predictor is None:
            arg = self._prefetch_arg
            if not isinstance(arg, str):
                self._predictor = arg
            elif arg == "router":
                if self._residents is None:
                    raise ConfigError("the router predictor needs the resident weights: await load_resident() first")
                self._predictor = make_predictor("router", residents=self._residents, hparams=self.hparams)
            else:
                self._predictor = make_predictor(arg)
        return self._predictor

    @property
    def prefetch_budget(self) -> int:
        """Experts prefetched per layer step."""
        budget = self._prefetch_budget_arg
        return self.layout.n_expert_used if budget is None else budget

    def _prefetch_keys(self, layer: int, x: np.ndarray | None, predictor: Predictor | None) -> list[Key]:
        if predictor is None or self.prefetch_budget == 0:
            return []
        return [
            (nxt, e)
            for nxt in self.upcoming_layers(layer)
            for e in predictor.predict(layer, nxt, x, self.prefetch_budget)
        ]

    async def moe(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Run MoE layer ``layer`` on ``x``: route, fetch the experts, compute (``ffn_out``).

        ``y = await engine.moe(layer, x)``. The router is resident; the chosen experts come
        through the cache; the executor runs in a worker thread while the next layer's predicted
        experts are prefetched.

        Args:
            layer: block index of a MoE layer.
            x: ``(n_tokens, n_embd)`` float32, the MoE block's input (after the FFN norm).

        Returns:
            ``(n_tokens, n_embd)`` float32: routed experts plus shared experts (llama.cpp's
            ``ffn_out``; add it to the residual stream).

        Raises:
            InvalidRequestError: no such layer, or ``x`` has the wrong dtype or shape.
            SlabExhaustedError, ExpertReadError, EngineClosedError: as :meth:`experts`.

        Cancellation handling:
            As :meth:`experts`; an executor call already running finishes in its thread first.
        """
        return (await self.moe_result(layer, x)).ffn_out

    async def moe_result(self, layer: int, x: np.ndarray, *, prefetch: bool = True) -> MoEResult:
        """Like :meth:`moe`, returning the routing and every partial output.

        Args:
            prefetch: start the prefetch of the next layer's predicted experts.
        """
        self._check_running()
        layer = self.layout.layer(layer).index
        residents = await self.load_resident()
        resident, hparams = residents[layer], self.hparams
        ids, weights = route(x, resident, hparams)
        if self._recorder is not None:
            self._recorder.record(layer, ids)
        predictor = self.predictor if prefetch else None
        if predictor is not None:
            predictor.observe(layer, x, ids)

        # A prefill batch may choose more experts than the slab holds: run them in groups that fit.
        unique = list(dict.fromkeys(int(e) for e in ids[ids >= 0]))
        limit = self.cache.n_slots
        groups = [unique[i : i + limit] for i in range(0, len(unique), limit)] or [[]]
        moe_out: np.ndarray | None = None
        shared_out: np.ndarray | None = None
        io_wait = compute_s = 0.0
        for g, group in enumerate(groups):
            group_ids = ids if len(groups) == 1 else np.where(np.isin(ids, group), ids, -1).astype(ids.dtype)
            group_resident = resident if g == 0 else _without_shared(resident)

            def compute(
                _layer: int,
                xx: np.ndarray,
                views: Mapping[int, ExpertView],
                ii: np.ndarray,
                ww: np.ndarray,
                _resident: ResidentLayer = group_resident,
            ) -> Any:
                return moe_forward(xx, ii, ww, views, _resident, hparams)

            last = g == len(groups) - 1
            step = await run_layer_step(
                self.cache,
                self._view,
                layer,
                x,
                group_ids,
                weights,
                compute,
                prefetch=self._prefetch_keys(layer, x, predictor) if last else (),
                upcoming=self.upcoming_layers(layer),
                wait=self.wait_for_slots,
            )
            out = step.output
            moe_out = out.moe_out if moe_out is None else moe_out + out.moe_out
            shared_out = out.shared_out if g == 0 else shared_out
            io_wait += step.io_wait_seconds
            compute_s += step.compute_seconds
        assert moe_out is not None
        ffn_out = moe_out if shared_out is None else moe_out + shared_out
        if len(groups) == 1:
            ffn_out = out.ffn_out
        return MoEResult(ids, weights, moe_out, shared_out, ffn_out, io_wait, compute_s)

    async def run_token(
        self,
        x: np.ndarray,
        *,
        route_step: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
        compute: ComputeStep | None = None,
        predictor: Predictor | None = None,
        prefetch: bool = True,
    ) -> TokenResult:
        """Run every MoE layer for one token (or a batch), in order, with prefetch of the next layer.

        A driver for measuring the I/O and compute overlap with any compute step: layer ``N+1``
        gets ``x + y`` of layer ``N`` (a residual stream without attention), so it is not a model
        forward pass. Per-token latency and the token count go into :meth:`statistics`.

        Args:
            x: ``(n_tokens, n_embd)`` float32 input of the first MoE layer.
            route_step: ``(layer, x) -> (ids, weights)``; default: the layer's resident router.
            compute: the compute step (see ``ComputeStep``); default: the numpy executor.
            predictor: overrides the engine's predictor for this call.
            prefetch: prefetch the next layer's predicted experts.

        Raises:
            As :meth:`moe`.
        """
        self._check_running()
        t0 = time.perf_counter()
        need_residents = route_step is None or compute is None or (predictor is None and prefetch)
        residents = await self.load_resident() if need_residents else {}
        hparams = self.hparams
        chosen = (predictor or self.predictor) if prefetch else None
        steps = []
        for layer in self.layout.layers:
            if route_step is None:
                ids, weights = route(x, residents[layer], hparams)
            else:
                ids, weights = route_step(layer, x)
            if self._recorder is not None:
                self._recorder.record(layer, ids)
            if chosen is not None:
                chosen.observe(layer, x, ids)
            step_compute = compute or _executor_step(residents[layer], hparams)
            step = await run_layer_step(
                self.cache,
                self._view,
                layer,
                x,
                ids,
                weights,
                step_compute,
                prefetch=self._prefetch_keys(layer, x, chosen),
                upcoming=self.upcoming_layers(layer),
                wait=self.wait_for_slots,
            )
            steps.append(step)
            x = x + step.output
        seconds = time.perf_counter() - t0
        self.counters.tokens += len(x)
        self.counters.token_latency.add(seconds)
        return TokenResult(x, tuple(steps), seconds)

    def routing_trace(self) -> RoutingTrace:
        """Every routing decision recorded so far (``record_trace=True``).

        Raises:
            ConfigError: the engine was opened without ``record_trace=True``.
        """
        if self._recorder is None:
            raise ConfigError("open the engine with record_trace=True to record routing")
        return self._recorder.trace()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._cache is not None else "not started"
        return f"<aioexperts.Engine {self.path!r} {state}>"


def _without_shared(resident: ResidentLayer) -> ResidentLayer:
    return dataclasses.replace(resident, shexp_gate=None, shexp_up=None, shexp_down=None, shexp_gate_inp=None)


def _executor_step(resident: ResidentLayer, hparams: MoEHParams) -> ComputeStep:
    def compute(
        _layer: int, x: np.ndarray, views: Mapping[int, ExpertView], ids: np.ndarray, w: np.ndarray
    ) -> np.ndarray:
        return moe_forward(x, ids, w, views, resident, hparams).ffn_out

    return compute
