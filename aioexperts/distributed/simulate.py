"""Replay a routing trace against a placement: what sharding would cost and gain, without Ray.

For every ``(token, layer)`` step of a trace the sharded runner makes one call to each shard that
owns at least one of the step's experts (:class:`~aioexperts.distributed.ShardedRunner`). The
simulation counts those calls, the expert bytes each shard serves, each shard's cache hit rate
(its own slab, replayed with :func:`aioexperts.traces.replay` over the sub-trace of the experts it
owns) and the latency the calls add per layer for a given call cost.

The latency model: the calls of one layer go out together and are awaited together, so a layer
with any remote call waits one round trip (``call_ms``); sending each further call costs the
runner ``submit_us`` more (Ray serialises and sends them one after another on the runner's
thread). A step with no routed expert makes no call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import ConfigError, PlacementError
from .._predict.simulate import replay
from .._predict.trace import RoutingTrace
from .placement import Placement

__all__ = ("ShardSimulation", "calls_per_step", "simulate_shards")


@dataclass(frozen=True, slots=True)
class ShardSimulation:
    """The outcome of :func:`simulate_shards`.

    Attributes:
        method: the placement's method.
        n_shards: shards of the placement.
        n_tokens: tokens of the trace.
        n_layers: MoE layers.
        calls_per_token: mean calls the runner makes per token (all layers).
        calls_per_layer: ``calls_per_token / n_layers``.
        max_calls_per_token: calls of the token that needs most.
        served_bytes: ``(n_shards,)`` expert bytes each shard computes over the whole trace.
        read_bytes: ``(n_shards,)`` bytes each shard reads from disk (cache misses x expert bytes).
        load_imbalance: ``max / mean`` of ``served_bytes`` (1.0 is perfect balance; bytes per second
            in the same ratio at any token rate).
        read_imbalance: ``max / mean`` of ``read_bytes``.
        hit_rates: ``(n_shards,)`` each shard's cache hit rate (``policy``, ``slots_per_shard`` slots).
        slots_per_shard: the slab size of each shard in the replay.
        policy: the replay's eviction policy.
        call_ms, submit_us: the call costs of the latency model.
        added_ms_per_layer: mean latency the calls add per MoE layer.
        added_ms_per_token: ``added_ms_per_layer * n_layers``.
    """

    method: str
    n_shards: int
    n_tokens: int
    n_layers: int
    calls_per_token: float
    calls_per_layer: float
    max_calls_per_token: int
    served_bytes: tuple[int, ...]
    read_bytes: tuple[int, ...]
    load_imbalance: float
    read_imbalance: float
    hit_rates: tuple[float, ...]
    slots_per_shard: int
    policy: str
    call_ms: float
    submit_us: float
    added_ms_per_layer: float
    added_ms_per_token: float


def calls_per_step(trace: RoutingTrace, placement: Placement) -> np.ndarray:
    """``(n_tokens, n_layers)`` int64: the distinct shards each ``(token, layer)`` step calls.

    Raises:
        PlacementError: the placement is of other layers or expert counts than the trace.
    """
    _check(trace, placement)
    ids = trace.ids.astype(np.int64)
    out = np.zeros(ids.shape[:2], dtype=np.int64)
    for i, layer in enumerate(trace.layers):
        owner = placement.owner_of(layer)
        step = ids[:, i, :]
        shards = np.where(step >= 0, owner[np.maximum(step, 0)], -1)
        hit = np.zeros((len(step), placement.n_shards), dtype=bool)
        rows, cols = np.nonzero(shards >= 0)
        hit[rows, shards[rows, cols]] = True
        out[:, i] = hit.sum(axis=1)
    return out


def _check(trace: RoutingTrace, placement: Placement) -> None:
    if trace.layers != placement.layers or trace.n_experts != placement.n_experts:
        raise PlacementError(
            f"the placement is for MoE layers {list(placement.layers)[:6]} with experts "
            f"{list(placement.n_experts)[:6]}, "
            f"the trace has layers {list(trace.layers)[:6]} with experts {list(trace.n_experts)[:6]}"
        )


def _imbalance(values: Sequence[int]) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else math.nan


def simulate_shards(
    trace: RoutingTrace,
    placement: Placement,
    expert_bytes: Sequence[np.ndarray] | None = None,
    *,
    slots_per_shard: int,
    policy: str = "lru",
    call_ms: float = 1.0,
    submit_us: float = 0.0,
) -> ShardSimulation:
    """Replay ``trace`` against ``placement``: calls, balance, per-shard hit rates, added latency.

    Args:
        trace: a routing trace of the model (``MoERunner(..., record_trace=True)``).
        placement: the placement to evaluate.
        expert_bytes: per layer (as ``trace.layers``), ``(n_experts,)`` bytes of each expert; None
            counts every expert as one byte.
        slots_per_shard: each shard's slab, in experts (at least the trace's top-k).
        policy: eviction policy of the replay (``aioexperts.traces.REPLAY_POLICY_NAMES``).
        call_ms: one call's round trip, in milliseconds.
        submit_us: the runner's cost of sending each further call of a layer, in microseconds.

    Returns:
        The :class:`ShardSimulation`.

    Raises:
        PlacementError: the placement does not fit the trace.
        ConfigError: a bad number, too few slots for one step, or ``expert_bytes`` of the wrong shape.
    """
    _check(trace, placement)
    for name, value in (("call_ms", call_ms), ("submit_us", submit_us)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if expert_bytes is None:
        sizes = [np.ones(n, dtype=np.int64) for n in trace.n_experts]
    else:
        sizes = [np.asarray(b, dtype=np.int64) for b in expert_bytes]
        if len(sizes) != trace.n_layers or any(s.shape != (n,) for s, n in zip(sizes, trace.n_experts, strict=True)):
            raise ConfigError("expert_bytes must hold one (n_experts,) array per MoE layer of the trace")
    n = placement.n_shards
    calls = calls_per_step(trace, placement)
    per_token = calls.sum(axis=1)
    ids = trace.ids.astype(np.int64)
    served = np.zeros(n, dtype=np.int64)
    read = np.zeros(n, dtype=np.int64)
    hit_rates: list[float] = []
    for s in range(n):
        masked = np.full_like(ids, -1)
        for i, layer in enumerate(trace.layers):
            step = ids[:, i, :]
            mine = (step >= 0) & (placement.owner_of(layer)[np.maximum(step, 0)] == s)
            masked[:, i, :] = np.where(mine, step, -1)
            served[s] += int(sizes[i][step[mine]].sum())
        sub = RoutingTrace(masked, trace.layers, trace.n_experts)
        result = replay(sub, slots_per_shard, (policy,))[policy]
        hit_rates.append(result.hit_rate)
        read[s] = _missed_bytes(sub, sizes, slots_per_shard, policy) if expert_bytes is not None else result.misses
    nonzero = calls[calls > 0]
    per_layer_ms = np.where(calls > 0, call_ms + np.maximum(calls - 1, 0) * submit_us / 1000.0, 0.0)
    n_tokens = max(trace.n_tokens, 1)
    return ShardSimulation(
        method=placement.method,
        n_shards=n,
        n_tokens=trace.n_tokens,
        n_layers=trace.n_layers,
        calls_per_token=float(per_token.mean()) if per_token.size else 0.0,
        calls_per_layer=float(nonzero.sum() / (n_tokens * trace.n_layers)),
        max_calls_per_token=int(per_token.max()) if per_token.size else 0,
        served_bytes=tuple(int(v) for v in served),
        read_bytes=tuple(int(v) for v in read),
        load_imbalance=_imbalance(served.tolist()),
        read_imbalance=_imbalance(read.tolist()),
        hit_rates=tuple(hit_rates),
        slots_per_shard=slots_per_shard,
        policy=policy,
        call_ms=float(call_ms),
        submit_us=float(submit_us),
        added_ms_per_layer=float(per_layer_ms.mean()) if per_layer_ms.size else 0.0,
        added_ms_per_token=float(per_layer_ms.sum(axis=1).mean()) if per_layer_ms.size else 0.0,
    )


def _missed_bytes(sub: RoutingTrace, sizes: Sequence[np.ndarray], slots: int, policy: str) -> int:
    """Bytes read by the misses of ``sub``: replayed per expert size class (every size the same: one replay)."""
    distinct = {int(v) for s in sizes for v in np.unique(s)}
    if len(distinct) == 1:
        return replay(sub, slots, (policy,), bytes_per_expert=distinct.pop())[policy].bytes_read or 0
    # mixed sizes: count misses by key with a small LRU of our own is out of scope; weight misses by the mean size
    mean = float(np.mean(np.concatenate(sizes)))
    return int(replay(sub, slots, (policy,))[policy].misses * mean)
