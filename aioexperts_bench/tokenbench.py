"""Per-token figures: the I/O-compute overlap, and tokens per second of the executor.

Overlap, per round (``rounds``, 5 by default), on a seeded uniform random top-k routing trace,
one token at a time through every MoE layer (``runner.run_moe_layers``), each run on a fresh store and runner:

1. ``io only``: no compute, a slab of ``slab_fraction`` of the experts, the oracle prefetch (it
   knows the next layers' routing): the I/O time of a token, ``io``;
2. the synthetic compute step is calibrated on that round's ``io``: numpy matrix products in the
   worker thread lasting ``io / n_layers`` per layer (a compute step as long as the I/O);
3. then, in an order rotated each round:

   - ``compute only``: the same compute step with every expert of the trace resident (loaded by
     an untimed pass first) and no prefetch: the compute time of a token, ``compute``, measured
     through the same pipeline (hand-off to the worker thread included);
   - ``pipelined``: compute and the oracle prefetch on the ``slab_fraction`` slab: ``token``;
   - ``serial``: the same without prefetch (I/O, then compute, layer after layer).

   ``overlap = token / max(io, compute)`` of that round: 1.0 means the shorter of the two is
   fully hidden, 2.0 none of it.

Executor, per round: tokens per second of the MoE layers with the real executor (numba kernels,
numpy fallback) and the model's own router on random inputs, with the store's default router
prefetch, at a slab of 0 % (the store's minimum, ``2 * top-k`` slots), 25 % and 100 % (every
expert loaded first).

A timeline of one pipelined token (reads per layer with their submit and completion times,
compute per layer) is recorded after the rounds for the plot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import aioexperts
import aioexperts.predictors

from . import store_adapter as ea
from .loops import run as run_on_loop
from .measure import rotated, spread

__all__ = (
    "TARGET_OVERLAP",
    "OraclePredictor",
    "TokenBenchConfig",
    "run_token_bench",
    "synthetic_compute",
    "token_phases",
)

#: The overlap target (issue 12; it was 1.1 before).
TARGET_OVERLAP = 1.15
Say = Callable[[str], None]


class OraclePredictor(aioexperts.predictors.Predictor):
    """Knows the routing in advance (from the trace): an upper bound for any real predictor.

    Args:
        trace: int ``(n_tokens, n_layers, k)`` expert ids, or an ``aioexperts.RoutingTrace``.
        layers: the MoE block index of each trace column (taken from a ``RoutingTrace``).
    """

    name = "oracle"

    def __init__(self, trace: np.ndarray | aioexperts.RoutingTrace, layers: Sequence[int] | None = None) -> None:
        if isinstance(trace, aioexperts.RoutingTrace):
            layers = list(trace.layers)
            trace = trace.ids
        if layers is None:
            raise TypeError("OraclePredictor needs the layers of the trace's columns")
        self.trace = trace
        self.column = {layer: i for i, layer in enumerate(layers)}
        self.token = 0

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        return None

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        token = self.token + 1 if next_layer <= layer else self.token  # wrapped to the next token
        if token >= len(self.trace):
            return []
        return [int(e) for e in self.trace[token, self.column[next_layer]]][:budget]

    def reset(self) -> None:
        self.token = 0


def uniform_trace(info: ea.ModelInfo, n_tokens: int, seed: int) -> np.ndarray:
    """``(n_tokens, n_layers, k)`` int32: ``k`` distinct uniformly random experts per token and layer."""
    rng = np.random.default_rng(seed)
    k = info.n_expert_used
    out = np.empty((n_tokens, len(info.layers), k), dtype=np.int32)
    for t in range(n_tokens):
        for i, n in enumerate(info.n_experts):
            out[t, i] = rng.choice(n, size=k, replace=False)
    return out


def synthetic_compute(seconds_per_layer: float) -> aioexperts.ComputeStep:
    """A compute step of numpy matrix products (they release the GIL) lasting ``seconds_per_layer``.

    Small products (96 x 96, a few tens of microseconds each) so the step ends close to its time.
    """
    a = np.random.default_rng(0).standard_normal((96, 96), dtype=np.float32) / 10

    def compute(layer: int, x: np.ndarray, views: Mapping[int, Any], ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        end = time.perf_counter() + seconds_per_layer
        b = a
        while time.perf_counter() < end:
            b = np.tanh(a @ b)
        return np.zeros_like(x)

    return compute


def _noop(layer: int, x: np.ndarray, views: Mapping[int, Any], ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


@dataclass(frozen=True)
class TokenBenchConfig:
    """Parameters of the per-token bench (all recorded in the results file).

    Attributes:
        rounds: paired rounds.
        n_tokens: tokens per overlap run.
        slab_fraction: slab of the overlap runs, as a fraction of all experts.
        depth: store queue depth.
        seed: routing and input seed.
        loop: event loop.
        executor_tokens: tokens per executor run (0: no executor runs).
        executor_fractions: slab fractions of the executor runs (0 means the store's minimum).
        target_overlap: the overlap target printed as met or missed.
    """

    rounds: int = 5
    n_tokens: int = 16
    slab_fraction: float = 0.25
    depth: int = 64
    seed: int = 0
    loop: str = "uvloop"
    executor_tokens: int = 4
    executor_fractions: tuple[float, ...] = (0.0, 0.25, 1.0)
    target_overlap: float = TARGET_OVERLAP


def _slots(info: ea.ModelInfo, fraction: float) -> int:
    return max(2 * info.n_expert_used, min(info.n_experts_total, int(round(info.n_experts_total * fraction))))


def _summary(t: ea.TokenTimes) -> dict[str, Any]:
    n = len(t.seconds)
    st = t.stats
    return {
        "tokens": n,
        "seconds": float(sum(t.seconds)),
        "ms_per_token": float(sum(t.seconds)) / n * 1e3,
        "tokens_per_s": n / float(sum(t.seconds)),
        "p50_ms": float(np.percentile(np.asarray(t.seconds) * 1e3, 50)),
        "io_wait_ms_per_token": float(sum(t.io_wait_seconds)) / n * 1e3,
        "compute_ms_per_token": float(sum(t.compute_seconds)) / n * 1e3,
        "hit_rate": st.get("hit_rate"),
        "requests": st.get("requests"),
        "prefetch_hits": st.get("prefetch_hits"),
        "bytes_read": st.get("bytes_read"),
    }


async def _overlap_run(
    path: str,
    info: ea.ModelInfo,
    trace: np.ndarray,
    cfg: TokenBenchConfig,
    *,
    compute: aioexperts.ComputeStep,
    prefetch: bool,
    resident: bool,
    recorder: ea.ReadRecorder | None = None,
    route_spans: list[tuple[int, float, float]] | None = None,
) -> ea.TokenTimes:
    unique = len({(layer, int(e)) for t in trace for layer, ids in zip(info.layers, t, strict=True) for e in ids})
    slots = unique if resident else _slots(info, cfg.slab_fraction)
    options = ea.BenchOptions(
        slots=slots, backend=recorder or ea.store_backend(), queue_depth=cfg.depth, prefetch_budget=info.n_expert_used
    )
    oracle = OraclePredictor(trace, info.layers)
    x0 = [np.zeros((1, info.n_embd), dtype=np.float32)] * len(trace)

    def route(token: int) -> aioexperts.RouteStep:
        def step(layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            start = time.perf_counter()
            ids = trace[token, oracle.column[layer]][None, :].astype(np.int32)
            out = ids, np.full(ids.shape, 1.0 / ids.shape[1], dtype=np.float32)
            if route_spans is not None:
                route_spans.append((layer, start, time.perf_counter()))
            return out

        return step

    def advance(token: int) -> None:
        oracle.token = token

    async with ea.open_bench_store(path, options) as store:
        if resident:  # load every expert of the trace first, untimed
            await ea.run_tokens(store, x0, route=route, compute=_noop, prefetch=False)
        ea.reset_stats(store)
        if recorder is not None:
            recorder.clear()
        return await ea.run_tokens(
            store,
            x0,
            route=route,
            compute=compute,
            predictor=oracle if prefetch else None,
            prefetch=prefetch,
            on_token=advance,
        )


async def _executor_run(path: str, info: ea.ModelInfo, fraction: float, cfg: TokenBenchConfig, seed: int) -> Any:
    slots = _slots(info, fraction)
    options = ea.BenchOptions(slots=slots, backend=ea.store_backend(), queue_depth=cfg.depth, prefetch="router")
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((1, info.n_embd), dtype=np.float32) for _ in range(cfg.executor_tokens)]
    xs = [(x / np.sqrt(np.mean(x * x))).astype(np.float32) for x in xs]
    async with ea.open_bench_store(path, options) as store:
        if slots >= info.n_experts_total:
            await ea.preload(store, info.layers, info.n_experts, window=8)
        await ea.run_tokens(store, xs[:1])  # resident weights, router and predictor set up, untimed
        ea.reset_stats(store)
        return _summary(await ea.run_tokens(store, xs)) | {"slots": slots}


def run_token_bench(
    path: str, cfg: TokenBenchConfig, *, step: Say | None = None, note: Say | None = None
) -> dict[str, Any]:
    """Run the per-token bench (see the module docstring); returns its section of the results file."""
    say_step = step or (lambda s: None)
    info = ea.model_info(path)
    trace = uniform_trace(info, cfg.n_tokens, cfg.seed)
    n_layers = len(info.layers)
    rounds: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        label = f"round {r + 1}/{cfg.rounds}"
        say_step(f"{label}: tokens, io only")
        io = _summary(run_on_loop(_run_overlap, path, info, trace, cfg, _noop, True, False, loop=cfg.loop))
        per_layer = io["ms_per_token"] / 1e3 / n_layers
        step_fn = synthetic_compute(per_layer)
        runs: dict[str, Any] = {"io only": io}
        for name in rotated(["compute only", "pipelined", "serial"], r):
            say_step(f"{label}: tokens, {name}")
            prefetch = name == "pipelined"
            resident = name == "compute only"
            times = run_on_loop(_run_overlap, path, info, trace, cfg, step_fn, prefetch, resident, loop=cfg.loop)
            runs[name] = _summary(times)
        io_ms = runs["io only"]["ms_per_token"]
        compute_ms = runs["compute only"]["ms_per_token"]
        token_ms = runs["pipelined"]["ms_per_token"]
        executor: dict[str, Any] = {}
        if cfg.executor_tokens > 0:
            for fraction in rotated([f"{f:g}" for f in cfg.executor_fractions], r):
                say_step(f"{label}: executor, slab {float(fraction):.0%}")
                executor[fraction] = run_on_loop(
                    _executor_run, path, info, float(fraction), cfg, cfg.seed + r, loop=cfg.loop
                )
        rounds.append(
            {
                "round": r + 1,
                "synthetic_ms_per_layer": per_layer * 1e3,
                "runs": runs,
                "overlap": token_ms / max(io_ms, compute_ms),
                "serial_over_max": runs["serial"]["ms_per_token"] / max(io_ms, compute_ms),
                "executor": executor,
            }
        )
    say_step("tokens: timeline of one pipelined token")
    timeline = run_on_loop(_timeline, path, info, trace, cfg, rounds[-1]["synthetic_ms_per_layer"] / 1e3, loop=cfg.loop)
    overlap = spread(rd["overlap"] for rd in rounds)
    names = ["io only", "compute only", "pipelined", "serial"]
    summary = {
        name: {
            key: spread(rd["runs"][name][key] for rd in rounds).as_dict()
            for key in ("ms_per_token", "tokens_per_s", "io_wait_ms_per_token", "compute_ms_per_token", "hit_rate")
        }
        for name in names
    }
    executor_summary = {
        fraction: {
            key: spread(rd["executor"][fraction][key] for rd in rounds).as_dict()
            for key in ("tokens_per_s", "ms_per_token", "hit_rate", "compute_ms_per_token", "io_wait_ms_per_token")
        }
        | {"slots": rounds[0]["executor"][fraction]["slots"]}
        for fraction in (rounds[0]["executor"] if rounds else {})
    }
    return {
        "parameters": {
            "rounds": cfg.rounds,
            "tokens": cfg.n_tokens,
            "slab_fraction": cfg.slab_fraction,
            "slab_slots": _slots(info, cfg.slab_fraction),
            "n_experts_total": info.n_experts_total,
            "depth": cfg.depth,
            "seed": cfg.seed,
            "loop": cfg.loop,
            "routing": "uniform random top-k per token and layer (seeded)",
            "executor_tokens": cfg.executor_tokens,
            "executor_fractions": list(cfg.executor_fractions),
        },
        "target_overlap": cfg.target_overlap,
        "rounds": rounds,
        "overlap": overlap.as_dict(),
        "overlap_met": bool(overlap.median <= cfg.target_overlap),
        "serial_over_max": spread(rd["serial_over_max"] for rd in rounds).as_dict(),
        "summary": summary,
        "executor": executor_summary,
        "timeline": timeline,
    }


async def _run_overlap(
    path: str,
    info: ea.ModelInfo,
    trace: np.ndarray,
    cfg: TokenBenchConfig,
    compute: aioexperts.ComputeStep,
    prefetch: bool,
    resident: bool,
) -> ea.TokenTimes:
    return await _overlap_run(path, info, trace, cfg, compute=compute, prefetch=prefetch, resident=resident)


async def _timeline(
    path: str, info: ea.ModelInfo, trace: np.ndarray, cfg: TokenBenchConfig, seconds_per_layer: float
) -> dict[str, Any]:
    recorder = ea.ReadRecorder(info.shard_paths, timestamps=True)
    route_spans: list[tuple[int, float, float]] = []
    times = await _overlap_run(
        path,
        info,
        trace,
        cfg,
        compute=synthetic_compute(seconds_per_layer),
        prefetch=True,
        resident=False,
        recorder=recorder,
        route_spans=route_spans,
    )
    token = len(times.seconds) // 2
    t0 = times.token_starts[token]
    t1 = t0 + times.seconds[token]
    reads = []
    for (shard, offset, n), (start, end) in zip(recorder.reads, recorder.times, strict=True):
        if end >= t0 and start <= t1:
            reads.append(
                {
                    "layer": info.layer_of(shard, offset + n // 2),
                    "start_ms": (start - t0) * 1e3,
                    "end_ms": (end - t0) * 1e3,
                }
            )
    compute = [
        {"layer": layer, "start_ms": (a - t0) * 1e3, "end_ms": (b - t0) * 1e3}
        for layer, (a, b) in zip(info.layers, times.compute_spans[token], strict=False)
    ]
    return {
        "token": token,
        "token_ms": times.seconds[token] * 1e3,
        "synthetic_ms_per_layer": seconds_per_layer * 1e3,
        "reads": reads,
        "compute": compute,
    } | token_phases(times, token, route_spans, recorder, info.layers)


def _ms_within(spans: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """Milliseconds of ``spans`` (perf_counter seconds) inside ``[t0, t1]``."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) * 1e3


def token_phases(
    times: ea.TokenTimes,
    token: int,
    route_spans: Sequence[tuple[int, float, float]],
    recorder: ea.ReadRecorder,
    layers: Sequence[int],
) -> dict[str, Any]:
    """Where one pipelined token's time goes: per layer and in total (the timeline's phases).

    Per layer, in order: ``route`` (the route step on its compute-pool worker), ``wait`` (from the
    route's end to the compute's start: the hand-back to the loop, pinning, waiting for the
    layer's experts (``io_wait_ms`` of it) and the hand-off to a worker), ``compute`` (the compute
    step), ``handoff`` (from the compute's end to the next layer's route: the residual add on a
    worker and two hand-offs). On the loop thread over the token: ``submit_ms`` (the backend's
    ``submit`` calls) and ``reap_ms`` (handling each completion), as the recorder timed them.
    """
    t0 = times.token_starts[token]
    t1 = t0 + times.seconds[token]
    routes = [(a, b) for _layer, a, b in route_spans if t0 <= a <= t1]
    computes = times.compute_spans[token]
    steps = times.layer_steps[token]
    per_layer = []
    for i, layer in enumerate(layers[: min(len(routes), len(computes))]):
        (ra, rb), (ca, cb) = routes[i], computes[i]
        following = routes[i + 1][0] if i + 1 < len(routes) else t1
        per_layer.append(
            {
                "layer": layer,
                "route_ms": (rb - ra) * 1e3,
                "wait_ms": (ca - rb) * 1e3,
                "io_wait_ms": steps[i][0] * 1e3 if i < len(steps) else None,
                "compute_ms": (cb - ca) * 1e3,
                "handoff_ms": (following - cb) * 1e3,
            }
        )
    submit = [(a, b) for a, b, _n in recorder.submit_spans]
    totals = {
        key: sum(row[key] or 0.0 for row in per_layer)
        for key in ("route_ms", "wait_ms", "io_wait_ms", "compute_ms", "handoff_ms")
    }
    return {
        "phases": per_layer,
        "phase_totals_ms": totals | {"before_first_route_ms": ((routes[0][0] if routes else t1) - t0) * 1e3},
        "loop_thread_ms": {
            "submit_ms": _ms_within(submit, t0, t1),
            "submit_calls": sum(1 for a, _b in submit if t0 <= a <= t1),
            "reap_ms": _ms_within(recorder.reap_spans, t0, t1),
            "reaps": sum(1 for a, _b in recorder.reap_spans if t0 <= a <= t1),
        },
    }
