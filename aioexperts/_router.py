"""The router: a MoE layer's routing and the prediction of the experts the next layers will need.

A :class:`Router` holds what routing needs besides the streamed experts: the resident weights of
every MoE layer (routers, biases, token tables of hash-routed layers, and the shared experts the
executor uses), the prefetch predictor and the routing trace. It computes; it reads nothing
(:mod:`aioexperts._executor` pins, reads and computes the experts it chose). Every method but
:meth:`Router.warmup` is synchronous and meant for a compute-pool job.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._cache.cache import Key
from ._checks import as_int_array, check_activations, check_int, describe
from ._compute.moe import MoEPlan, ResidentLayer, check_token_ids, plan_moe, plan_routed_row, route
from ._compute.norms import all_finite
from ._compute.resident import load_residents
from ._errors import ConfigError, InvalidRequestError
from ._format.hparams import MoEHParams
from ._format.layout import MoELayer
from ._pipeline import run_in_worker
from ._predict.predictors import PREDICTORS, Predictor, make_predictor, observe_skipped
from ._predict.trace import RoutingTrace, TraceRecorder
from ._store import ExpertStore

__all__ = (
    "DEFAULT_TRACE_MAX_TOKENS",
    "ExpertGroup",
    "PrefetchOptions",
    "RouteStep",
    "Router",
    "Routing",
    "check_x",
    "rows_text",
)

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
        speculative: MoE layers predicted beyond ``depth`` whose experts are read only while the
            device would otherwise sit idle (nothing else queued, a few reads in flight), and
            become prefetches when the pass comes within ``depth`` of them (default 1: the disk
            idled about a fifth of a decode token under a memory limit, between a layer's
            prefetch landing and the next layer's routing; 0 turns it off). Decode only: the
            batched step (:meth:`Router.route_rows`) and prefill do not use it.

    Raises:
        ConfigError: a value out of range or of the wrong type.
    """

    predictor: str | Predictor = "router"
    budget: int | None = None
    depth: int = 2
    speculative: int = 1

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
        check_int(self, "speculative", low=0)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertGroup:
    """Experts of one layer step that fit in the slab, and the ids with every other expert ``-1``.

    Attributes:
        experts: distinct expert ids, in the order first chosen.
        ids: ``(n_tokens, k)`` int ids, ``-1`` for the slots of experts in other groups.
    """

    experts: list[int]
    ids: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class Routing:
    """One call's routing of a MoE layer (:meth:`Router.route`), what an executor runs.

    Attributes:
        x: ``(n_tokens, n_embd)`` float32, the layer's input.
        ids: ``(n_tokens, k)`` int32 chosen experts, llama.cpp's order (``-1``: inactive slot).
        weights: ``(n_tokens, k)`` float32 routing weights.
        groups: one group when the chosen experts fit in the slab at once, else several.
        prefetch: ``(layer, expert)`` keys predicted for the layers ahead.
        speculative: ``(layer, expert)`` keys predicted for the layers beyond those
            (:attr:`PrefetchOptions.speculative`), read only while the device would sit idle.
        plan: the executor's plan of the rows (one group only), else None.
        prefetch_weights: the predicted gate weight of some ``prefetch`` keys (with a miss tier
            and a predictor that gives them: :meth:`~aioexperts.predictors.Predictor.predict_weighted`).
    """

    x: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    groups: list[ExpertGroup]
    prefetch: list[Key]
    plan: MoEPlan | None = None
    prefetch_weights: dict[Key, float] = field(default_factory=dict)
    speculative: list[Key] = field(default_factory=list)


