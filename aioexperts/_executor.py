"""Layer executors: what runs a MoE layer's routed experts once the router has chosen them.

A :class:`LayerExecutor` takes the routings of one layer step (one or several calls: a prompt, one
decode row, or the rows of several sequences decoding together) and returns each call's output.
:class:`LocalExecutor` pins the experts in the local store's slab (reading the misses, starting
the prefetch of the layers ahead in the same batch), computes them on the compute pool (the
resident ones first while the others are read, when that pays) and sums each call in slot order;
``aioexperts.distributed.ShardExecutor`` sends them to the shards that own them. The runner
(:class:`~aioexperts.MoERunner`) joins a :class:`~aioexperts._router.Router` and an executor.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ._cache.cache import Key
from ._compute import fused as _fused
from ._compute.moe import (
    ExpertOutputs,
    MoEOutput,
    MoEPlan,
    ResidentLayer,
    RowSteps,
    combine_moe,
    expert_outputs,
    moe_forward,
    prepare_row_step,
    row_ffn_out,
    row_ffn_out_at,
)
from ._compute.norms import all_finite
from ._compute.pool import compute_pool
from ._errors import ConfigError, InvalidRequestError
from ._format.hparams import MoEHParams
from ._format.views import ExpertView
from ._pipeline import run_in_worker, run_layer_step
from ._router import Router, Routing, rows_text
from ._store import ExpertStore, ResidentExperts
from ._tier_policy import low_tier_misses, low_tier_prefetches
from ._timeline import Timeline

__all__ = (
    "HITS_FIRST_MIN_MISSES",
    "ExecutorCounters",
    "LayerExecutor",
    "LayerOutcome",
    "LocalExecutor",
    "batch_prefetch",
    "check_finite",
    "hits_first_pays",
    "without_shared",
)

HITS_FIRST_MIN_MISSES = 2
"""A layer step splits into hits first, then misses, only with at least this many misses
(and at least as many as the compute pool has workers): :func:`hits_first_pays`."""

#: One call's outcome in a layer step: (output, io_wait_seconds, compute_seconds), or its own error.
LayerOutcome = tuple[MoEOutput, float, float] | Exception

#: ``note(event, layer, n_calls)``: the runner's timeline of layer steps (``read``, ``computed``).
Note = Callable[[str, int, int], None]

#: ``then(outcomes)``: the caller's work after a layer step, run in the step's last compute job
Then = Callable[[list[LayerOutcome]], None]


@dataclass(slots=True)
class ExecutorCounters:
    """What an executor ran (the runner's :class:`~aioexperts.RunnerStatistics` reads them).

    Attributes:
        layer_steps: layer steps (a step of several calls, or one group of a call, counts once).
        io_wait_seconds: time waited for experts after routing, summed.
        compute_seconds: time the experts' compute ran on the compute pool, summed.
        executor_steps: steps that pinned one union of experts for their calls.
        calls: calls those steps served.
        experts: distinct experts those steps pinned (one read request each).
        rows: token rows those steps computed.
        hits_first_steps: steps that computed their resident experts while the others were read.
        stall_seconds: time the forward pass could do nothing but wait for reads, summed: a step's
            wait for its experts, less the compute of its resident experts that overlapped it
            (hits first). At most ``io_wait_seconds``.
    """

    layer_steps: int = 0
    io_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    executor_steps: int = 0
    calls: int = 0
    experts: int = 0
    rows: int = 0
    hits_first_steps: int = 0
    stall_seconds: float = 0.0

    def add_step(self, io_wait_seconds: float, compute_seconds: float, stall_seconds: float | None = None) -> None:
        """Count one layer step, its waiting and compute seconds and its stall (default: all the wait)."""
        self.layer_steps += 1
        self.io_wait_seconds += io_wait_seconds
        self.compute_seconds += compute_seconds
        self.stall_seconds += io_wait_seconds if stall_seconds is None else min(stall_seconds, io_wait_seconds)


class LayerExecutor(abc.ABC):
    """Runs the routed experts of MoE layer steps (module docstring); one per runner.

    Attributes:
        counters: what it ran so far.
        local: True when the experts are computed from the local store's slab (a custom compute
            step of :meth:`~aioexperts.MoERunner.run_moe_layers` can run only then).
    """

    local: bool = True

    def __init__(self) -> None:
        self.counters = ExecutorCounters()
        #: the timeline the layer steps are recorded into (None: not recording); local steps only
        self.timeline: Timeline | None = None
        self._router: Router | None = None
        self._note: Note = _no_note

    def bind(self, router: Router, note: Note | None = None) -> None:
        """Join the runner's router (its resident weights, its layer order) and timeline.

        Raises:
            ConfigError: already bound to another router (an executor serves one runner).
        """
        if self._router is not None and self._router is not router:
            raise ConfigError(f"{type(self).__name__} already serves another runner")
        self._router = router
        self._note = note or _no_note

    @property
    def router(self) -> Router:
        """The router it was bound to.

        Raises:
            ConfigError: not bound yet.
        """
        if self._router is None:
            raise ConfigError(f"{type(self).__name__} is not bound to a runner yet")
        return self._router

    async def warmup(self) -> None:  # noqa: B027 - optional hook
        """Get ready before the first step (the runner calls it from its own warm-up)."""

    @abc.abstractmethod
    async def run(
        self,
        layer: int,
        calls: Sequence[Routing],
        prefetch: Sequence[Key] | None = None,
        then: Then | None = None,
    ) -> list[LayerOutcome]:
        """One layer step of ``calls`` (routings of MoE layer ``layer``): each call's outcome.

        Args:
            layer: block index of the MoE layer.
            calls: one or more routings; a call without a plan (more experts than the slab holds)
                comes alone.
            prefetch: the step's read-ahead; None: worked out from the calls' predictions.
            then: called once with the outcomes in a compute-pool worker before ``run`` returns,
                in the job that computed the last experts where the executor can (the caller's
                next work without a hand-off of its own); it must not raise. Not called when the
                step fails as a whole.

        Returns:
            Per call, ``(MoEOutput, io_wait_seconds, compute_seconds)`` or that call's own error
            (a non-finite output).

        Raises:
            SlabExhaustedError, ExpertReadError, StoreClosedError, InvalidRequestError, ShardError:
                the step failed as a whole.

        Cancellation handling:
            A compute job already running finishes first, its experts still pinned.
        """

    def prefetch(self, keys: Sequence[Key]) -> int:
        """Start loading ``keys`` ahead without waiting (loop thread); the number started."""
        return 0

    @contextmanager
    def hold_resident(self) -> Iterator[ResidentPass | None]:
        """A :class:`ResidentPass` while every routed expert stays in memory (loop thread; enter
        and leave it there), or None when this executor cannot compute that way (the default)."""
        yield None


def _kernels_in_use() -> tuple[str, str]:
    return _fused.precision(), _fused.backend().name


def _no_note(event: str, layer: int, n: int) -> None:
    return None


class LocalExecutor(LayerExecutor):
    """The experts read into the local store's slab and computed on the compute pool.

    Args:
        store: the started store the experts are read from.
        hits_first: compute a step's resident experts while its other experts are read, when that
            pays (:func:`hits_first_pays`); the result does not change.

    Raises:
        ConfigError: a bad argument.
    """

    def __init__(self, store: ExpertStore, *, hits_first: bool = True) -> None:
        super().__init__()
        if not isinstance(hits_first, bool):
            raise ConfigError(f"hits_first must be True or False, got {hits_first!r}")
        self._store = store
        self.hits_first = hits_first
        self._row_steps: dict[tuple[str, str], RowSteps] = {}  # by (precision, kernel backend)

    def prefetch(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        store, keys = self._store, list(keys)
        tier = store.miss_tier
        if tier is None:
            return store.prefetch(keys)
        # no predicted weights here (the first layer's prediction, hash-routed layers): the backlog rule
        return store.prefetch(keys, low=low_tier_prefetches(tier, keys, {}, store.read_backlog_seconds()))

    @contextmanager
    def hold_resident(self) -> Iterator[ResidentPass | None]:
        if self.timeline is not None:  # a recorded step goes through the pins, as any other
            yield None
            return
        with self._store.hold_resident() as held:
            if held is None:
                yield None
                return
            resident = ResidentPass(held, self._row_steps.setdefault(_kernels_in_use(), {}))
            try:
                yield resident
            finally:
                resident.count_into(self.counters)

    async def run(
        self,
        layer: int,
        calls: Sequence[Routing],
        prefetch: Sequence[Key] | None = None,
        then: Then | None = None,
    ) -> list[LayerOutcome]:
        if len(calls) == 1 and calls[0].plan is None:
            outcome = await self._run_groups(layer, calls[0])
            if then is not None:
                await run_in_worker(then, [outcome])
            return [outcome]
        return await self._run_calls(layer, calls, None if prefetch is None else list(prefetch), then)

    async def _run_groups(self, layer: int, routing: Routing) -> LayerOutcome:
        """A call choosing more experts than the slab holds: group by group, the groups' sums added."""
        router, store, hparams = self.router, self._store, self._store.hparams
        resident = router.residents[layer]
        outputs: list[MoEOutput] = []
        io_wait = compute_s = 0.0
        c = self.counters
        for g, group in enumerate(routing.groups):
            group_resident = resident if g == 0 else without_shared(resident)

            def compute(
                _layer: int,
                xx: np.ndarray,
                views: Any,
                ii: np.ndarray,
                ww: np.ndarray,
                _resident: ResidentLayer = group_resident,
            ) -> MoEOutput:
                with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, not warned
                    out = moe_forward(xx, ii, ww, views, _resident, hparams)
                check_finite(_layer, out.ffn_out, xx)
                return out

            last = g == len(routing.groups) - 1
            step = await run_layer_step(
                store,
                layer,
                routing.x,
                group.ids,
                routing.weights,
                group.experts,
                compute,
                prefetch=routing.prefetch if last else [],
                upcoming=router.upcoming_layers(layer),
            )
            c.add_step(step.io_wait_seconds, step.compute_seconds)
            outputs.append(step.output)
            io_wait += step.io_wait_seconds
            compute_s += step.compute_seconds
        if len(outputs) == 1:
            return outputs[0], io_wait, compute_s
        out = await run_in_worker(_sum_groups, outputs)
        return out, io_wait, compute_s

    async def _run_calls(
        self, layer: int, calls: Sequence[Routing], prefetch: list[Key] | None = None, then: Then | None = None
    ) -> list[LayerOutcome]:
        """One layer step for ``calls`` (each fits the slab): pin the union of their experts once,
        prefetch (``prefetch``, else :func:`batch_prefetch` of the calls' predictions), compute
        every call's rows (resident experts first), one outcome per call."""
        store = self._store
        experts = list(dict.fromkeys(e for c in calls for e in c.groups[0].experts))
        further: list[Key] = []
        if prefetch is None:
            prefetch = batch_prefetch([c.prefetch for c in calls])
            further = batch_prefetch([c.speculative for c in calls])
        wanted = {(layer, e) for e in experts}
        router = self.router
        ahead = set(router.upcoming_layers(layer)).union(router.speculative_layers(layer)) - {layer}
        store.drop_prefetches(keep=lambda key: key in wanted or key[0] in ahead)
        plans = [_plan(c) for c in calls]
        t0 = time.perf_counter()
        # a layer whose every expert is READY at full precision (a hint read on the loop thread, as
        # the pins below): no expert to look up one by one
        full = store.layer_resident(layer)
        resident = [True] * len(experts) if full else store.resident(layer, experts)
        misses = [] if full else [e for e, ready in zip(experts, resident, strict=True) if not ready]
        if misses or prefetch or further:
            # the layer's misses first, then the prefetch of the layers ahead, submitted now as one
            # batch: before any compute job of this step holds the cores (and the GIL) the event
            # loop needs to submit them
            tier = store.miss_tier
            low: list[int] = []
            low_ahead: list[Key] = []
            if tier is not None:  # the same backlog for both: what was queued before this step's reads
                backlog = store.read_backlog_seconds()
                low = low_tier_misses(tier, misses, calls, backlog) if misses else []
                if prefetch or further:
                    low_ahead = low_tier_prefetches(tier, [*prefetch, *further], _prefetch_weights(calls), backlog)
            store.start_loads(
                layer, experts, prefetch=prefetch, low_ids=low, low_prefetch=low_ahead, speculative=further
            )
            prefetch = []
        hits: list[int] = []
        if self.hits_first and len(experts) > 1 and misses and len(misses) < len(experts):
            hits = [e for e, ready in zip(experts, resident, strict=True) if ready]
            if not hits_first_pays(len(hits), len(misses), compute_pool().n_threads, batched=len(calls) > 1):
                hits = []  # one compute job after the reads
        outcomes: list[LayerOutcome]
        note = self._note
        jobs: tuple[tuple[int, float, float], ...]
        if hits:
            parts, io_wait, stall, jobs = await self._hits_first(layer, plans, hits, experts, prefetch, t0)
            compute_s = sum(b - a for _kind, a, b in jobs)
        else:  # the experts' compute and each call's sum in one compute-pool job (one hand-off, not two)
            async with store.experts(layer, experts, prefetch=prefetch) as views:
                io_wait = stall = time.perf_counter() - t0
                note("read", layer, len(calls))
                outcomes, a, b = await run_in_worker(_outputs_combined, layer, plans, experts, views, io_wait, then)
                compute_s, jobs = b - a, ((0, a, b),)
        if hits:
            outcomes = await run_in_worker(_combine_calls, layer, plans, parts, io_wait, compute_s, then)
        note("computed", layer, len(calls))
        timeline = self.timeline
        if timeline is not None:
            done = time.perf_counter()
            timeline.add_step(layer, len(calls), len(experts), len(misses), t0, t0 + io_wait, done, stall, jobs)
        c = self.counters
        c.add_step(io_wait, compute_s, stall)
        c.executor_steps += 1
        c.calls += len(calls)
        c.experts += len(experts)
        c.rows += sum(len(p.x) for p in plans)
        c.hits_first_steps += bool(hits)
        return outcomes

    async def _hits_first(
        self,
        layer: int,
        plans: list[MoEPlan],
        hits: list[int],
        experts: list[int],
        prefetch: list[Key],
        t0: float,
    ) -> tuple[list[list[ExpertOutputs]], float, float, tuple[tuple[int, float, float], ...]]:
        """The resident experts (``hits``) computed while the others are read, in a child task:
        (parts, io_wait, stall: the wait beyond the hits' compute, the two compute jobs as
        ``(kind, start, end)`` perf_counter seconds, kind 1 the hits and 2 the misses).

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
                    self._note("read", layer, len(plans))
                    done["misses"] = await run_in_worker(_timed_outputs, plans, misses, views, False)
            except Exception as exc:  # re-raised below as itself, not in an exception group
                done["error"] = exc

        async with anyio.create_task_group() as tg:
            try:
                async with store.experts(layer, hits) as views:  # resident: pinned without waiting
                    tg.start_soon(read_misses)
                    found, hit_a, hit_b = await run_in_worker(_timed_outputs, plans, hits, views, True)
            except Exception as exc:
                done.setdefault("error", exc)
                tg.cancel_scope.cancel()
        if "error" in done:
            raise done["error"]
        miss_found, miss_a, miss_b = done["misses"]
        parts = [[h, m] for h, m in zip(found, miss_found, strict=True)]
        io_wait = done["io_wait"]
        return parts, io_wait, max(0.0, io_wait - (hit_b - hit_a)), ((1, hit_a, hit_b), (2, miss_a, miss_b))


class ResidentPass:
    """MoE layers computed from experts held in memory (:meth:`LayerExecutor.hold_resident`):
    no pin, no await and no hand-off per layer, so one compute job can run many layers while the
    experts they route to are resident.

    :meth:`moe` runs in that compute job (one thread at a time); the counts reach the executor's
    counters when the hold ends, on the event loop.
    """

    __slots__ = ("_experts", "_row_steps", "compute_seconds", "experts", "rows", "steps")

    def __init__(self, experts: ResidentExperts, row_steps: RowSteps | None = None) -> None:
        self._experts = experts
        self._row_steps: RowSteps = {} if row_steps is None else row_steps
        self.steps = 0
        self.experts = 0
        self.rows = 0
        self.compute_seconds = 0.0

    def moe(self, layer: int, routing: Routing) -> np.ndarray | None:
        """``ffn_out`` ``(n_rows, n_embd)`` float32 of one routing (:meth:`~aioexperts.MoERunner.route_in_job`),
        the same numbers as the executor's pinned step: :func:`expert_outputs` then :func:`combine_moe`;
        None when an expert it chose is not resident (the caller goes on through the executor).

        Raises:
            InvalidRequestError: the output is not finite (as the pinned step's outcome).
        """
        plan = routing.plan
        if plan is None:  # more experts than slots: never with a slab that holds the model
            return None
        wanted = routing.groups[0].experts
        experts = self._experts
        table = experts.table(layer)  # every expert of the layer in place: no view per expert
        t0 = time.perf_counter()
        ffn_out = None if table is None else row_ffn_out_at(plan, table, self._row_steps)
        if ffn_out is not None:
            experts.requests += len(wanted)
            views: list[ExpertView] | None = None
        else:
            views = experts.views(layer, wanted)
            if views is None:
                return None
            t0 = time.perf_counter()
            ffn_out = row_ffn_out(plan, views, self._row_steps)  # a decode row through its prepared step
        outcome: LayerOutcome | None = None
        if ffn_out is None:
            assert views is not None
            (outcome,), t0, t1 = _outputs_combined(layer, [plan], wanted, views, 0.0)
        else:
            t1 = time.perf_counter()
        self.steps += 1
        self.experts += len(wanted)
        self.rows += len(plan.x)
        self.compute_seconds += t1 - t0
        if outcome is None:
            assert ffn_out is not None
            check_finite(layer, ffn_out, plan.x)  # as _combine_calls checks the general path's output
            return ffn_out
        if isinstance(outcome, Exception):
            raise outcome
        return outcome[0].ffn_out

    def prepare(self, residents: Mapping[int, ResidentLayer], hparams: MoEHParams) -> int:
        """Make each layer's expert table and decode step now, where every expert of the layer is
        resident (a compute job, as :meth:`moe`): what a layer's first decode row through
        :meth:`moe` would make (about 0.3 ms a layer), made after a prefill instead, so the first
        decode token after it runs as the next ones. Steps and tables already made are kept.

        Args:
            residents: block index -> the MoE layer's resident weights (:meth:`aioexperts.MoERunner.residents`).
            hparams: the model's MoE parameters.

        Returns:
            The layers with a table and a step.
        """
        k = hparams.n_expert_used
        prepared = 0
        for layer, resident in residents.items():
            table = self._experts.table(layer)
            if table is not None and prepare_row_step(resident, hparams, k, table, self._row_steps) is not None:
                prepared += 1
        return prepared

    def count_into(self, c: ExecutorCounters) -> None:
        """Add this pass's steps to ``c`` (event loop), as one-call steps with no wait."""
        c.layer_steps += self.steps  # no wait, no stall: add_step's other sums stay
        c.compute_seconds += self.compute_seconds
        c.executor_steps += self.steps
        c.calls += self.steps
        c.experts += self.experts
        c.rows += self.rows
        self.steps = self.experts = self.rows = 0
        self.compute_seconds = 0.0


def _plan(routing: Routing) -> MoEPlan:
    assert routing.plan is not None, "a call of a multi-call step fits the slab"
    return routing.plan


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


def check_finite(layer: int, y: np.ndarray, x: np.ndarray) -> None:
    """The executor's output is finite, or InvalidRequestError: finite input that overflows float32 inside
    the experts (llama.cpp would return inf/NaN the same way) is refused rather than returned."""
    if all_finite(y):  # the common case in one call; the rows only when some are bad
        return
    bad = np.logical_not(np.isfinite(y).all(axis=1))
    if bad.any():
        peak = float(np.abs(x[bad]).max())
        raise InvalidRequestError(
            f"layer {layer}: the MoE output overflowed float32 (NaN or inf) in token rows {rows_text(bad)}; the "
            f"largest input magnitude there is {peak:.3g}, outside what the model's weights can carry"
        )


def without_shared(resident: ResidentLayer) -> ResidentLayer:
    """``resident`` without its shared expert (the groups after the first, the shards)."""
    return dataclasses.replace(resident, shexp_gate=None, shexp_up=None, shexp_down=None, shexp_gate_inp=None)


def _sum_groups(outputs: Sequence[MoEOutput]) -> MoEOutput:
    moe_out = outputs[0].moe_out.copy()
    for part in outputs[1:]:
        moe_out += part.moe_out
    shared_out = outputs[0].shared_out
    ffn_out = moe_out if shared_out is None else moe_out + shared_out
    return MoEOutput(moe_out, shared_out, ffn_out)


def _prefetch_weights(calls: Sequence[Routing]) -> dict[Key, float]:
    """The calls' predicted gate weights of their prefetch keys, the largest where several give one."""
    if len(calls) == 1:
        return calls[0].prefetch_weights
    out: dict[Key, float] = {}
    for call in calls:
        for key, w in call.prefetch_weights.items():
            if w > out.get(key, -1.0):
                out[key] = w
    return out


def batch_prefetch(wanted: list[list[Key]]) -> list[Key]:
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


def _timed_outputs(
    plans: list[MoEPlan], wanted: list[int], views: Sequence[ExpertView | None], shared: bool
) -> tuple[list[ExpertOutputs], float, float]:
    """:func:`expert_outputs` of ``wanted`` (pinned as ``views``) in a worker thread, with its start
    and end (perf_counter seconds)."""
    t0 = time.perf_counter()
    by_id = {e: v for e, v in zip(wanted, views, strict=True) if v is not None}
    found = expert_outputs(plans, by_id, wanted, shared=shared)
    return found, t0, time.perf_counter()


def _outputs_combined(
    layer: int,
    plans: list[MoEPlan],
    wanted: list[int],
    views: Sequence[ExpertView | None],
    io_wait: float,
    then: Then | None = None,
) -> tuple[list[LayerOutcome], float, float]:
    """:func:`_timed_outputs` of every expert (shared ones too), then :func:`_combine_calls` (and
    ``then``), in one worker job.

    The start and end returned (perf_counter seconds) are the experts' compute alone (as
    :func:`_timed_outputs`').
    """
    found, t0, t1 = _timed_outputs(plans, wanted, views, True)
    return _combine_calls(layer, plans, [[p] for p in found], io_wait, t1 - t0, then), t0, t1


def _combine_calls(
    layer: int,
    plans: list[MoEPlan],
    parts: list[list[ExpertOutputs]],
    io_wait: float,
    compute_s: float,
    then: Then | None = None,
) -> list[LayerOutcome]:
    """Each call's slot-order sum, checked finite; a call's overflow is its own outcome; then
    ``then(outcomes)`` (worker thread)."""
    outcomes: list[LayerOutcome] = []
    for plan, found in zip(plans, parts, strict=True):
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, not warned
            out = combine_moe(plan, found)
        try:
            check_finite(layer, out.ffn_out, plan.x)
        except InvalidRequestError as exc:
            outcomes.append(exc)
            continue
        outcomes.append((out, io_wait, compute_s))
    if then is not None:
        then(outcomes)
    return outcomes
