"""The MoE runner: the public face that joins a router and a layer executor.

An :class:`MoERunner` routes with its :class:`~aioexperts._router.Router` (the resident routers,
the prefetch predictor, the routing trace) and runs the chosen experts on its
:class:`~aioexperts._executor.LayerExecutor` (the local store's slab by default; the expert shards
of :mod:`aioexperts.distributed` with ``ShardExecutor``). Every route from a token to the kernels
goes through the executor: :meth:`~MoERunner.moe`, :meth:`~MoERunner.moe_result`,
:meth:`~MoERunner.run_moe_layers`, and the model's seams :meth:`~MoERunner.execute`,
:meth:`~MoERunner.execute_rows` and :meth:`~MoERunner.prefetch_first`. Concurrent decode streams'
calls of one layer are batched into one executor step (:mod:`aioexperts._batch`: the one batcher,
:mod:`aioexperts._batcher`, keyed by layer).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
from numpy.typing import ArrayLike

from ._batch import DEFAULT_BATCH_WAIT, DecodeStream, LayerBatcher
from ._batch import check_batch_wait as check_batch_wait
from ._cache.cache import Key
from ._cache.stats import LatencyWindow, to_ms
from ._checks import as_int_array, describe
from ._compute.fused import WarmupReport
from ._compute.moe import MoEOutput, ResidentLayer
from ._compute.resident import warmup_kernels
from ._errors import ConfigError, InvalidRequestError, SlabExhaustedError
from ._executor import LayerExecutor, LayerOutcome, LocalExecutor
from ._executor import ResidentPass as ResidentPass
from ._executor import hits_first_pays as hits_first_pays
from ._pipeline import ComputeStep, LayerStep, MoELayersResult, run_in_worker, run_layer_step_then
from ._predict.predictors import Predictor
from ._predict.trace import RoutingTrace
from ._router import DEFAULT_TRACE_MAX_TOKENS, PrefetchOptions, Router, RouteStep, Routing, rows_text
from ._store import ExpertStore
from ._timeline import Timeline

__all__ = (
    "BATCH_MAX_CALLS",
    "BATCH_MAX_ROWS",
    "DEFAULT_TRACE_MAX_TOKENS",
    "MoEResult",
    "MoERunner",
    "PrefetchOptions",
    "RouteStep",
    "RunnerStatistics",
)

BATCH_MAX_ROWS = 1
"""Calls of up to this many rows (decode steps) join cross-request batches; larger ones run alone.

One: a short prompt (2..8 tokens) used to join the decode streams' steps, and each of their tokens
then waited for the prompt's rows (a 4-stream step of 4-token prompts took 2-3x a decode step)."""

BATCH_MAX_CALLS = 4
"""Calls a cross-request batch takes at most; a fuller layer opens another batch, so that batches
pipeline (one reads while another computes) instead of moving every stream in lockstep.

Chosen from interleaved development runs (no results file) on 2 cores, slab 25 %: on the 8-layer
built-in model, 16 streams batched without a cap ran at about 0.73x of no batching (every step read,
then computed, with the other resource idle), capped at 4 about 1.0x (spread routing) and 1.1x
(skewed). On 48 layers a cap of 2 did better with spread routing at 4 streams and worse with skewed
routing at 16 (issue 22's note)."""


