"""Every call the benchmarks make into the store, in one place.

The bench drives the store only through its public surface (``aioexperts.open`` -> an expert
store: ``experts``, ``statistics()``; ``aioexperts.MoERunner`` over it: ``moe``, ``run_moe_layers``,
``warmup``) plus one documented extension point, the backend factory
``(files, slab, loop, depth) -> IOBackend`` (:mod:`aioexperts.backends`), through which
:class:`ReadRecorder` wraps the real io_uring backend to record the reads the store issues. When
the API changes, this module is the one to port. :class:`BenchStore` pairs a store with its
runner.

Everything here runs on any event loop anyio supports (asyncio, uvloop, trio).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

import aioexperts
from aioexperts import ComputeStep, RouteStep
from aioexperts.backends import io_uring_unusable_reason

from .readlist import ReadList

__all__ = (
    "store_backend",
    "BenchStore",
    "BenchOptions",
    "ModelInfo",
    "ReadRecorder",
    "TokenTimes",
    "cold_pass",
    "store_stats",
    "model_info",
    "open_bench_store",
    "preload",
    "reset_stats",
    "run_tokens",
    "warm_experts",
    "warm_moe",
)

#: ``(layer, expert ids)``: the experts one token routes to in one MoE layer.
Step = tuple[int, tuple[int, ...]]
# the bench's route and compute steps are the public ones: aioexperts.RouteStep, aioexperts.ComputeStep


@dataclass(frozen=True)
class ModelInfo:
    """What the bench needs to know about a model, from its layout.

    Attributes:
        shard_paths: the files of the model, in shard order.
        layers: MoE block indices in order.
        n_experts: experts per MoE layer, in the same order.
        n_expert_used: top-k.
        n_embd: hidden size.
        expert_bytes: ``{(layer, expert): payload bytes}``.
        file_bytes: total size of the shards in bytes.
        segments: ``(shard, offset, n_bytes, layer)`` of every expert segment (for mapping a read
            back to its layer).
    """

    shard_paths: tuple[str, ...]
    layers: tuple[int, ...]
    n_experts: tuple[int, ...]
    n_expert_used: int
    n_embd: int
    expert_bytes: dict[tuple[int, int], int]
    file_bytes: int
    segments: tuple[tuple[int, int, int, int], ...]

    @property
    def n_experts_total(self) -> int:
        """Routed experts over all MoE layers."""
        return sum(self.n_experts)

    def layer_of(self, shard: int, offset: int) -> int | None:
        """The MoE layer whose expert bytes contain ``offset`` of ``shard`` (None if none)."""
        for s, off, n, layer in self.segments:
            if s == shard and off <= offset < off + n:
                return layer
        return None


def model_info(path: str) -> ModelInfo:
    """Parse ``path`` (any shard of a split set) and describe it.

    Raises:
        FileNotFoundError: no such file.
        aioexperts.FormatError: the model is malformed.
    """
    model = aioexperts.open_model(path)
    layout = aioexperts.build_layout(model)
    sizes = {}
    segments: dict[tuple[int, int, int, int], None] = {}
    for layer, moe in layout.layers.items():
        for e in range(moe.n_experts):
            loc = layout.locate(layer, e)
            sizes[(layer, e)] = loc.n_bytes
        for bank in moe.banks:
            for tensor in (bank.gate, bank.up, bank.down):
                if tensor is not None:
                    segments[(tensor.shard, tensor.data_offset, tensor.n_bytes, layer)] = None
    return ModelInfo(
        tuple(s.path for s in model.shards),
        tuple(layout.layers),
        tuple(m.n_experts for m in layout.layers.values()),
        layout.n_expert_used,
        layout.n_embd,
        sizes,
        sum(os.path.getsize(s.path) for s in model.shards),
        tuple(segments),
    )


def store_backend() -> str:
    """The backend the bench measures the store with: io_uring (the ``liburing`` wheel, or the
    raw-syscall ring where the wheel cannot run), or the thread pool where neither can (the
    reason is in the run's log and the results file)."""
    return "io_uring" if io_uring_unusable_reason() is None else "threads"


class ReadRecorder:
    """A backend factory: the real io_uring backend, with every submitted read recorded.

    Pass an instance as ``aioexperts.open(..., backend=recorder)``. Each read is recorded as
    ``(shard, file_offset, n_bytes)`` in submission order; with ``timestamps`` also the submit
    and completion times (``time.perf_counter`` seconds). The wrapper costs one list append per
    read; stores opened without a recorder run the backend untouched.

    Args:
        shard_paths: the model's files in shard order (reads name shards by index).
        backend: the backend to wrap (``"io_uring"`` or ``"threads"``).
        timestamps: record submit and completion times too.
        options: passed to the backend (``fixed_buffers``, ``sqe_async``, ``n_threads``).
    """

    def __init__(
        self, shard_paths: Sequence[str], backend: str | None = None, *, timestamps: bool = False, **options: Any
    ) -> None:
        self.shard_paths = tuple(shard_paths)
        self.backend = store_backend() if backend is None else backend
        self.timestamps = timestamps
        self.options = options
        self.reads: list[tuple[int, int, int]] = []
        self.times: list[tuple[float, float]] = []
        #: with ``timestamps``: ``(start, end, n_ops)`` of every ``submit`` call, and ``(start, end)``
        #: of every completion's handling on the loop thread (the scheduler's reap of one read)
        self.submit_spans: list[tuple[float, float, int]] = []
        self.reap_spans: list[tuple[float, float]] = []
        self._submitted: dict[int, tuple[int, float]] = {}

    def clear(self) -> None:
        """Forget the reads recorded so far."""
        self.reads.clear()
        self.times.clear()
        self.submit_spans.clear()
        self.reap_spans.clear()
        self._submitted.clear()

    def read_list(self) -> ReadList:
        """The reads recorded so far as a :class:`ReadList`."""
        return ReadList(self.shard_paths, np.asarray(self.reads, dtype=np.int64).reshape(-1, 3))

    def __call__(self, files: Any, slab: Any, loop: Any, depth: int) -> Any:
        from aioexperts._io.select import create_backend  # the store's own backend selection

        # the store calls factories off the loop and attaches the backend itself
        backend, _reason = create_backend(self.backend, files, slab, loop, depth, attach=False, **self.options)
        submit = backend.submit
        reads, times, submitted = self.reads, self.times, self._submitted
        clock = time.perf_counter

        if not self.timestamps:

            def recording_submit(ops: Sequence[Any]) -> None:
                reads.extend((op.shard, op.file_offset, op.n_bytes) for op in ops)
                submit(ops)

        else:
            set_sink = backend.set_sink

            submit_spans, reap_spans = self.submit_spans, self.reap_spans

            def recording_submit(ops: Sequence[Any]) -> None:
                now = clock()
                for op in ops:
                    submitted[id(op)] = (len(reads), now)
                    reads.append((op.shard, op.file_offset, op.n_bytes))
                    times.append((now, float("nan")))
                start = clock()
                try:
                    submit(ops)
                finally:
                    submit_spans.append((start, clock(), len(ops)))

            def recording_set_sink(
                sink: Callable[[Any, Any], None], batch_end: Callable[[], None] | None = None
            ) -> None:
                def timed_sink(op: Any, result: Any) -> None:
                    start = clock()
                    index, t0 = submitted.pop(id(op), (-1, 0.0))
                    if index >= 0:
                        times[index] = (t0, start)
                    try:
                        sink(op, result)
                    finally:
                        reap_spans.append((start, clock()))

                set_sink(timed_sink, batch_end)

            backend.set_sink = recording_set_sink  # type: ignore[method-assign]
        backend.submit = recording_submit  # type: ignore[method-assign]
        return backend


@dataclass(frozen=True)
class BenchOptions:
    """How the bench opens a store (see ``aioexperts.open``)."""

    slots: int
    backend: Any = dataclasses.field(default_factory=store_backend)
    queue_depth: int = 64
    prefetch: str = "none"
    policy: str = "lru"
    prefetch_budget: int | None = None
    direct_io: bool | None = None


class BenchStore:
    """An expert store and an MoE runner over it, started and closed together (``async with``).

    Attributes:
        store: the :class:`aioexperts.ExpertStore`.
        runner: the :class:`aioexperts.MoERunner` on it.
    """

    def __init__(self, store: aioexperts.ExpertStore, runner: aioexperts.MoERunner) -> None:
        self.store = store
        self.runner = runner

    async def __aenter__(self) -> BenchStore:
        await self.store.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.store.aclose()

    @property
    def layout(self) -> aioexperts.ExpertLayout:
        return self.store.layout

    def experts(self, layer: int, ids: Sequence[int]) -> Any:
        return self.store.experts(layer, ids)

    def statistics(self) -> aioexperts.StoreStatistics:
        return self.store.statistics()

    def reset_statistics(self) -> None:
        self.store.reset_statistics()

    async def load_resident(self) -> None:
        await self.runner.warmup()

    async def moe(self, layer: int, x: np.ndarray) -> np.ndarray:
        return await self.runner.moe(layer, x)

    async def run_moe_layers(self, x: np.ndarray, **kwargs: Any) -> aioexperts.MoELayersResult:
        return await self.runner.run_moe_layers(x, **kwargs)


def open_bench_store(path: str, options: BenchOptions) -> BenchStore:
    """``aioexperts.open`` and a runner with the bench's options (start it with ``async with``)."""
    store = aioexperts.open(
        path,
        cache=aioexperts.CacheOptions(slots=options.slots, policy=options.policy),
        io=aioexperts.IOOptions(backend=options.backend, queue_depth=options.queue_depth, direct_io=options.direct_io),
    )
    prefetch = aioexperts.PrefetchOptions(predictor=options.prefetch, budget=options.prefetch_budget)
    return BenchStore(store, aioexperts.MoERunner(store, prefetch=prefetch))


def store_stats(store: BenchStore) -> dict[str, Any]:
    """The store's statistics as a plain dict (JSON-ready)."""
    st = store.statistics()
    out = {name: getattr(st, name) for name in st.__dataclass_fields__}
    out["hit_rate"] = st.hit_rate
    return {k: v for k, v in out.items() if isinstance(v, int | float | str | bool | dict | type(None))}


def reset_stats(store: BenchStore) -> None:
    """Zero the store's counters (the slab keeps its experts)."""
    store.reset_statistics()


async def cold_pass(store: BenchStore, steps: Sequence[Step], window: int) -> None:
    """Request every step's experts, ``window`` steps at a time, each released at once."""
    gate = anyio.Semaphore(window)

    async def one(step: Step) -> None:
        async with gate, store.experts(step[0], step[1]):
            pass

    async with anyio.create_task_group() as tg:
        for step in steps:
            tg.start_soon(one, step)


async def preload(store: BenchStore, layers: Sequence[int], n_experts: Sequence[int], window: int) -> None:
    """Make every expert of ``layers`` resident (the slab must hold them all)."""
    steps = [(layer, (e,)) for layer, n in zip(layers, n_experts, strict=True) for e in range(n)]
    await cold_pass(store, steps, window)


async def warm_experts(store: BenchStore, steps: Sequence[Step]) -> float:
    """Time ``async with store.experts(layer, ids)`` over ``steps`` one after another (all hits).

    Returns:
        Wall seconds for all steps.
    """
    t0 = time.perf_counter()
    for layer, ids in steps:
        async with store.experts(layer, ids):
            pass
    return time.perf_counter() - t0


async def warm_moe(store: BenchStore, layers: Sequence[int], xs: Sequence[np.ndarray]) -> tuple[float, int]:
    """Time ``await store.moe(layer, x)`` for each ``x`` over ``layers`` (experts resident).

    Returns:
        ``(wall seconds, calls)``.
    """
    await store.load_resident()
    await store.moe(layers[0], xs[0])  # first call builds the predictor
    t0 = time.perf_counter()
    calls = 0
    for x in xs:
        for layer in layers:
            await store.moe(layer, x)
            calls += 1
    return time.perf_counter() - t0, calls


@dataclass(frozen=True)
class TokenTimes:
    """Tokens run through every MoE layer with :meth:`BenchStore.run_moe_layers`.

    Attributes:
        seconds: wall time of each token.
        io_wait_seconds, compute_seconds: per token, summed over layers.
        layer_steps: per token, per layer ``(io_wait_seconds, compute_seconds)``.
        compute_spans: per token, per layer ``(start, end)`` of the compute step
            (``time.perf_counter``), when recorded.
        token_starts: ``time.perf_counter`` at the start of each token.
        stats: the store's statistics afterwards.
    """

    seconds: list[float]
    io_wait_seconds: list[float]
    compute_seconds: list[float]
    layer_steps: list[list[tuple[float, float]]]
    compute_spans: list[list[tuple[float, float]]]
    token_starts: list[float]
    stats: dict[str, Any]


async def run_tokens(
    store: BenchStore,
    inputs: Sequence[np.ndarray],
    *,
    route: Callable[[int], RouteStep] | None = None,
    compute: ComputeStep | None = None,
    predictor: Any = None,
    prefetch: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> TokenTimes:
    """Run one token per input through every MoE layer (``store.run_moe_layers``).

    Args:
        inputs: ``(1, n_embd)`` float32 input of each token.
        route: ``token -> route_step`` (None: the model's own router).
        compute: the compute step (None: the executor).
        predictor: a ``Predictor`` for prefetch (None: the store's own).
        prefetch: prefetch the next layers' predicted experts.
        on_token: called with the token index before it runs (e.g. to advance an oracle).
    """
    seconds, io_wait, compute_s, steps, spans, starts = [], [], [], [], [], []
    current: list[tuple[float, float]] = []
    step_fn = compute
    if compute is not None:

        def timed(layer: int, x: np.ndarray, views: Mapping[int, Any], ids: np.ndarray, w: np.ndarray) -> Any:
            t0 = time.perf_counter()
            try:
                return compute(layer, x, views, ids, w)
            finally:
                current.append((t0, time.perf_counter()))

        step_fn = timed
    for token, x0 in enumerate(inputs):
        if on_token is not None:
            on_token(token)
        current = []
        starts.append(time.perf_counter())
        result = await store.run_moe_layers(
            x0,
            route_step=None if route is None else route(token),
            compute=step_fn,
            predictor=predictor,
            prefetch=prefetch,
        )
        seconds.append(result.seconds)
        io_wait.append(result.io_wait_seconds)
        compute_s.append(result.compute_seconds)
        steps.append([(s.io_wait_seconds, s.compute_seconds) for s in result.steps])
        spans.append(current)
    return TokenTimes(seconds, io_wait, compute_s, steps, spans, starts, store_stats(store))
