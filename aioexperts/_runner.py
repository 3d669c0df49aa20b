"""The MoE runner: routes, fetches experts through an expert store, computes, prefetches ahead.

An :class:`MoERunner` holds what a model needs besides the streamed experts (the resident routers,
biases and shared experts), the prefetch predictor and the routing trace. Every entry point
(:meth:`~MoERunner.moe`, :meth:`~MoERunner.moe_result`, :meth:`~MoERunner.run_moe_layers`) goes through
one layer step: route and predict in a worker thread, pin the experts and start the prefetch of
the upcoming layers, compute in a worker thread, unpin.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from numpy.typing import ArrayLike

from ._batch import DEFAULT_BATCH_WAIT, DecodeStream, LayerBatcher, check_batch_wait
from ._cache.cache import Key
from ._cache.stats import LatencyWindow, to_ms
from ._checks import as_int_array, check_activations, check_int, describe
from ._compute.fused import WarmupReport
from ._compute.moe import (
    ExpertOutputs,
    MoEOutput,
    MoEPlan,
    ResidentLayer,
    check_token_ids,
    combine_moe,
    expert_outputs,
    moe_forward,
    plan_moe,
    route,
)
from ._compute.pool import compute_pool
from ._compute.resident import load_residents, warmup_kernels
from ._errors import ConfigError, InvalidRequestError, SlabExhaustedError
from ._format.layout import MoELayer
from ._format.views import ExpertView
from ._pipeline import ComputeStep, LayerStep, MoELayersResult, run_in_worker, run_layer_step, run_layer_step_then
from ._predict.predictors import PREDICTORS, Predictor, make_predictor
from ._predict.trace import RoutingTrace, TraceRecorder
from ._store import ExpertStore

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

HITS_FIRST_MIN_MISSES = 2
"""A layer step splits into hits first, then misses, only with at least this many misses
(and at least as many as the compute pool has workers): :func:`hits_first_pays`."""

DEFAULT_TRACE_MAX_TOKENS = 1 << 16
"""Tokens a runner's routing trace keeps (the most recent ones)."""

log = logging.getLogger("aioexperts")

#: ``route_step(layer, x) -> (ids, weights)``: a custom router, run in a worker thread; ``ids`` and
#: ``weights`` are ``(n_tokens, k)`` int32 and float32.
RouteStep = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchOptions:
    """What an :class:`~aioexperts.MoERunner` loads ahead while a layer computes.

    Attributes:
        predictor: ``"router"`` (the next layer's router on the current MoE input), ``"previous"``
            (the previous token's choice), ``"frequency"`` (decayed per-layer counts), ``"none"``,
            or a :class:`~aioexperts.predictors.Predictor` instance.
        budget: experts prefetched per predicted layer; None for the model's ``expert_used_count``.
        depth: MoE layers prefetched ahead (default 2: the device queue never runs dry at a layer
            boundary; 1 synchronises I/O and compute at every layer; 0 turns prefetch off).

    Raises:
        ConfigError: a value out of range or of the wrong type.
    """

    predictor: str | Predictor = "router"
    budget: int | None = None
    depth: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.predictor, str):
            if self.predictor not in PREDICTORS:
                raise ConfigError(
                    f"predictor must be one of {', '.join(sorted(PREDICTORS))} or a Predictor, got {self.predictor!r}"
                )
        elif not isinstance(self.predictor, Predictor):
            raise ConfigError(f"predictor must be a predictor name or a Predictor, got {self.predictor!r}")
        check_int(self, "budget", low=0, optional=True)
        check_int(self, "depth", low=0)


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


@dataclass(slots=True)
class _Counters:
    layer_steps: int = 0
    tokens: int = 0
    io_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    token_latency: LatencyWindow = dataclasses.field(default_factory=LatencyWindow)
    executor_steps: int = 0
    calls: int = 0
    experts: int = 0
    rows: int = 0
    hits_first_steps: int = 0


@dataclass(frozen=True, slots=True)
class _Group:
    """Experts of one layer step that fit in the slab, and the ids with every other expert ``-1``."""

    experts: list[int]
    ids: np.ndarray


@dataclass(frozen=True, slots=True)
class _Routed:
    ids: np.ndarray
    weights: np.ndarray
    groups: list[_Group]
    prefetch: list[Key]
    plan: MoEPlan | None = None  # the executor's plan when the experts fit in the slab at once


#: one call's outcome in a layer step: (output, io_wait_seconds, compute_seconds), or its error
_Outcome = tuple[MoEOutput, float, float] | Exception