@dataclass(frozen=True, slots=True, eq=False)
class MoEResult:
    """One MoE layer on a batch of tokens (:meth:`MoERunner.moe_result`).

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


@dataclass(frozen=True, slots=True)
class RunnerStatistics:
    """A snapshot of a runner's counters (:meth:`MoERunner.statistics`).

    Attributes:
        layer_steps: MoE layer steps run (every entry point; a batch is one step per layer).
        tokens: tokens run through :meth:`MoERunner.run_moe_layers` (a batch of ``n`` counts ``n``).
        io_wait_seconds: time spent waiting for experts after routing, summed over steps.
        compute_seconds: time the compute steps ran in worker threads, summed.
        token_latency_p50_ms, token_latency_p99_ms: per :meth:`MoERunner.run_moe_layers` call (ms).
        calls: :meth:`MoERunner.moe` / :meth:`~MoERunner.moe_result` calls and
            :meth:`~MoERunner.run_moe_layers` layers served by the executor's layer steps.
        experts_per_step: distinct experts read per layer step (mean; one read request each).
        rows_per_step: token rows per layer step (mean).
        batches: layer steps that served more than one call (cross-request batching).
        batched_calls: calls served by those steps.
        retried_calls: calls run alone again after their batch failed as a whole.
        batch_window_seconds: time batches waited for their members, summed.
        hits_first_steps: layer steps that computed their resident experts while the others were read.
        stall_seconds: time the forward pass waited for reads with nothing to compute, summed (the
            wait of each step less the resident experts' compute that overlapped it; at most
            ``io_wait_seconds``).
    """

    layer_steps: int
    tokens: int
    io_wait_seconds: float
    compute_seconds: float
    token_latency_p50_ms: float | None
    token_latency_p99_ms: float | None
    calls: int = 0
    experts_per_step: float | None = None
    rows_per_step: float | None = None
    batches: int = 0
    batched_calls: int = 0
    retried_calls: int = 0
    batch_window_seconds: float = 0.0
    hits_first_steps: int = 0
    stall_seconds: float = 0.0


@dataclass(slots=True)
class _Counters:
    tokens: int = 0
    token_latency: LatencyWindow = field(default_factory=LatencyWindow)


class MoERunner:
    """Runs the MoE layers of the model in ``store``: route, fetch, compute, prefetch ahead.

    Example::

        import asyncio
        import numpy as np
        import aioexperts
        from aioexperts.testing import builtin_model_path

        async def main() -> None:
            async with aioexperts.open(builtin_model_path(), slots=256) as store:
                runner = aioexperts.MoERunner(store)
                x = np.ones((2, store.hparams.n_embd), np.float32)   # (n_tokens, n_embd) float32
                y = await runner.moe(0, x)                            # the MoE block's output

        asyncio.run(main())

    Args:
        store: a started :class:`~aioexperts.ExpertStore`; the runner never closes it.
        executor: what computes the routed experts (default a
            :class:`~aioexperts._executor.LocalExecutor` over ``store``; an executor serves one runner).
        prefetch: what to load ahead (default :class:`~aioexperts.PrefetchOptions`).
        record_trace: record every routing decision (see :meth:`routing_trace`). The tokens of one
            :meth:`run_moe_layers` call get rows of their own even when calls run concurrently; calls of
            :meth:`moe` append to each layer's rows in the order they route, so concurrent
            sequences calling :meth:`moe` interleave there.
        trace_max_tokens: the trace keeps the last this many tokens (memory up to
            ``trace_max_tokens * n_moe_layers * k * 2`` bytes; 65536 tokens of a 48-layer top-8 model
            take 48 MiB), so a long-running runner's trace stays bounded.
        batch_wait: cross-request expert batching: seconds a layer step of a decode stream
            (:meth:`decode_stream`) stays open for the other streams on their way to that layer
            (default 0.05); the streams' experts are read once and their rows computed in one step,
            each stream's numbers bit for bit those it gets alone. A lone stream never waits, no
            stream waits beyond the window. 0 or None: off.
        hits_first: compute a layer's resident experts while its other experts are read (the
            result does not change: the slots are summed in slot order); the local executor's.

    Raises:
        ConfigError: a bad argument.

    Concurrency: several tasks may await one runner at once; their numpy work runs in worker
    threads and the predictor and trace are updated under a lock.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        executor: LayerExecutor | None = None,
        prefetch: PrefetchOptions | None = None,
        record_trace: bool = False,
        trace_max_tokens: int = DEFAULT_TRACE_MAX_TOKENS,
        batch_wait: float | None = DEFAULT_BATCH_WAIT,
        hits_first: bool = True,
    ) -> None:
        self._router = Router(store, prefetch=prefetch, record_trace=record_trace, trace_max_tokens=trace_max_tokens)
        wait = check_batch_wait(batch_wait)
        if not isinstance(hits_first, bool):
            raise ConfigError(f"hits_first must be True or False, got {hits_first!r}")
        if executor is None:
            executor = LocalExecutor(store, hits_first=hits_first)
        elif not isinstance(executor, LayerExecutor):
            raise ConfigError(f"executor must be an aioexperts LayerExecutor, got {executor!r}")
        self._store = store
        self._executor = executor
        self._counters = _Counters()
        self._warmup_report: WarmupReport | None = None
        self._warmup_lock = anyio.Lock()
        self._batcher: LayerBatcher[Routing, tuple[MoEOutput, float, float]] = LayerBatcher(
            wait, self._run_batch, BATCH_MAX_CALLS
        )
        executor.bind(self._router, self._batcher.note)

    @property
    def store(self) -> ExpertStore:
        """The expert store this runner reads from."""
        return self._store

    @property
    def router(self) -> Router:
        """The router: routing, prediction of the layers ahead, the resident weights, the trace."""
        return self._router

    @property
    def executor(self) -> LayerExecutor:
        """The executor that runs the routed experts of every layer step."""
        return self._executor

    @property
    def prefetch_options(self) -> PrefetchOptions:
        """What is loaded ahead."""
        return self._router.prefetch_options

    @property
    def hits_first(self) -> bool:
        """Whether a step computes its resident experts while the others are read (local
        executor; False for an executor without local experts). Settable.

        Raises:
            ConfigError: (setting) not a bool.
        """
        return bool(getattr(self._executor, "hits_first", False))

    @hits_first.setter
    def hits_first(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"hits_first must be True or False, got {value!r}")
        if isinstance(self._executor, LocalExecutor):
            self._executor.hits_first = value

    # -- start-up -------------------------------------------------------------------------------

    async def warmup(self) -> WarmupReport:
        """Load (once) what computing needs: the compute kernels of the model's ggml types
        (compiled, or loaded from the on-disk kernel cache: ``docs/executor.md``), the resident
        weights of every MoE layer, the predictor; then the executor's own warm-up.

        Runs the blocking work on the compute pool; :meth:`moe` and :meth:`run_moe_layers` call it on
        first use, so call it yourself to pay the cost (seconds on a cold kernel cache, under one on
        a warm one) before the first token.

        Returns:
            What the kernel warm-up did (kernels, seconds, compiled or loaded, or why the numpy
            kernels serve); the same report on later calls.

        Raises:
            FormatError, ConfigError: a resident tensor is missing, truncated or misshaped.
            StoreClosedError: the store is closed.
            As the executor's warm-up (a shard of another placement, a shard that does not answer).
        """
        if self._warmup_report is not None:  # warm: no lock on the per-call path
            return self._warmup_report
        async with self._warmup_lock:
            if self._warmup_report is not None:
                return self._warmup_report
            store = self._store
            store.check_running()  # StoreClosedError / wrong loop, before any work
            low = store.miss_tier_type
            report = await run_in_worker(warmup_kernels, store.layout, () if low is None else (low,))
            if not self._router.ready:
                await self._router.warmup()
            self._batcher.set_layers(list(store.layout.layers))
            await self._executor.warmup()
            self._warmup_report = report
            return report

    @property
    def residents(self) -> Mapping[int, ResidentLayer]:
        """Block index -> the layer's resident weights (after :meth:`warmup`).

        Raises:
            ConfigError: before :meth:`warmup` ran.
        """
        return self._router.residents

    @property
    def predictor(self) -> Predictor:
        """The predictor used for prefetching (after :meth:`warmup`).

        Raises:
            ConfigError: before :meth:`warmup` ran.
        """
        return self._router.predictor

    @property
    def record_trace(self) -> bool:
        """Whether routing decisions are recorded (:meth:`routing_trace`). Settable before :meth:`warmup`.

        Raises:
            ConfigError: (setting) not a bool, or a change after :meth:`warmup` ran.
        """
        return self._router.record_trace

    @record_trace.setter
    def record_trace(self, value: bool) -> None:
        self._router.record_trace = value

    def upcoming_layers(self, layer: int) -> list[int]:
        """The MoE layers prefetched while ``layer`` computes, nearest first.

        ``PrefetchOptions.depth`` of them, wrapping around after the last MoE layer to the next
        token's first layers, never ``layer`` itself.

        Raises:
            InvalidRequestError: ``layer`` is not a MoE layer.
        """
        return self._router.upcoming_layers(layer)

    def prefetch_token(self, token_ids: ArrayLike) -> int:
        """Start loading the experts the hash-routed layers give these tokens, without waiting.

        For a model whose first layers route by token id (DeepSeek-V4's ``hash_layer_count``) the
        experts of those layers are known exactly as soon as the next token is sampled: call this
        then, before its attention runs. Other models: nothing to do, returns 0.

        Args:
            token_ids: ``(n_tokens,)`` integer token ids (any integer array-like: a list, a numpy
                array of any integer dtype).

        Returns:
            The number of loads started.

        Raises:
            ConfigError: before :meth:`warmup` ran.
            InvalidRequestError: ``token_ids`` is not ``(n_tokens,)`` integers or an id is outside
                the vocabulary of the token tables.
            StoreClosedError: the store is closed.
        """
        token_ids = as_int_array(token_ids, "token_ids")
        router = self._router
        hash_layers = [layer for layer in self._store.layout.layers if self._store.hparams.is_hash_layer(layer)]
        ids = router.check_token_ids(hash_layers, token_ids, token_ids.shape[0])
        keys: list[Key] = []
        for layer in hash_layers:
            keys.extend((layer, e) for e in router.hash_experts(layer, ids) or ())
        return self._executor.prefetch(keys)

    # -- the seams a model drives ---------------------------------------------------------------

    def route_in_job(self, layer: int, x: np.ndarray, *, token_ids: ArrayLike | None = None) -> Routing:
        """:meth:`moe`'s routing of ``x`` (with the prefetch prediction), inside a caller's compute-pool job.

        For :class:`aioexperts.Model`, which routes in the job that computes the layer's attention
        and FFN norm (one hand-off per layer fewer); :meth:`warmup` must have run. Pass the result
        to :meth:`execute`.

        ``token_ids``: as :meth:`moe` (required in a hash-routed layer).

        Raises:
            InvalidRequestError: as :meth:`moe` (no such layer, a bad ``x``, a hash-routed layer
                without token ids).
        """
        router = self._router
        layer = self._store.layout.layer(layer).index
        ids = router.check_token_ids([layer], token_ids, len(x))
        return router.route(layer, x, token_ids=ids)

    def route_rows(
        self, layer: int, x: np.ndarray, token_ids: ArrayLike | None = None
    ) -> tuple[list[Routing | Exception], list[Key]]:
        """The router's :meth:`~aioexperts._router.Router.route_rows` (a compute-pool job): each decode
        row of ``x`` (one per sequence) routed as it is alone, and the step's prefetch. ``token_ids``:
        each row's token (required in a hash-routed layer)."""
        return self._router.route_rows(layer, x, token_ids)

    def prefetch_first(self, layer: int, x: np.ndarray) -> int:
        """Start loading what MoE layer ``layer`` is predicted to choose for ``x`` (loop thread).

        For the first MoE layer of a decode step, from the FFN norm of the token's embeddings,
        before any attention runs. Returns the loads started (0 when nothing is predicted or the
        executor reads nothing ahead).
        """
        return self._executor.prefetch(self._router.predict_first(layer, x))

    async def execute(self, layer: int, routing: Routing, stream: DecodeStream | None = None) -> np.ndarray:
        """The rest of :meth:`moe` after :meth:`route_in_job`: the executor's step, ``ffn_out``.

        Raises:
            As :meth:`moe`.
        """
        if stream is not None and not isinstance(stream, DecodeStream):
            raise InvalidRequestError(f"stream must be a DecodeStream (runner.decode_stream()), got {stream!r}")
        out, _, _ = await self._execute(self._store.layout.layer(layer).index, routing, stream)
        return out.ffn_out

    def hold_resident(self) -> AbstractContextManager[ResidentPass | None]:
        """``with runner.hold_resident() as held:`` -- a :class:`~aioexperts._executor.ResidentPass`
        when the executor computes from the local slab, no timeline is recorded and the slab has room
        for every routed expert (:meth:`aioexperts.ExpertStore.hold_resident`); else None.
        ``held.moe(layer, routing)`` then computes a layer of :meth:`route_in_job`'s routing inside the
        caller's compute job, without pins or awaits, the numbers of :meth:`execute_rows`, or says
        None when an expert it chose is not resident (go on with :meth:`execute_rows`). Enter and
        leave it on the event loop, around the compute job that uses it.

        Raises:
            StoreClosedError: the store is closed.
        """
        return self._executor.hold_resident()

    async def execute_rows(
        self,
        layer: int,
        rows: Sequence[Routing],
        prefetch: list[Key] | None = None,
        then: Callable[[list[np.ndarray | Exception]], Any] | None = None,
    ) -> tuple[list[np.ndarray | Exception], Any]:
        """One layer step of the routings ``rows`` (one per sequence: :meth:`route_in_job` of one
        sequence's rows, or :meth:`route_rows` of several sequences' decode rows): ``ffn_out``
        ``(n_rows, n_embd)`` per routing, or that routing's error (the forward pass of
        :class:`aioexperts.Model`). ``prefetch``: the step's prefetch (several rows' predictions for
        the next layer), up to an eighth of the slab, submitted with the first call's reads; None:
        the routings' own predictions.

        The rows go in executor steps of at most :data:`BATCH_MAX_CALLS`, run concurrently (one
        step's reads overlap another's compute); a step that fails as a whole is run again row by
        row, so one row's error is never another's. Each row's numbers are those it gets alone.

        ``then(ffn_outs)``, when given, runs once in a compute-pool worker with the per-routing
        results, inside the executor's last compute job where it can (the caller's next layer
        without a hand-off of its own): returns ``(ffn_outs, then's result)``; an exception ``then``
        raises is raised here, after the step. Without ``then`` the second item is None.
        """
        out: list[np.ndarray | Exception | None] = [None] * len(rows)
        box: dict[str, Any] = {}

        def ffn_outs(outcomes: Sequence[LayerOutcome]) -> list[np.ndarray | Exception]:
            return [o if isinstance(o, Exception) else o[0].ffn_out for o in outcomes]

        def call_then(outs: list[np.ndarray | Exception]) -> None:
            assert then is not None
            try:
                box["result"] = then(outs)
            except Exception as exc:
                box["error"] = exc

        def run_then(outcomes: list[LayerOutcome]) -> None:  # in the executor's last job
            call_then(ffn_outs(outcomes))

        counters = self._batcher.counters
        ahead: list[Key] | None = None
        if prefetch is not None:
            ahead = list(dict.fromkeys(prefetch))[: max(self._store.layout.n_expert_used, self._store.n_slots // 8)]
        executor = self._executor

        async def chunk(members: list[int], ahead: list[Key] | None, with_then: bool = False) -> None:
            calls = [rows[i] for i in members]
            if len(calls) > 1:
                counters.batches += 1
                counters.batched_calls += len(calls)
            outcomes: list[LayerOutcome]
            try:
                outcomes = await executor.run(layer, calls, ahead, run_then if with_then else None)
            except Exception as exc:
                outcomes = [exc]
                if len(calls) > 1:  # the step failed as a whole: each row alone
                    counters.retried_calls += len(calls)
                    outcomes = []
                    for call in calls:
                        try:
                            (one,) = await executor.run(layer, [call])
                        except Exception as err:
                            one = err
                        outcomes.append(one)
            for i, outcome in zip(members, ffn_outs(outcomes), strict=True):
                out[i] = outcome

        n = len(rows)
        n_chunks = -(-n // BATCH_MAX_CALLS)
        if n_chunks == 1:  # no task of its own; then in the executor's last job
            await chunk(list(range(n)), ahead, then is not None)
        else:
            async with anyio.create_task_group() as tg:
                for k in range(n_chunks):
                    members = list(range(n * k // n_chunks, n * (k + 1) // n_chunks))
                    tg.start_soon(chunk, members, ahead if k == 0 else [])
        assert all(o is not None for o in out)
        if then is not None and not box:  # several chunks, or the step was run again row by row
            await run_in_worker(call_then, out)
        if "error" in box:
            raise box["error"]
        return out, box.get("result")  # type: ignore[return-value]

    # -- one layer ------------------------------------------------------------------------------

    async def _execute(
        self, layer: int, routing: Routing, stream: DecodeStream | None = None
    ) -> tuple[MoEOutput, float, float]:
        """The layer through the executor: in a batch of decode streams, or alone."""
        if routing.plan is not None and self._batcher.wait and stream is not None and len(routing.x) <= BATCH_MAX_ROWS:
            return await self._batcher.submit(layer, routing, stream)
        (outcome,) = await self._executor.run(layer, [routing])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _run_batch(self, layer: int, calls: list[Routing]) -> list[LayerOutcome]:
        return await self._executor.run(layer, calls)

    async def _step_then(
        self, layer: int, x: np.ndarray, routing: Routing, compute: ComputeStep, then: Callable[[Any], Any]
    ) -> tuple[LayerStep, Any]:
        """A custom compute step of a single-group layer, with ``then(output)`` in the compute's job (one hand-off)."""
        group = routing.groups[0]
        step, after = await run_layer_step_then(
            self._store,
            layer,
            x,
            group.ids,
            routing.weights,
            group.experts,
            compute,
            then,
            prefetch=routing.prefetch,
            upcoming=self.upcoming_layers(layer),
        )
        self._executor.counters.add_step(step.io_wait_seconds, step.compute_seconds)
        return step, after

    def _advance(
        self,
        layer: int,
        x: np.ndarray,
        nxt: int | None,
        route_step: RouteStep | None,
        predictor: Predictor | None,
        token: int | None,
        token_ids: np.ndarray | None,
        y: object,
    ) -> tuple[np.ndarray, Routing | None]:
        """The next layer's input ``x + y`` and its routing (None after the last layer), in a worker."""
        x_next = _next_input(layer, x, y, True)
        if nxt is None:
            return x_next, None
        routed = self._router.route(
            nxt, x_next, route_step=route_step, predict=predictor is not None, predictor=predictor, token=token,
            token_ids=token_ids,
        )  # fmt: skip
        return x_next, routed

    # -- entry points ---------------------------------------------------------------------------

    def decode_stream(self) -> DecodeStream:
        """A stream for one decoding sequence: cross-request batching (``batch_wait``) takes the MoE
        steps of the streams that decode at the same moment together.

        Use ``with stream.forward():`` around each decode forward pass of the sequence and pass
        ``stream=`` to :meth:`moe` in it; the stream counts only inside its forward passes (and for
        the window after one, at the first MoE layer), so a sequence that stops decoding holds no
        one back. :class:`aioexperts.Model` does this for every sequence.

        Raises:
            ConfigError: batching is off (``batch_wait`` 0 or None).
        """
        if not self._batcher.wait:
            raise ConfigError("cross-request batching is off for this runner (batch_wait=0 or None)")
        return self._batcher.stream()

    @property
    def batching(self) -> bool:
        """Whether cross-request batching is on (``batch_wait`` > 0)."""
        return bool(self._batcher.wait)

    @property
    def batch_wait(self) -> float:
        """The batching window in seconds (0: off). Settable; a step already waiting keeps its deadline.

        Raises:
            ConfigError: (setting) not None and not seconds in 0..10.
        """
        return self._batcher.wait

    @batch_wait.setter
    def batch_wait(self, value: float | None) -> None:
        self._batcher.wait = check_batch_wait(value)

    async def moe(
        self, layer: int, x: np.ndarray, *, token_ids: ArrayLike | None = None, stream: DecodeStream | None = None
    ) -> np.ndarray:
        """Run MoE layer ``layer`` on ``x``: route, fetch the experts, compute (``ffn_out``).

        The router is resident; the chosen experts come through the store; the executor runs in
        a worker thread while the upcoming layers' predicted experts are prefetched.

        Args:
            layer: block index of a MoE layer.
            x: ``(n_tokens, n_embd)`` float32, the MoE block's input (after the FFN norm).
            token_ids: ``(n_tokens,)`` integer token ids of the rows of ``x`` (any integer
                array-like: a list, a numpy array of any integer dtype). Required in a layer
                that routes by token id (DeepSeek-V4's first ``hash_layer_count`` layers:
                ``MoEHParams.is_hash_layer``); elsewhere they let the prefetch of hash-routed layers
                ahead fetch exactly the experts those tokens will use.
            stream: the calling sequence's :meth:`decode_stream`, inside its ``forward()``: a call of
                up to ``BATCH_MAX_ROWS`` rows joins the other streams' step of this layer.

        Returns:
            ``(n_tokens, n_embd)`` float32: routed experts plus shared experts (llama.cpp's
            ``ffn_out``; add it to the residual stream).

        Raises:
            InvalidRequestError: no such layer, ``x`` has the wrong dtype or shape or holds NaN or
                inf, or finite values so large that the experts' output overflows float32;
                ``token_ids`` missing in a hash-routed layer, not ``(n_tokens,)`` integers, or an id
                outside the vocabulary (all checked before any expert is read).
            SlabExhaustedError, ExpertReadError, StoreClosedError: as
                :meth:`ExpertStore.experts`.

        Cancellation handling:
            As :meth:`ExpertStore.experts`; an executor call already running finishes in its
            thread first, with the experts still pinned.
        """
        return (await self.moe_result(layer, x, token_ids=token_ids, stream=stream)).ffn_out

    async def moe_result(
        self,
        layer: int,
        x: np.ndarray,
        *,
        prefetch: bool = True,
        token_ids: ArrayLike | None = None,
        stream: DecodeStream | None = None,
    ) -> MoEResult:
        """Like :meth:`moe`, returning the routing and every partial output.

        Args:
            layer: block index of a MoE layer.
            x: ``(n_tokens, n_embd)`` float32.
            prefetch: observe the routing and prefetch the upcoming layers' predicted experts.
            token_ids, stream: as :meth:`moe`.

        Raises:
            As :meth:`moe`.
        """
        if not isinstance(prefetch, bool):
            raise InvalidRequestError(f"prefetch must be True or False, got {prefetch!r}")
        if stream is not None and not isinstance(stream, DecodeStream):
            raise InvalidRequestError(f"stream must be a DecodeStream (runner.decode_stream()), got {stream!r}")
        await self.warmup()
        layer = self._store.layout.layer(layer).index
        n_rows = _n_rows(x)  # a bad x is refused by the router, before any read
        ids = None if n_rows is None else self._router.check_token_ids([layer], token_ids, n_rows)
        routed = await run_in_worker(functools.partial(self._router.route, layer, x, predict=prefetch, token_ids=ids))
        out, io_wait, compute_s = await self._execute(layer, routed, stream)
        return MoEResult(routed.ids, routed.weights, out.moe_out, out.shared_out, out.ffn_out, io_wait, compute_s)

    async def run_token(self, x: np.ndarray, **kwargs: Any) -> MoELayersResult:
        """Deprecated name of :meth:`run_moe_layers` (0.2; removed in the release after 0.3).

        It runs the MoE layers of a token, not a model forward pass; the new name says so.
        """
        warnings.warn(
            "MoERunner.run_token() is now MoERunner.run_moe_layers(); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self.run_moe_layers(x, **kwargs)

    async def run_moe_layers(
        self,
        x: np.ndarray,
        *,
        route_step: RouteStep | None = None,
        compute: ComputeStep | None = None,
        predictor: Predictor | None = None,
        prefetch: bool = True,
        token_ids: ArrayLike | None = None,
    ) -> MoELayersResult:
        """Run every MoE layer for one token (or a batch), in order, with prefetch ahead.

        A driver for measuring the I/O and compute overlap with any compute step: layer ``N+1``
        gets ``x + y`` of layer ``N`` (a residual stream without attention), so it is not a model
        forward pass. Per-token latency and the token count go into :meth:`statistics`.

        Args:
            x: ``(n_tokens, n_embd)`` float32 input of the first MoE layer.
            route_step: ``(layer, x) -> (ids, weights)``; default: the layer's resident router.
            compute: the compute step (see ``ComputeStep``); default: the executor (a batch
                larger than the slab runs in groups, as in :meth:`moe`). A custom step must fit
                each layer's experts in the slab.
            predictor: overrides the runner's predictor for this call.
            prefetch: prefetch the upcoming layers' predicted experts (a hash-routed layer ahead:
                exactly the experts ``token_ids`` give).
            token_ids: ``(n_tokens,)`` integer token ids of the rows of ``x``; required when the
                model has hash-routed layers (as :meth:`moe`) and no ``route_step`` is given.

        Raises:
            As :meth:`moe`.
        """
        t0 = time.perf_counter()
        if route_step is not None and not callable(route_step):
            raise InvalidRequestError(f"route_step must be a callable (layer, x) -> (ids, weights), got {route_step!r}")
        if compute is not None and not callable(compute):
            raise InvalidRequestError(f"compute must be a ComputeStep callable, got {compute!r}")
        if predictor is not None and not isinstance(predictor, Predictor):
            raise InvalidRequestError(f"predictor must be an aioexperts.predictors.Predictor, got {predictor!r}")
        if not isinstance(prefetch, bool):
            raise InvalidRequestError(f"prefetch must be True or False, got {prefetch!r}")
        await self.warmup()
        if compute is not None and not self._executor.local:
            raise ConfigError(
                f"a {type(self).__name__} computes the experts on {type(self._executor).__name__}: "
                "a custom compute step cannot run"
            )
        router = self._router
        layers = list(self._store.layout.layers) if route_step is None else []
        n_rows = _n_rows(x)  # a bad x is refused by the first layer's routing, before any read
        ids = None if n_rows is None else router.check_token_ids(layers, token_ids, n_rows)
        chosen = (predictor or router.predictor) if prefetch else None
        token = router.reserve_trace(len(x)) if isinstance(x, np.ndarray) and x.ndim == 2 else None
        steps = []
        moe_layers = list(self._store.layout.layers)
        routed: Routing | None = None
        for i, layer in enumerate(moe_layers):
            if routed is None:
                routed = await run_in_worker(
                    functools.partial(
                        router.route, layer, x, route_step=route_step, predict=chosen is not None, predictor=chosen,
                        token=token, token_ids=ids,
                    )
                )  # fmt: skip
            if compute is None:
                out, io_wait, compute_s = await self._execute(layer, routed)
                step = LayerStep(layer, routed.ids, routed.weights, out.ffn_out, io_wait, compute_s)
                x = await run_in_worker(_next_input, layer, x, step.output, False)  # the residual stream
                routed = None
            elif len(routed.groups) == 1:  # the residual add and the next route ride on the compute's job
                nxt = moe_layers[i + 1] if i + 1 < len(moe_layers) else None
                advance = functools.partial(self._advance, layer, x, nxt, route_step, chosen, token, ids)
                step, (x, routed) = await self._step_then(layer, x, routed, compute, advance)
            else:
                raise SlabExhaustedError(
                    f"layer {layer}: the batch chose {sum(len(g.experts) for g in routed.groups)} experts, more "
                    f"than the {self._store.n_slots} slots; a custom compute step must fit in the slab"
                )
            steps.append(step)
        seconds = time.perf_counter() - t0
        self._counters.tokens += len(x)
        self._counters.token_latency.add(seconds)
        return MoELayersResult(x, tuple(steps), seconds)

    # -- records --------------------------------------------------------------------------------

    def record_timeline(self, timeline: Timeline | None) -> None:
        """Record from now on into ``timeline`` (an :class:`aioexperts.Timeline`; None stops): every
        layer step of the local executor (when it started, had its experts, computed, ended, and
        how long it stalled on reads) and every expert load of the store (when it was queued,
        submitted, completed), whatever I/O backend reads it. Mark the tokens with
        :meth:`Timeline.begin_token` and :meth:`Timeline.end_token` around each forward pass.

        A layer step of more experts than the slab holds (run group by group), a custom compute
        step of :meth:`run_moe_layers`, and the shards of ``aioexperts.distributed`` are not recorded;
        in page-cache mode no load is.

        Raises:
            ConfigError: ``timeline`` is not a Timeline or None.
            StoreClosedError: the store is closed or not started.
        """
        self._store.record_timeline(timeline)  # checks the argument and the store first
        self._executor.timeline = timeline

    def routing_trace(self) -> RoutingTrace:
        """Every routing decision recorded so far (``record_trace=True``).

        Raises:
            ConfigError: the runner was made without ``record_trace=True``.
        """
        return self._router.routing_trace()

    def statistics(self) -> RunnerStatistics:
        """A frozen snapshot of the runner's counters (the store has its own: I/O and cache)."""
        c = self._executor.counters
        b = self._batcher.counters
        t = self._counters
        return RunnerStatistics(
            layer_steps=c.layer_steps,
            tokens=t.tokens,
            io_wait_seconds=c.io_wait_seconds,
            compute_seconds=c.compute_seconds,
            token_latency_p50_ms=to_ms(t.token_latency.percentile(50)),
            token_latency_p99_ms=to_ms(t.token_latency.percentile(99)),
            calls=c.calls,
            experts_per_step=c.experts / c.executor_steps if c.executor_steps else None,
            rows_per_step=c.rows / c.executor_steps if c.executor_steps else None,
            batches=b.batches,
            batched_calls=b.batched_calls,
            retried_calls=b.retried_calls,
            batch_window_seconds=b.window_seconds,
            hits_first_steps=c.hits_first_steps,
            stall_seconds=c.stall_seconds,
        )

    def __repr__(self) -> str:
        return f"<aioexperts.MoERunner over {self._store!r}>"


def _n_rows(x: object) -> int | None:
    """Rows of a 2-D array ``x`` (no scan of its values), or None."""
    return int(x.shape[0]) if isinstance(x, np.ndarray) and x.ndim == 2 else None


def _next_input(layer: int, x: np.ndarray, y: object, custom: bool) -> np.ndarray:
    """``x + y``, the next layer's input; a custom compute step's ``y`` is checked first (worker thread)."""
    if custom:
        _check_output(layer, y, x)
    assert isinstance(y, np.ndarray)
    return x + y


def _check_output(layer: int, y: object, x: np.ndarray) -> None:
    """A custom compute step's output: float32 of ``x``'s shape, finite."""
    if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.shape != x.shape:
        raise InvalidRequestError(
            f"layer {layer}: the compute step must return a float32 array of shape {x.shape}, got {describe(y)}"
        )
    bad = np.logical_not(np.isfinite(y).all(axis=1))
    if bad.any():
        raise InvalidRequestError(f"layer {layer}: the compute step returned NaN or inf in token rows {rows_text(bad)}")