class Router:
    """Routes MoE layers and predicts what the next layers need (module docstring).

    Args:
        store: the started store whose model is routed (its layout, hyper-parameters, slab size).
        prefetch: what to predict ahead (default :class:`PrefetchOptions`).
        record_trace: record every routing decision (:meth:`routing_trace`).
        trace_max_tokens: the trace keeps the last this many tokens.

    Raises:
        ConfigError: a bad argument.

    Concurrency: any thread may route; the predictor and the trace are updated under a lock.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        prefetch: PrefetchOptions | None = None,
        record_trace: bool = False,
        trace_max_tokens: int = DEFAULT_TRACE_MAX_TOKENS,
    ) -> None:
        if not isinstance(store, ExpertStore):
            raise ConfigError(f"store must be an ExpertStore (from aioexperts.open), got {store!r}")
        if prefetch is not None and not isinstance(prefetch, PrefetchOptions):
            raise ConfigError(f"prefetch must be a PrefetchOptions, got {prefetch!r}")
        if not isinstance(record_trace, bool):
            raise ConfigError(f"record_trace must be True or False, got {record_trace!r}")
        if isinstance(trace_max_tokens, bool) or not isinstance(trace_max_tokens, int) or trace_max_tokens < 1:
            raise ConfigError(f"trace_max_tokens must be an int >= 1, got {trace_max_tokens!r}")
        self._store = store
        self.prefetch_options = prefetch or PrefetchOptions()
        self._record_trace = record_trace
        self._trace_max_tokens = trace_max_tokens
        self._recorder: TraceRecorder | None = None
        self._residents: dict[int, ResidentLayer] | None = None
        self._predictor: Predictor | None = None
        self._state_lock = threading.Lock()  # predictor and trace: observed from worker threads
        self._hparams: MoEHParams | None = None  # the store's, from warmup on (it never changes)
        self._upcoming: dict[int, list[int]] = {}  # layer -> upcoming_layers(layer)
        self._further: dict[int, list[int]] = {}  # layer -> speculative_layers(layer)

    # -- start-up -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether :meth:`warmup` has loaded the resident weights."""
        return self._residents is not None

    async def warmup(self) -> None:
        """Load the resident weights of every MoE layer (compute pool), the predictor and the trace.

        Call it once (the runner does, under its lock).

        Raises:
            FormatError, ConfigError: a resident tensor is missing, truncated or misshaped.
        """
        store = self._store
        hparams = store.hparams
        if not hparams.verified:
            log.warning(
                "architecture %r is not one whose MoE routing was checked against llama.cpp; computing "
                "with the generic rules (gating and normalisation from the metadata, SwiGLU experts): "
                "outputs may differ from llama.cpp",
                hparams.arch,
            )
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
        self._hparams = hparams
        self._residents = residents

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

    @property
    def record_trace(self) -> bool:
        """Whether routing decisions are recorded. Settable before :meth:`warmup`.

        Raises:
            ConfigError: (setting) not a bool, or a change after :meth:`warmup` ran.
        """
        return self._record_trace

    @record_trace.setter
    def record_trace(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"record_trace must be True or False, got {value!r}")
        if value != self._record_trace and self._residents is not None:
            raise ConfigError("record_trace can only change before warmup()")
        self._record_trace = value

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
            found = self._upcoming[layer] = self._layers_after(layer, 1, self.prefetch_options.depth)
        return list(found)

    def speculative_layers(self, layer: int) -> list[int]:
        """The MoE layers after :meth:`upcoming_layers` read speculatively while ``layer``
        computes (``PrefetchOptions.speculative`` of them, nearest first, wrapping around as
        those, never ``layer`` itself; empty without prefetch).

        Raises:
            InvalidRequestError: ``layer`` is not a MoE layer.
        """
        found = self._further.get(layer)
        if found is None:
            depth, speculative = self.prefetch_options.depth, self.prefetch_options.speculative
            last = depth + speculative if depth else 0  # no prefetch, no speculation
            found = self._further[layer] = self._layers_after(layer, depth + 1, last)
        return list(found)

    def _layers_after(self, layer: int, first: int, last: int) -> list[int]:
        """The MoE layers ``first`` to ``last`` steps after ``layer``, wrapping around after the last
        MoE layer, never ``layer`` itself (steps past a full turn are left out)."""
        layers = list(self._store.layout.layers)
        i = layers.index(self._store.layout.layer(layer).index)
        last = min(last, len(layers) - 1)
        return [layers[(i + d) % len(layers)] for d in range(first, last + 1)]

    def _budget(self) -> int:
        budget = self.prefetch_options.budget
        return self._store.layout.n_expert_used if budget is None else budget

    # -- routing --------------------------------------------------------------------------------

    def route(
        self,
        layer: int,
        x: np.ndarray,
        *,
        route_step: RouteStep | None = None,
        predict: bool = True,
        predictor: Predictor | None = None,
        token: int | None = None,
        token_ids: np.ndarray | None = None,
    ) -> Routing:
        """Check ``x``, route MoE layer ``layer`` and predict the layers ahead (a compute-pool job).

        Args:
            layer: block index of a MoE layer (:meth:`warmup` has run).
            x: ``(n_tokens, n_embd)`` float32, the layer's input.
            route_step: a custom router instead of the layer's resident one.
            predict: observe the routing and predict the layers ahead.
            predictor: the predictor to use (default the router's).
            token: the trace rows reserved for these tokens (:meth:`reserve_trace`), else appended.
            token_ids: ``(n_tokens,)`` int64 token ids, checked (:meth:`check_token_ids`).

        Returns:
            The routing (a plan when the experts fit the slab at once, else groups that do).

        Raises:
            InvalidRequestError: a bad ``x`` (shape, dtype, NaN or inf), a router output that is not
                finite, a bad custom routing.
        """
        hparams = self._hparams or self._store.hparams
        check_x(x, hparams.n_embd)
        if route_step is None:
            # finite x, logits out of range: refused below (route's numpy steps silence their
            # warnings; no np.errstate here: 10 us a layer with the caches cold)
            ids, weights = route(x, self.residents[layer], hparams, token_ids)
            if not _all_finite(weights):
                bad = np.logical_not(np.isfinite(weights).all(axis=1))
                raise InvalidRequestError(
                    f"layer {layer}: the router's output is not finite for token rows {rows_text(bad)} "
                    "(x too large for float32 logits?)"
                )
        else:
            got = route_step(layer, x)
            if not isinstance(got, tuple) or len(got) != 2:
                raise InvalidRequestError(f"layer {layer}: route_step must return (ids, weights), got {describe(got)}")
            ids, weights = _check_routing(layer, *got, len(x), self._store.layout.layer(layer))
        flat = ids.reshape(-1).tolist()  # one numpy call
        if min(flat, default=0) >= 0 and len(set(flat)) == len(flat):
            unique = flat  # distinct active ids: a decode row's (the common case)
        else:
            unique = list(dict.fromkeys(e for e in flat if e >= 0))
        limit = self._store.n_slots
        if len(unique) <= limit:
            groups = [ExpertGroup(unique, ids)]
        else:  # a batch choosing more experts than the slab holds runs in groups
            groups = [
                ExpertGroup(part, np.where(np.isin(ids, part), ids, -1).astype(ids.dtype))
                for part in (unique[i : i + limit] for i in range(0, len(unique), limit))
            ]
        prefetch: list[Key] = []
        speculative: list[Key] = []
        prefetch_weights: dict[Key, float] = {}
        weighted = self._store.miss_tier is not None  # the tier's policy reads the predicted weights
        budget = self._budget()
        chosen = (predictor or self._predictor) if predict else None
        with self._state_lock:
            if self._recorder is not None:
                if token is None:  # moe(): appended at this layer's rows
                    self._recorder.record(layer, ids)
                else:  # run_moe_layers(): the rows reserved for this call's tokens
                    self._recorder.record_token(layer, ids, token)
            if chosen is not None:
                if not observe_skipped(chosen):
                    chosen.observe(layer, x, ids)
                if budget and not self._store.model_resident():  # all resident: nothing to predict
                    further = self.speculative_layers(layer) if len(x) == 1 else []  # decode only
                    for nxt in [*self.upcoming_layers(layer), *further]:
                        if self._store.layer_resident(nxt):  # nothing to read: no prediction
                            continue
                        keys = speculative if nxt in further else prefetch
                        known = self.hash_experts(nxt, token_ids) if nxt > layer else None  # same tokens
                        if known is not None:  # a hash-routed layer ahead: its experts are certain
                            keys.extend((nxt, e) for e in known)
                        elif weighted:
                            predicted, gate = _predicted_weighted(chosen, layer, nxt, x, budget)
                            keys.extend((nxt, e) for e in predicted)
                            prefetch_weights.update(((nxt, e), w) for e, w in gate.items() if e in predicted)
                        else:
                            keys.extend((nxt, e) for e in _predicted(chosen, layer, nxt, x, budget))
        plan = None
        if len(groups) == 1:
            resident = self.residents[layer]
            # a decode row the router chose: no second check of what route() made
            routed = route_step is None and len(x) == 1
            plan = plan_routed_row(x, ids, weights, resident, hparams) if routed else None
            if plan is None:
                plan = plan_moe(x, ids, weights, resident, hparams)
        return Routing(x, ids, weights, groups, prefetch, plan, prefetch_weights, speculative)

    def route_rows(
        self, layer: int, x: np.ndarray, token_ids: object = None
    ) -> tuple[list[Routing | Exception], list[Key]]:
        """:meth:`route` of ``n`` decode rows of different sequences at once (a compute-pool job).

        The router product runs once for all rows through a batch-invariant kernel and the selection
        is per row, so each row's experts and weights are bit for bit those it gets alone; the next
        MoE layer is predicted once for all rows (up to one budget per row; only the nearest layer:
        the rows' predictions for two layers ahead, all prefetched, read 1.2x the bytes per token
        with spread routing and 4 sequences in development runs, for fewer tokens per second).

        Returns:
            Each row's routing (or its own error: a router output that is not finite) and the
            step's prefetch.

        Raises:
            InvalidRequestError: as :meth:`route` (a hash-routed layer without ``token_ids``, the
                rows' ``(n,)`` token ids).
        """
        layer = self._store.layout.layer(layer).index
        n = len(x)
        token_ids = self.check_token_ids([layer], token_ids, n)
        check_x(x, self._store.hparams.n_embd)
        resident, hparams = self.residents[layer], self._store.hparams
        with np.errstate(over="ignore", invalid="ignore"):  # finite x, logits out of range: refused below
            ids, weights = route(x, resident, hparams, token_ids, invariant=True)
        good = np.isfinite(weights).all(axis=1)
        out: list[Routing | Exception] = []
        for i in range(n):
            if not good[i]:
                out.append(
                    InvalidRequestError(
                        f"layer {layer}: the router's output is not finite (x too large for float32 logits?)"
                    )
                )
                continue
            row_x, row_ids, row_w = x[i : i + 1], ids[i : i + 1], weights[i : i + 1]
            unique = list(dict.fromkeys(row_ids[row_ids >= 0].tolist()))
            plan = plan_moe(row_x, row_ids, row_w, resident, hparams)
            out.append(Routing(row_x, row_ids, row_w, [ExpertGroup(unique, row_ids)], [], plan))
        prefetch: list[Key] = []
        budget = self._budget()
        kept = np.flatnonzero(good)
        with self._state_lock:
            if self._recorder is not None and len(kept):
                self._recorder.record(layer, ids[kept])
            if self._predictor is not None and len(kept):
                if not observe_skipped(self._predictor):
                    self._predictor.observe(layer, x[kept], ids[kept])
                if budget:
                    for nxt in self.upcoming_layers(layer)[:1]:
                        got = _predicted(self._predictor, layer, nxt, x[kept], budget * len(kept))
                        prefetch.extend((nxt, e) for e in got)
        return out, prefetch

    def predict_first(self, layer: int, x: np.ndarray) -> list[Key]:
        """The experts the predictor expects MoE layer ``layer`` to choose for ``x``, as keys.

        For the first MoE layer of a decode step, called with the FFN norm of the block's input
        before the block's attention runs (the layers before the token gave no input to predict it
        from). The predictor is asked as at the layer before (``predict(previous MoE layer, layer,
        x, budget)``). Empty without a predictor, budget or depth, and for a layer whose every
        expert is in memory (:meth:`~aioexperts.ExpertStore.layer_resident`: no read could help, as
        in :meth:`route`).
        """
        predictor = self._predictor
        budget = self._budget()
        if predictor is None or not budget or not self.prefetch_options.depth or self._store.layer_resident(layer):
            return []
        layers = list(self._store.layout.layers)
        before = layers[layers.index(layer) - 1]  # the last MoE layer for the first
        with self._state_lock:
            got = _predicted(predictor, before, layer, x, budget)
        return [(layer, e) for e in got]

    def hash_experts(self, layer: int, token_ids: np.ndarray | None) -> list[int] | None:
        """The distinct experts hash-routed ``layer`` gives ``token_ids`` (slot order), or None when
        the layer routes by its router or the ids are not known."""
        if token_ids is None or not self._store.hparams.is_hash_layer(layer):
            return None
        table = self.residents[layer].token_experts
        if table is None:
            return None
        return list(dict.fromkeys(table[token_ids].reshape(-1).tolist()))

    def check_token_ids(self, layers: Sequence[int], token_ids: object, n_tokens: int) -> np.ndarray | None:
        """``token_ids`` checked against every hash-routed layer of ``layers``, before any read.

        Any 1-D integer array-like of ``n_tokens`` ids is taken (a list too).

        Returns:
            ``(n_tokens,)`` int64, or None when none was given and none is needed.

        Raises:
            InvalidRequestError: ids missing in a hash-routed layer, not ``(n_tokens,)`` integers,
                or an id outside the vocabulary of the token tables.
        """
        hparams = self._hparams or self._store.hparams
        for layer in layers:
            table = self.residents[layer].token_experts if hparams.is_hash_layer(layer) else None
            if table is not None:
                return check_token_ids(token_ids, n_tokens, table.shape[0], layer)
        if token_ids is None:
            return None
        return as_int_array(token_ids, "token_ids", (n_tokens,))

    # -- records --------------------------------------------------------------------------------

    def reserve_trace(self, n_tokens: int) -> int | None:
        """Reserve trace rows for ``n_tokens`` tokens of one call (None when no trace is kept)."""
        if self._recorder is None:
            return None
        with self._state_lock:
            return self._recorder.reserve(n_tokens)

    def routing_trace(self) -> RoutingTrace:
        """Every routing decision recorded so far (``record_trace=True``).

        Raises:
            ConfigError: the router was made without ``record_trace=True``.
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


def rows_text(mask: np.ndarray, limit: int = 8) -> str:
    """The row numbers where ``mask`` is true, for an error message (at most ``limit`` shown)."""
    rows = np.flatnonzero(mask)
    shown = ", ".join(str(r) for r in rows[:limit])
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _predicted_weighted(
    predictor: Predictor, layer: int, nxt: int, x: np.ndarray, budget: int
) -> tuple[list[int], dict[int, float]]:
    """``predictor.predict_weighted`` checked: the ids as :func:`_predicted`, and the finite weights
    of some of them (anything else a custom predictor gives is left out: unknown)."""
    got = predictor.predict_weighted(layer, nxt, x, budget)
    if not isinstance(got, tuple) or len(got) != 2 or not isinstance(got[1], Mapping):
        raise InvalidRequestError(
            f"{type(predictor).__name__}.predict_weighted must return (ids, {{id: weight}}), got {got!r:.80}"
        )
    ids = _checked_ids(predictor, got[0], budget)
    gate = {}
    for e, w in got[1].items():
        if isinstance(e, int | np.integer) and isinstance(w, float | np.floating) and np.isfinite(w):
            gate[int(e)] = float(w)
    return ids, gate


def _predicted(predictor: Predictor, layer: int, nxt: int, x: np.ndarray, budget: int) -> list[int]:
    """``predictor.predict`` checked: ints, at most ``budget`` of them (a custom predictor's mistakes name it)."""
    return _checked_ids(predictor, predictor.predict(layer, nxt, x, budget), budget)


def _checked_ids(predictor: Predictor, got: object, budget: int) -> list[int]:
    """A predictor's ids: a list or tuple of ints, the first ``budget`` of them, or InvalidRequestError."""
    if not isinstance(got, list | tuple) or any(
        isinstance(e, bool) or not isinstance(e, int | np.integer) for e in got
    ):
        raise InvalidRequestError(
            f"{type(predictor).__name__}.predict must return a list of expert ids, got {got!r:.80}"
        )
    return [int(e) for e in got[:budget]]


def check_x(x: object, n_embd: int) -> None:
    """``x`` is a float32 ``(n_tokens, n_embd)`` array of finite values, or InvalidRequestError."""
    x = check_activations(x, n_embd)
    if not _all_finite(x):
        bad = np.logical_not(np.isfinite(x).all(axis=1))
        raise InvalidRequestError(f"x has NaN or inf values in token rows {rows_text(bad)}")


def _all_finite(a: np.ndarray) -> bool:
    """Whether every value of ``a`` is finite (one call; the rows are found only when not)."""
    return all_finite(a)


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
        raise InvalidRequestError(f"layer {layer}: route_step weights are NaN or inf in token rows {rows_text(bad)}")
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= moe.n_experts):
        raise InvalidRequestError(
            f"layer {layer}: route_step ids must be in -1..{moe.n_experts - 1}, got {int(ids.min())}..{int(ids.max())}"
        )
    return ids, weights