class MoERunner:
    """Runs the MoE layers of the model in ``store``: route, fetch, compute, prefetch ahead.

    Example::

        async with aioexperts.open("model.gguf", slots=256) as store:
            runner = aioexperts.MoERunner(store)
            y = await runner.moe(layer, x)   # x: (n_tokens, n_embd) float32

    Args:
        store: a started :class:`~aioexperts.ExpertStore`; the runner never closes it.
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
            result does not change: the slots are summed in slot order).

    Raises:
        ConfigError: a bad argument.

    Concurrency: several tasks may await one runner at once; their numpy work runs in worker
    threads and the predictor and trace are updated under a lock.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        prefetch: PrefetchOptions | None = None,
        record_trace: bool = False,
        trace_max_tokens: int = DEFAULT_TRACE_MAX_TOKENS,
        batch_wait: float | None = DEFAULT_BATCH_WAIT,
        hits_first: bool = True,
    ) -> None:
        if not isinstance(store, ExpertStore):
            raise ConfigError(f"store must be an ExpertStore (from aioexperts.open), got {store!r}")
        if prefetch is not None and not isinstance(prefetch, PrefetchOptions):
            raise ConfigError(f"prefetch must be a PrefetchOptions, got {prefetch!r}")
        if not isinstance(record_trace, bool):
            raise ConfigError(f"record_trace must be True or False, got {record_trace!r}")
        if isinstance(trace_max_tokens, bool) or not isinstance(trace_max_tokens, int) or trace_max_tokens < 1:
            raise ConfigError(f"trace_max_tokens must be an int >= 1, got {trace_max_tokens!r}")
        wait = check_batch_wait(batch_wait)
        if not isinstance(hits_first, bool):
            raise ConfigError(f"hits_first must be True or False, got {hits_first!r}")
        self.hits_first = hits_first
        self._store = store
        self.prefetch_options = prefetch or PrefetchOptions()
        self._record_trace = record_trace
        self._trace_max_tokens = trace_max_tokens
        self._recorder: TraceRecorder | None = None
        self._residents: dict[int, ResidentLayer] | None = None
        self._warmup_report: WarmupReport | None = None
        self._residents_lock = anyio.Lock()
        self._predictor: Predictor | None = None
        self._state_lock = threading.Lock()  # predictor and trace: observed from worker threads
        self._counters = _Counters()
        self._upcoming: dict[int, list[int]] = {}  # layer -> upcoming_layers(layer)
        self._batcher: LayerBatcher[_Call, tuple[MoEOutput, float, float]] = LayerBatcher(
            wait, self._run_batch, BATCH_MAX_CALLS
        )

    @property
    def store(self) -> ExpertStore:
        """The expert store this runner reads from."""
        return self._store

    # -- start-up -------------------------------------------------------------------------------

    async def warmup(self) -> WarmupReport:
        """Load (once) what computing needs: the compute kernels of the model's ggml types
        (compiled, or loaded from the on-disk kernel cache: ``docs/executor.md``), the resident
        weights of every MoE layer, the predictor.

        Runs the blocking work on the compute pool; :meth:`moe` and :meth:`run_moe_layers` call it on
        first use, so call it yourself to pay the cost (seconds on a cold kernel cache, under one on
        a warm one) before the first token.

        Returns:
            What the kernel warm-up did (kernels, seconds, compiled or loaded, or why the numpy
            kernels serve); the same report on later calls.

        Raises:
            FormatError, ConfigError: a resident tensor is missing, truncated or misshaped.
            StoreClosedError: the store is closed.
        """
        async with self._residents_lock:
            if self._residents is not None:
                assert self._warmup_report is not None
                return self._warmup_report
            store = self._store
            store.check_running()  # StoreClosedError / wrong loop, before any work
            hparams = store.hparams
            if not hparams.verified:
                log.warning(
                    "architecture %r is not one whose MoE routing was checked against llama.cpp; computing "
                    "with the generic rules (gating and normalisation from the metadata, SwiGLU experts): "
                    "outputs may differ from llama.cpp",
                    hparams.arch,
                )
            report = await run_in_worker(warmup_kernels, store.layout)
            residents = await run_in_worker(load_residents, store.model, store.layout, hparams)
            if self._record_trace:
                layout = store.layout
                self._recorder = TraceRecorder(
                    list(layout.layers),
                    [m.n_experts for m in layout.layers.values()],
                    layout.n_expert_used,
                    metadata={"model": os.path.basename(store.path)},
                    max_tokens=self._trace_max_tokens,
                    keep_last=True,
                )
            self._predictor = self._make_predictor(residents)
            self._batcher.set_layers(list(store.layout.layers))
            self._warmup_report = report
            self._residents = residents
            return report

    def _make_predictor(self, residents: Mapping[int, ResidentLayer]) -> Predictor:
        arg = self.prefetch_options.predictor
        if not isinstance(arg, str):
            return arg
        if arg == "router":
            return make_predictor("router", residents=residents, hparams=self._store.hparams)
        return make_predictor(arg)

    @property
    def residents(self) -> Mapping[int, ResidentLayer]:
        """Block index -> the layer's resident weights (after :meth:`warmup`).

        Raises:
            ConfigError: before :meth:`warmup` ran.
        """
        if self._residents is None:
            raise ConfigError("the resident weights are not loaded yet: await runner.warmup() first")
        return self._residents

    @property
    def predictor(self) -> Predictor:
        """The predictor used for prefetching (after :meth:`warmup`).

        Raises:
            ConfigError: before :meth:`warmup` ran.
        """
        if self._predictor is None:
            raise ConfigError("the predictor is built by warmup(): await runner.warmup() first")
        return self._predictor

    # -- layer order ----------------------------------------------------------------------------

    def upcoming_layers(self, layer: int) -> list[int]:
        """The MoE layers prefetched while ``layer`` computes, nearest first.

        ``PrefetchOptions.depth`` of them, wrapping around after the last MoE layer to the next
        token's first layers, never ``layer`` itself.

        Raises:
            InvalidRequestError: ``layer`` is not a MoE layer.
        """
        found = self._upcoming.get(layer)
        if found is None:  # twice per layer step on the hot path: worked out once per layer
            layers = list(self._store.layout.layers)
            i = layers.index(self._store.layout.layer(layer).index)
            depth = min(self.prefetch_options.depth, len(layers) - 1)
            found = self._upcoming[layer] = [layers[(i + d) % len(layers)] for d in range(1, depth + 1)]
        return list(found)

    # -- one layer ------------------------------------------------------------------------------

    def _route(
        self,
        layer: int,
        x: np.ndarray,
        route_step: RouteStep | None,
        predictor: Predictor | None,
        token: int | None = None,
        token_ids: np.ndarray | None = None,
    ) -> _Routed:
        """Check ``x``, route and predict (worker thread)."""
        _check_x(x, self._store.hparams.n_embd)
        if route_step is None:
            with np.errstate(over="ignore", invalid="ignore"):  # finite x, logits out of range: refused below
                ids, weights = route(x, self.residents[layer], self._store.hparams, token_ids)
            bad = np.logical_not(np.isfinite(weights).all(axis=1))
            if bad.any():
                raise InvalidRequestError(
                    f"layer {layer}: the router's output is not finite for token rows {_rows(bad)} "
                    "(x too large for float32 logits?)"
                )
        else:
            got = route_step(layer, x)
            if not isinstance(got, tuple) or len(got) != 2:
                raise InvalidRequestError(f"layer {layer}: route_step must return (ids, weights), got {describe(got)}")
            ids, weights = _check_routing(layer, *got, len(x), self._store.layout.layer(layer))
        unique = list(dict.fromkeys(ids[ids >= 0].tolist()))
        limit = self._store.n_slots
        if len(unique) <= limit:
            groups = [_Group(unique, ids)]
        else:  # a batch choosing more experts than the slab holds runs in groups
            groups = [
                _Group(part, np.where(np.isin(ids, part), ids, -1).astype(ids.dtype))
                for part in (unique[i : i + limit] for i in range(0, len(unique), limit))
            ]
        prefetch: list[Key] = []
        budget = self.prefetch_options.budget
        budget = self._store.layout.n_expert_used if budget is None else budget
        with self._state_lock:
            if self._recorder is not None:
                if token is None:  # moe(): appended at this layer's rows
                    self._recorder.record(layer, ids)
                else:  # run_moe_layers(): the rows reserved for this call's tokens
                    self._recorder.record_token(layer, ids, token)
            if predictor is not None:
                predictor.observe(layer, x, ids)
                if budget:
                    for nxt in self.upcoming_layers(layer):
                        known = self._hash_experts(nxt, token_ids) if nxt > layer else None  # same tokens
                        if known is not None:  # a hash-routed layer ahead: its experts are certain
                            prefetch.extend((nxt, e) for e in known)
                        else:
                            prefetch.extend((nxt, e) for e in _predicted(predictor, layer, nxt, x, budget))
        plan = plan_moe(x, ids, weights, self.residents[layer], self._store.hparams) if len(groups) == 1 else None
        return _Routed(ids, weights, groups, prefetch, plan)

    def _prefetch_for(self, layer: int, x: np.ndarray) -> int:
        """Start loading the experts the predictor expects MoE layer ``layer`` to choose for ``x``.

        For :class:`aioexperts.Model`, which calls it with the FFN norm of the block's input before
        the block's attention runs (the first MoE layer of a decode step: the layers before the
        token gave no input to predict it from). The predictor is asked as at the layer before
        (``predict(previous MoE layer, layer, x, budget)``). Loop thread; :meth:`warmup` must have
        run. Returns the number of loads started (0 without a predictor or budget).
        """
        predictor = self._predictor
        budget = self.prefetch_options.budget
        budget = self._store.layout.n_expert_used if budget is None else budget
        if predictor is None or not budget or not self.prefetch_options.depth:
            return 0
        layers = list(self._store.layout.layers)
        before = layers[layers.index(layer) - 1]  # the last MoE layer for the first
        with self._state_lock:
            got = _predicted(predictor, before, layer, x, budget)
        return self._store.prefetch([(layer, e) for e in got]) if got else 0

    def _hash_experts(self, layer: int, token_ids: np.ndarray | None) -> list[int] | None:
        """The distinct experts hash-routed ``layer`` gives ``token_ids`` (slot order), or None when
        the layer routes by its router or the ids are not known."""
        if token_ids is None or not self._store.hparams.is_hash_layer(layer):
            return None
        table = self.residents[layer].token_experts
        if table is None:
            return None
        return list(dict.fromkeys(table[token_ids].reshape(-1).tolist()))

    def _checked_token_ids(self, layers: Sequence[int], token_ids: object, n_tokens: int) -> np.ndarray | None:
        """``token_ids`` checked against every hash-routed layer of ``layers``, before any read."""
        hparams = self._store.hparams
        for layer in layers:
            table = self.residents[layer].token_experts if hparams.is_hash_layer(layer) else None
            if table is not None:
                return check_token_ids(token_ids, n_tokens, table.shape[0], layer)
        if token_ids is None:
            return None
        return as_int_array(token_ids, "token_ids", (n_tokens,))

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
        n_tokens = token_ids.shape[0]
        hash_layers = [layer for layer in self._store.layout.layers if self._store.hparams.is_hash_layer(layer)]
        ids = self._checked_token_ids(hash_layers, token_ids, n_tokens)
        keys: list[Key] = []
        for layer in hash_layers:
            keys.extend((layer, e) for e in self._hash_experts(layer, ids) or ())
        return self._store.prefetch(keys) if keys else 0

    async def _step(
        self, layer: int, x: np.ndarray, weights: np.ndarray, group: _Group, compute: ComputeStep, prefetch: list[Key]
    ) -> LayerStep:
        step = await run_layer_step(
            self._store,
            layer,
            x,
            group.ids,
            weights,
            group.experts,
            compute,
            prefetch=prefetch,
            upcoming=self.upcoming_layers(layer),
        )
        c = self._counters
        c.layer_steps += 1
        c.io_wait_seconds += step.io_wait_seconds
        c.compute_seconds += step.compute_seconds
        return step

    async def _step_then(
        self, layer: int, x: np.ndarray, routed: _Routed, compute: ComputeStep, then: Callable[[Any], Any]
    ) -> tuple[LayerStep, Any]:
        """:meth:`_step` of a single-group layer, with ``then(output)`` in the compute's job (one hand-off)."""
        group = routed.groups[0]
        step, after = await run_layer_step_then(
            self._store,
            layer,
            x,
            group.ids,
            routed.weights,
            group.experts,
            compute,
            then,
            prefetch=routed.prefetch,
            upcoming=self.upcoming_layers(layer),
        )
        c = self._counters
        c.layer_steps += 1
        c.io_wait_seconds += step.io_wait_seconds
        c.compute_seconds += step.compute_seconds
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
    ) -> tuple[np.ndarray, _Routed | None]:
        """The next layer's input ``x + y`` and its routing (None after the last layer), in a worker."""
        x_next = _next_input(layer, x, y, True)
        return x_next, None if nxt is None else self._route(nxt, x_next, route_step, predictor, token, token_ids)

    async def _executor_layer(
        self, layer: int, x: np.ndarray, routed: _Routed, stream: DecodeStream | None = None
    ) -> tuple[MoEOutput, float, float]:
        """The layer through the executor: in a batch of decode streams, alone, or (a batch of
        tokens choosing more experts than the slab holds) group by group, the groups' sums added."""
        if routed.plan is not None:
            call = _Call(routed)
            if self._batcher.wait and stream is not None and len(x) <= BATCH_MAX_ROWS:
                return await self._batcher.submit(layer, call, stream)
            (outcome,) = await self._run_calls(layer, [call])
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        resident, hparams = self.residents[layer], self._store.hparams
        outputs: list[MoEOutput] = []
        io_wait = compute_s = 0.0
        for g, group in enumerate(routed.groups):
            group_resident = resident if g == 0 else _without_shared(resident)

            def compute(
                _layer: int,
                xx: np.ndarray,
                views: Mapping[int, ExpertView],
                ii: np.ndarray,
                ww: np.ndarray,
                _resident: ResidentLayer = group_resident,
            ) -> MoEOutput:
                with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, not warned
                    out = moe_forward(xx, ii, ww, views, _resident, hparams)
                _check_finite(_layer, out.ffn_out, xx)
                return out

            last = g == len(routed.groups) - 1
            step = await self._step(layer, x, routed.weights, group, compute, routed.prefetch if last else [])
            outputs.append(step.output)
            io_wait += step.io_wait_seconds
            compute_s += step.compute_seconds
        if len(outputs) == 1:
            return outputs[0], io_wait, compute_s
        out = await run_in_worker(_sum_groups, outputs)
        return out, io_wait, compute_s

    async def _run_batch(self, layer: int, calls: list[_Call]) -> list[_Outcome]:
        return await self._run_calls(layer, calls)

    async def _run_calls(self, layer: int, calls: list[_Call], prefetch: list[Key] | None = None) -> list[_Outcome]:
        """One layer step for ``calls`` (each fits the slab): pin the union of their experts once,
        prefetch (``prefetch``, else :func:`_batch_prefetch` of the calls' predictions), compute
        every call's rows (resident experts first), one outcome per call.

        Raises:
            SlabExhaustedError, ExpertReadError, StoreClosedError, InvalidRequestError: the step
                failed as a whole (a call's non-finite output is that call's outcome instead).
        """
        store = self._store
        experts = list(dict.fromkeys(e for c in calls for e in c.routed.groups[0].experts))
        if prefetch is None:
            prefetch = _batch_prefetch([c.routed.prefetch for c in calls])
        wanted = {(layer, e) for e in experts}
        ahead = set(self.upcoming_layers(layer)) - {layer}
        store.drop_prefetches(keep=lambda key: key in wanted or key[0] in ahead)
        plans = [c.plan for c in calls]
        t0 = time.perf_counter()
        resident = store.resident(layer, experts)
        misses = [e for e, ready in zip(experts, resident, strict=True) if not ready]
        if misses or prefetch:
            # the layer's misses first, then the prefetch of the layers ahead, submitted now as one
            # batch: before any compute job of this step holds the cores (and the GIL) the event
            # loop needs to submit them
            store.start_loads(layer, experts, prefetch=prefetch)
            prefetch = []
        hits: list[int] = []
        if self.hits_first and len(experts) > 1 and misses and len(misses) < len(experts):
            hits = [e for e, ready in zip(experts, resident, strict=True) if ready]
            if not hits_first_pays(len(hits), len(misses), compute_pool().n_threads, batched=len(calls) > 1):
                hits = []  # one compute job after the reads
        outcomes: list[_Outcome]
        note = self._batcher.note
        if hits:
            parts, io_wait, compute_s = await self._hits_first(layer, plans, hits, experts, prefetch, t0)
        else:  # the experts' compute and each call's sum in one compute-pool job (one hand-off, not two)
            async with store.experts(layer, experts, prefetch=prefetch) as views:
                io_wait = time.perf_counter() - t0
                note("read", layer, len(calls))
                outcomes, compute_s = await run_in_worker(_outputs_combined, layer, plans, experts, views, io_wait)
        if hits:
            outcomes = await run_in_worker(_combine_calls, layer, plans, parts, io_wait, compute_s)
        note("computed", layer, len(calls))
        c = self._counters
        c.layer_steps += 1
        c.executor_steps += 1
        c.calls += len(calls)
        c.experts += len(experts)
        c.rows += sum(len(p.x) for p in plans)
        c.hits_first_steps += bool(hits)
        c.io_wait_seconds += io_wait
        c.compute_seconds += compute_s
        return outcomes

    async def _hits_first(
        self,
        layer: int,
        plans: list[MoEPlan],
        hits: list[int],
        experts: list[int],
        prefetch: list[Key],
        t0: float,
    ) -> tuple[list[list[ExpertOutputs]], float, float]:
        """The resident experts (``hits``) computed while the others are read, in a child task.

        The hits are pinned first (no read: pinning does not wait), so the others' loads cannot
        evict them; they are unpinned as soon as their compute is done, so this task never waits
        for slots while holding pins.
        """
        store = self._store
        hit_set = set(hits)
        misses = [e for e in experts if e not in hit_set]
        done: dict[str, Any] = {}

        async def read_misses() -> None:
            try:
                async with store.experts(layer, misses, prefetch=prefetch) as views:
                    done["io_wait"] = time.perf_counter() - t0
                    self._batcher.note("read", layer, len(plans))
                    done["misses"] = await run_in_worker(_timed_outputs, plans, misses, views, False)
            except Exception as exc:  # re-raised below as itself, not in an exception group
                done["error"] = exc

        async with anyio.create_task_group() as tg:
            try:
                async with store.experts(layer, hits) as views:  # resident: pinned without waiting
                    tg.start_soon(read_misses)
                    found, hit_s = await run_in_worker(_timed_outputs, plans, hits, views, True)
            except Exception as exc:
                done.setdefault("error", exc)
                tg.cancel_scope.cancel()
        if "error" in done:
            raise done["error"]
        miss_found, miss_s = done["misses"]
        parts = [[h, m] for h, m in zip(found, miss_found, strict=True)]
        return parts, done["io_wait"], hit_s + miss_s

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
        n_rows = _n_rows(x)  # a bad x is refused by _route, before any read
        ids = None if n_rows is None else self._checked_token_ids([layer], token_ids, n_rows)
        routed = await run_in_worker(self._route, layer, x, None, self._predictor if prefetch else None, None, ids)
        out, io_wait, compute_s = await self._executor_layer(layer, x, routed, stream)
        return MoEResult(routed.ids, routed.weights, out.moe_out, out.shared_out, out.ffn_out, io_wait, compute_s)

    def _route_in_job(self, layer: int, x: np.ndarray) -> _Routed:
        """:meth:`moe`'s routing of ``x`` (with the prefetch prediction), run inside a caller's compute-pool job.

        For :class:`aioexperts.Model`, which routes in the job that computes the layer's attention
        and FFN norm (one hand-off per layer fewer); :meth:`warmup` must have run. Pass the result
        to :meth:`_moe_routed`.

        Raises:
            InvalidRequestError: as :meth:`moe` (no such layer, a bad ``x``, a hash-routed layer,
                which needs token ids).
        """
        assert self._residents is not None, "MoERunner.warmup() has not run"
        layer = self._store.layout.layer(layer).index
        ids = self._checked_token_ids([layer], None, len(x))
        return self._route(layer, x, None, self._predictor, None, ids)

    def _route_rows(self, layer: int, x: np.ndarray) -> tuple[list[_Routed | Exception], list[Key]]:
        """:meth:`_route_in_job` of ``n`` decode rows of different sequences at once (a compute-pool job).

        The router product runs once for all rows through a batch-invariant kernel and the selection
        is per row, so each row's experts and weights are bit for bit those it gets alone; the next
        MoE layer is predicted once for all rows (up to one budget per row; only the nearest layer:
        the rows' predictions for two layers ahead, all prefetched, read 1.2x the bytes per token
        with spread routing and 4 sequences in development runs, for fewer tokens per second).
        Returns each row's routing (or its own error: a router output that is not finite) and the
        step's prefetch.

        Raises:
            InvalidRequestError: as :meth:`_route_in_job`.
        """
        assert self._residents is not None, "MoERunner.warmup() has not run"
        layer = self._store.layout.layer(layer).index
        n = len(x)
        self._checked_token_ids([layer], None, n)
        _check_x(x, self._store.hparams.n_embd)
        resident, hparams = self.residents[layer], self._store.hparams
        with np.errstate(over="ignore", invalid="ignore"):  # finite x, logits out of range: refused below
            ids, weights = route(x, resident, hparams, None, invariant=True)
        good = np.isfinite(weights).all(axis=1)
        out: list[_Routed | Exception] = []
        for i in range(n):
            if not good[i]:
                out.append(
                    InvalidRequestError(
                        f"layer {layer}: the router's output is not finite (x too large for float32 logits?)"
                    )
                )
                continue
            row_ids, row_w = ids[i : i + 1], weights[i : i + 1]
            unique = list(dict.fromkeys(row_ids[row_ids >= 0].tolist()))
            plan = plan_moe(x[i : i + 1], row_ids, row_w, resident, hparams)
            out.append(_Routed(row_ids, row_w, [_Group(unique, row_ids)], [], plan))
        prefetch: list[Key] = []
        budget = self.prefetch_options.budget
        budget = self._store.layout.n_expert_used if budget is None else budget
        kept = np.flatnonzero(good)
        with self._state_lock:
            if self._recorder is not None and len(kept):
                self._recorder.record(layer, ids[kept])
            if self._predictor is not None and len(kept):
                self._predictor.observe(layer, x[kept], ids[kept])
                if budget:
                    for nxt in self.upcoming_layers(layer)[:1]:
                        got = _predicted(self._predictor, layer, nxt, x[kept], budget * len(kept))
                        prefetch.extend((nxt, e) for e in got)
        return out, prefetch

    async def _moe_routed(
        self, layer: int, x: np.ndarray, routed: _Routed, stream: DecodeStream | None = None
    ) -> np.ndarray:
        """The rest of :meth:`moe` after :meth:`_route_in_job`: fetch the experts, compute, ``ffn_out``."""
        if stream is not None and not isinstance(stream, DecodeStream):
            raise InvalidRequestError(f"stream must be a DecodeStream (runner.decode_stream()), got {stream!r}")
        out, _, _ = await self._executor_layer(self._store.layout.layer(layer).index, x, routed, stream)
        return out.ffn_out

    async def _moe_rows(self, layer: int, rows: Sequence[_Routed], prefetch: list[Key]) -> list[np.ndarray | Exception]:
        """One layer step of several sequences' decode rows, routed by :meth:`_route_rows`:
        ``ffn_out`` ``(1, n_embd)`` per row, or that row's error (a batched decode step of
        :class:`aioexperts.Model`). ``prefetch``: the step's prefetch (its rows' predictions for the
        next layer), up to an eighth of the slab, submitted with the first call's reads.

        The rows go in calls of at most :data:`BATCH_MAX_CALLS`, run concurrently (one call's
        reads overlap another's compute); each reads the union of its rows' experts once and
        computes each expert once for all its rows (:meth:`_run_calls`). A call that fails as a
        whole is run again row by row, so one row's error is never another's. Each row's numbers
        are those it gets alone.
        """
        out: list[np.ndarray | Exception | None] = [None] * len(rows)
        counters = self._batcher.counters
        ahead = list(dict.fromkeys(prefetch))[: max(self._store.layout.n_expert_used, self._store.n_slots // 8)]

        async def chunk(members: list[int], ahead: list[Key]) -> None:
            calls = [_Call(rows[i]) for i in members]
            if len(calls) > 1:
                counters.batches += 1
                counters.batched_calls += len(calls)
            outcomes: list[_Outcome]
            try:
                outcomes = await self._run_calls(layer, calls, ahead)
            except Exception as exc:
                outcomes = [exc]
                if len(calls) > 1:  # the step failed as a whole: each row alone
                    counters.retried_calls += len(calls)
                    outcomes = []
                    for call in calls:
                        try:
                            (one,) = await self._run_calls(layer, [call])
                        except Exception as err:
                            one = err
                        outcomes.append(one)
            for i, outcome in zip(members, outcomes, strict=True):
                out[i] = outcome if isinstance(outcome, Exception) else outcome[0].ffn_out

        n = len(rows)
        n_chunks = -(-n // BATCH_MAX_CALLS)
        async with anyio.create_task_group() as tg:
            for k in range(n_chunks):
                tg.start_soon(chunk, list(range(n * k // n_chunks, n * (k + 1) // n_chunks)), ahead if k == 0 else [])
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

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
        layers = list(self._store.layout.layers) if route_step is None else []
        n_rows = _n_rows(x)  # a bad x is refused by the first layer's _route, before any read
        ids = None if n_rows is None else self._checked_token_ids(layers, token_ids, n_rows)
        chosen = (predictor or self._predictor) if prefetch else None
        token = None
        if self._recorder is not None:
            with self._state_lock:
                token = self._recorder.reserve(len(x))
        steps = []
        moe_layers = list(self._store.layout.layers)
        routed: _Routed | None = None
        for i, layer in enumerate(moe_layers):
            if routed is None:
                routed = await run_in_worker(self._route, layer, x, route_step, chosen, token, ids)
            if compute is None:
                out, io_wait, compute_s = await self._executor_layer(layer, x, routed)
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

    def routing_trace(self) -> RoutingTrace:
        """Every routing decision recorded so far (``record_trace=True``).

        Raises:
            ConfigError: the runner was made without ``record_trace=True``.
        """
        if not self._record_trace:
            raise ConfigError("make the runner with record_trace=True to record routing")
        if self._recorder is None:  # nothing ran yet
            layout = self._store.layout
            return RoutingTrace(
                np.full((0, len(layout.layers), layout.n_expert_used), -1, dtype=np.int16),
                tuple(layout.layers),
                tuple(m.n_experts for m in layout.layers.values()),
            )
        with self._state_lock:
            return self._recorder.trace()

    def statistics(self) -> RunnerStatistics:
        """A frozen snapshot of the runner's counters (the store has its own: I/O and cache)."""
        c = self._counters
        b = self._batcher.counters
        return RunnerStatistics(
            layer_steps=c.layer_steps,
            tokens=c.tokens,
            io_wait_seconds=c.io_wait_seconds,
            compute_seconds=c.compute_seconds,
            token_latency_p50_ms=to_ms(c.token_latency.percentile(50)),
            token_latency_p99_ms=to_ms(c.token_latency.percentile(99)),
            calls=c.calls,
            experts_per_step=c.experts / c.executor_steps if c.executor_steps else None,
            rows_per_step=c.rows / c.executor_steps if c.executor_steps else None,
            batches=b.batches,
            batched_calls=b.batched_calls,
            retried_calls=b.retried_calls,
            batch_window_seconds=b.window_seconds,
            hits_first_steps=c.hits_first_steps,
        )

    def __repr__(self) -> str:
        return f"<aioexperts.MoERunner over {self._store!r}>"


def _n_rows(x: object) -> int | None:
    """Rows of a 2-D array ``x`` (no scan of its values), or None."""
    return int(x.shape[0]) if isinstance(x, np.ndarray) and x.ndim == 2 else None


def _rows(mask: np.ndarray, limit: int = 8) -> str:
    rows = np.flatnonzero(mask)
    shown = ", ".join(str(r) for r in rows[:limit])
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _predicted(predictor: Predictor, layer: int, nxt: int, x: np.ndarray, budget: int) -> list[int]:
    """``predictor.predict`` checked: ints, at most ``budget`` of them (a custom predictor's mistakes name it)."""
    got = predictor.predict(layer, nxt, x, budget)
    if not isinstance(got, list | tuple) or any(
        isinstance(e, bool) or not isinstance(e, int | np.integer) for e in got
    ):
        raise InvalidRequestError(
            f"{type(predictor).__name__}.predict must return a list of expert ids, got {got!r:.80}"
        )
    return [int(e) for e in got[:budget]]


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
        raise InvalidRequestError(f"layer {layer}: the compute step returned NaN or inf in token rows {_rows(bad)}")


def _check_finite(layer: int, y: np.ndarray, x: np.ndarray) -> None:
    """The executor's output is finite, or InvalidRequestError: finite input that overflows float32 inside
    the experts (llama.cpp would return inf/NaN the same way) is refused rather than returned."""
    bad = np.logical_not(np.isfinite(y).all(axis=1))
    if bad.any():
        peak = float(np.abs(x[bad]).max())
        raise InvalidRequestError(
            f"layer {layer}: the MoE output overflowed float32 (NaN or inf) in token rows {_rows(bad)}; the "
            f"largest input magnitude there is {peak:.3g}, outside what the model's weights can carry"
        )


def _check_x(x: object, n_embd: int) -> None:
    """``x`` is a float32 ``(n_tokens, n_embd)`` array of finite values, or InvalidRequestError."""
    x = check_activations(x, n_embd)
    bad = np.logical_not(np.isfinite(x).all(axis=1))
    if bad.any():
        raise InvalidRequestError(f"x has NaN or inf values in token rows {_rows(bad)}")


def _check_routing(
    layer: int, ids: object, weights: object, n_tokens: int, moe: MoELayer
) -> tuple[np.ndarray, np.ndarray]:
    """What a custom route step returned: int ids in ``-1..n_experts-1`` (any integer array-like, a
    nested list too) and float32 weights (an array: no silent cast of other floats), ``(n_tokens, k)``."""
    if not isinstance(ids, np.ndarray) and ids is not None and not isinstance(ids, str | bytes):
        try:
            ids = as_int_array(ids, "ids", ndim=2)
        except InvalidRequestError:
            pass  # refused below, with the layer named
    if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.shape[0] != n_tokens or ids.dtype.kind not in "iu":
        raise InvalidRequestError(
            f"layer {layer}: route_step ids must be ints of shape ({n_tokens}, k), got {describe(ids)}"
        )
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.shape != ids.shape:
        got = (
            f"{weights.dtype} array of shape {weights.shape}" if isinstance(weights, np.ndarray) else str(type(weights))
        )
        raise InvalidRequestError(f"layer {layer}: route_step weights must be float32 of shape {ids.shape}, got {got}")
    bad = np.logical_not(np.isfinite(weights).all(axis=1))
    if bad.any():
        raise InvalidRequestError(f"layer {layer}: route_step weights are NaN or inf in token rows {_rows(bad)}")
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= moe.n_experts):
        raise InvalidRequestError(
            f"layer {layer}: route_step ids must be in -1..{moe.n_experts - 1}, got {int(ids.min())}..{int(ids.max())}"
        )
    return ids, weights


def _without_shared(resident: ResidentLayer) -> ResidentLayer:
    return dataclasses.replace(resident, shexp_gate=None, shexp_up=None, shexp_down=None, shexp_gate_inp=None)


def _sum_groups(outputs: Sequence[MoEOutput]) -> MoEOutput:
    moe_out = outputs[0].moe_out.copy()
    for part in outputs[1:]:
        moe_out += part.moe_out
    shared_out = outputs[0].shared_out
    ffn_out = moe_out if shared_out is None else moe_out + shared_out
    return MoEOutput(moe_out, shared_out, ffn_out)


def _batch_prefetch(wanted: list[list[Key]]) -> list[Key]:
    """The prefetch of a batched step: the calls' predicted keys most of them share, no more of
    them than one call asks for (the keys more calls predicted first, then in the order asked).

    The union of every call's predictions (4 calls: up to 4 times one call's reads) filled a slab
    of 25 % of the experts with predictions that evicted each other: the 8-layer model read as many
    bytes per token with 4 streams batched as without batching.
    """
    if len(wanted) == 1:
        return list(dict.fromkeys(wanted[0]))
    counts: dict[Key, int] = {}
    for keys in wanted:
        for key in dict.fromkeys(keys):
            counts[key] = counts.get(key, 0) + 1
    order = sorted(counts, key=lambda key: -counts[key])  # stable: ties keep the order asked
    return order[: max(len(set(keys)) for keys in wanted)]


def hits_first_pays(n_hits: int, n_misses: int, n_threads: int, *, batched: bool = False) -> bool:
    """Whether a layer step computes its ``n_hits`` resident experts while its ``n_misses`` others are
    read (hits-first), rather than everything in one job after the reads.

    It pays only with enough of both: at least ``max(HITS_FIRST_MIN_MISSES, n_threads)`` misses, so
    their read is worth overlapping and their own compute job fills the ``n_threads`` workers (one
    miss computed alone after the hits leaves the other workers idle and costs a second hand-off:
    the split measured 0.86x at 95 % hits on 2 cores), and at least ``n_threads`` hits to keep the
    workers busy during the read. A step of several calls (``batched``) splits from one miss on.
    """
    # several calls' experts (a batched decode step): the hits' compute covers even one miss's read;
    # interleaved development runs (no results file; 48-layer skewed model, 4 streams, 6 rounds):
    # 1.15x (1.03-1.31) the tokens per second of the one-call rule
    if batched:
        return n_misses >= 1 and n_hits >= n_threads
    return n_misses >= max(HITS_FIRST_MIN_MISSES, n_threads) and n_hits >= n_threads


@dataclass(frozen=True, slots=True, eq=False)
class _Call:
    """One call of a layer step: its routing and the executor's plan."""

    routed: _Routed

    @property
    def plan(self) -> MoEPlan:
        assert self.routed.plan is not None
        return self.routed.plan


def _timed_outputs(
    plans: list[MoEPlan], wanted: list[int], views: Sequence[ExpertView | None], shared: bool
) -> tuple[list[ExpertOutputs], float]:
    """:func:`expert_outputs` of ``wanted`` (pinned as ``views``) in a worker thread, with its time."""
    t0 = time.perf_counter()
    by_id = {e: v for e, v in zip(wanted, views, strict=True) if v is not None}
    found = expert_outputs(plans, by_id, wanted, shared=shared)
    return found, time.perf_counter() - t0


def _outputs_combined(
    layer: int, plans: list[MoEPlan], wanted: list[int], views: Sequence[ExpertView | None], io_wait: float
) -> tuple[list[_Outcome], float]:
    """:func:`_timed_outputs` of every expert (shared ones too), then :func:`_combine_calls`, in one worker job.

    The time returned is the experts' compute alone (as :func:`_timed_outputs`').
    """
    found, compute_s = _timed_outputs(plans, wanted, views, True)
    return _combine_calls(layer, plans, [[p] for p in found], io_wait, compute_s), compute_s


def _combine_calls(
    layer: int, plans: list[MoEPlan], parts: list[list[ExpertOutputs]], io_wait: float, compute_s: float
) -> list[_Outcome]:
    """Each call's slot-order sum, checked finite; a call's overflow is its own outcome (worker thread)."""
    outcomes: list[_Outcome] = []
    for plan, found in zip(plans, parts, strict=True):
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, not warned
            out = combine_moe(plan, found)
        try:
            _check_finite(layer, out.ffn_out, plan.x)
        except InvalidRequestError as exc:
            outcomes.append(exc)
            continue
        outcomes.append((out, io_wait, compute_s))
    return outcomes
