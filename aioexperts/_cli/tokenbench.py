"""Per-token benchmark: tokens/s and latency with prefetch on and off, and the I/O-compute overlap.

Every run replays the same seeded routing (uniform random top-k per token and layer) through a
fresh engine (a cold slab of ``slab_fraction`` of all experts), one token at a time through every
MoE layer with :meth:`Engine.run_token`:

- ``io only``: no compute, the oracle prefetch on: how fast the experts stream (the I/O time),
  idle and while another process keeps one core busy (the CPU load the compute step adds);
- ``serial``: compute, no prefetch: I/O and compute one after the other;
- ``pipelined (<predictor>)``: compute in a worker thread while the next layer's predicted
  experts are read. ``oracle`` knows the next layer's routing (the upper bound of overlap);
  ``previous`` and ``frequency`` are real predictors (they cannot guess uniform random routing);
- the overlap figure ``token_time / max(io_time, compute_time)`` of the oracle run (1.0 is
  perfect overlap, 2.0 none);
- hit rates of the LRU, LFU and LFUDA eviction policies on a skewed trace (popular experts and
  token-to-token locality, where policies differ), and a trace replay of LRU, LFU, LFUDA and
  Belady's optimum at slabs of 10 %, 25 % and 50 % of the experts.

The compute step is either ``synthetic`` (numpy matrix products in the worker thread, calibrated
to take as long per layer as the measured I/O: "a compute step of the same order as I/O") or
``executor`` (the real numpy MoE executor on the model's experts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._cache.replay import ReplayResult, replay_fractions
from .._format.layout import ExpertLayout, build_layout
from .._format.model import open_model
from .._format.views import ExpertView
from .._options import CacheOptions, IOOptions, PrefetchOptions
from .._pipeline import ComputeStep
from .._predict.predictors import Predictor, make_predictor
from .._predict.trace import RoutingTrace, skewed_random_trace, uniform_random_trace
from .._runner import MoERunner
from .._store import open as open_store

__all__ = ("OraclePredictor", "TokenBenchResult", "TokenRun", "run_token_bench")


class OraclePredictor(Predictor):
    """Knows the routing in advance (from a trace): an upper bound for any real predictor."""

    name = "oracle"

    def __init__(self, trace: RoutingTrace) -> None:
        self.trace = trace
        self.token = 0

    def observe(self, layer: int, x: np.ndarray | None, ids: np.ndarray) -> None:
        return None

    def predict(self, layer: int, next_layer: int, x: np.ndarray | None, budget: int) -> list[int]:
        token = self.token + 1 if next_layer <= layer else self.token  # wrapped to the next token
        if token >= self.trace.n_tokens:
            return []
        row = self.trace.ids[token, self.trace.layer_index(next_layer)]
        return [int(e) for e in row if e >= 0][:budget]

    def reset(self) -> None:
        self.token = 0


@dataclass(frozen=True)
class TokenRun:
    """One run of the per-token benchmark.

    Attributes:
        name: run name.
        tokens: tokens run.
        seconds: wall time of all tokens.
        p50_ms, p99_ms: per-token latency percentiles.
        io_wait_s: time spent waiting for experts (summed over tokens).
        compute_s: compute time in the worker thread (summed over tokens).
        hit_rate: resident hits / expert requests.
        prefetch_hits: requests served by a prefetched expert (resident or in flight).
        prefetch_issued, prefetch_wasted: prefetch loads started / evicted unused.
        bytes_read: bytes read from the device.
    """

    name: str
    tokens: int
    seconds: float
    p50_ms: float
    p99_ms: float
    io_wait_s: float
    compute_s: float
    hit_rate: float
    prefetch_hits: int
    prefetch_issued: int
    prefetch_wasted: int
    bytes_read: int
    requests: int

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds

    @property
    def ms_per_token(self) -> float:
        """Mean milliseconds per token."""
        return self.seconds / self.tokens * 1e3


def _noop(layer: int, x: np.ndarray, views: Mapping[int, ExpertView], ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


@contextlib.contextmanager
def cpu_load() -> Iterator[None]:
    """Keep one core busy in another process (numpy matrix products), like the compute step does."""
    code = (
        "import numpy as np\n"
        "a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32); b = a\n"
        "while True: b = np.tanh(a @ b)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    try:
        time.sleep(0.3)
        yield
    finally:
        proc.kill()
        proc.wait()


def synthetic_compute(seconds_per_layer: float, n_embd: int) -> ComputeStep:
    """A compute step of numpy matrix products (the GIL is released) lasting ``seconds_per_layer``."""
    a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)

    def compute(
        layer: int, x: np.ndarray, views: Mapping[int, ExpertView], ids: np.ndarray, w: np.ndarray
    ) -> np.ndarray:
        end = time.perf_counter() + seconds_per_layer
        b = a
        while time.perf_counter() < end:
            b = np.tanh(a @ b)
        return np.zeros_like(x)

    return compute


async def _run(
    path: str,
    name: str,
    trace: RoutingTrace,
    slots: int,
    compute: ComputeStep,
    predictor: Predictor | None,
    depth: int,
    n_embd: int,
    budget: int,
    policy: str = "lru",
) -> TokenRun:
    layers = trace.layers
    async with open_store(
        path, cache=CacheOptions(slots=slots, policy=policy), io=IOOptions(queue_depth=depth)
    ) as store:
        engine = MoERunner(store, prefetch=PrefetchOptions(predictor="none", budget=budget))
        token = 0

        def route(layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            ids = trace.ids[token, layers.index(layer)][None, :].astype(np.int32)
            return ids, np.full(ids.shape, 1.0 / ids.shape[1], dtype=np.float32)

        x = np.zeros((1, n_embd), dtype=np.float32)
        io_wait = compute_s = 0.0
        latencies = []
        t0 = time.perf_counter()
        for token in range(trace.n_tokens):
            if isinstance(predictor, OraclePredictor):
                predictor.token = token
            result = await engine.run_token(
                x, route_step=route, compute=compute, predictor=predictor, prefetch=predictor is not None
            )
            latencies.append(result.seconds)
            io_wait += result.io_wait_seconds
            compute_s += result.compute_seconds
        seconds = time.perf_counter() - t0
        st = store.statistics()
    lat = np.asarray(latencies) * 1e3
    return TokenRun(
        name,
        trace.n_tokens,
        seconds,
        float(np.percentile(lat, 50)),
        float(np.percentile(lat, 99)),
        io_wait,
        compute_s,
        st.hit_rate,
        st.prefetch_hits,
        st.prefetch_issued,
        st.prefetch_wasted,
        st.bytes_read,
        st.requests,
    )


@dataclass(frozen=True)
class TokenBenchResult:
    """Everything the per-token benchmark measured in one run.

    Attributes:
        runs: median run (by time) of each configuration, in the order they ran.
        policy_runs: hit rates of each eviction policy on the skewed trace (no prefetch, no compute).
        replay: trace replay ``{trace name: {fraction: {policy: ReplayResult}}}``.
        io_ms_per_token, compute_ms_per_token: median I/O-only and compute time per token.
        overlap: ``token_time / max(io_time, compute_time)`` of the pipelined oracle run.
        other_overlaps: the same figure with the synthetic compute at 0.5x and 2x the I/O time.
        io_loaded_ms_per_token: I/O-only time while another process keeps one core busy.
        overlap_loaded: ``overlap`` against that I/O time (on a shared virtual disk the device
            itself slows down when a core is busy, which the pipeline cannot hide).
    """

    runs: list[TokenRun]
    policy_runs: list[TokenRun]
    replay: dict[str, dict[float, dict[str, ReplayResult]]]
    io_ms_per_token: float
    compute_ms_per_token: float
    overlap: float
    compute: str
    slots: int
    n_experts_total: int
    repeat: int
    other_overlaps: dict[str, float]
    io_loaded_ms_per_token: float
    overlap_loaded: float


def run_token_bench(
    path: str,
    *,
    n_tokens: int = 24,
    seed: int = 0,
    slab_fraction: float = 0.25,
    depth: int = 64,
    compute: str = "synthetic",
    predictors: Sequence[str] = ("previous", "frequency"),
    policies: Sequence[str] = ("lru", "lfu", "lfuda"),
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> TokenBenchResult:
    """Run the per-token benchmark on ``path`` (see the module docstring).

    The device speed of a shared virtual disk drifts from run to run, so every configuration runs
    ``repeat`` times, interleaved, and the median is kept.
    """
    model = open_model(path)
    layout: ExpertLayout = build_layout(model)
    n_embd = layout.n_embd
    layers = list(layout.layers)
    n_experts = [m.n_experts for m in layout.layers.values()]
    k = layout.n_expert_used
    trace = uniform_random_trace(n_tokens, layers, n_experts, k, seed)
    skewed = skewed_random_trace(n_tokens * 4, layers, n_experts, k, seed)
    slots = max(2 * k, int(layout.n_experts_total * slab_fraction))
    say = progress or (lambda line: None)

    def run(
        name: str,
        step: ComputeStep,
        predictor: Predictor | None,
        t: RoutingTrace = trace,
        policy: str = "lru",
    ) -> TokenRun:
        say(f"tokens: {name}")
        return asyncio.run(_run(path, name, t, slots, step, predictor, depth, n_embd, k, policy))

    steps: dict[str, ComputeStep] = {}
    results: dict[str, list[TokenRun]] = {}
    for _ in range(repeat):
        io_only = run("io only (oracle prefetch)", _noop, OraclePredictor(trace))
        if not steps:  # calibrate once, on the first I/O-only run
            per_layer = io_only.ms_per_token / 1e3 / len(layers)
            if compute == "synthetic":
                steps = {f"{scale:g}x": synthetic_compute(scale * per_layer, n_embd) for scale in (1.0, 0.5, 2.0)}
            else:
                steps = {"executor": _executor_compute(path)}
        main = next(iter(steps.values()))
        with cpu_load():
            io_loaded = run("io only, one core busy elsewhere", _noop, OraclePredictor(trace))
        batch = [
            io_only,
            io_loaded,
            run("serial (no prefetch)", main, None),
            run("pipelined (oracle)", main, OraclePredictor(trace)),
            *(run(f"pipelined ({name})", main, make_predictor(name)) for name in predictors),
            *(
                run(f"pipelined (oracle), compute {label} I/O", step, OraclePredictor(trace))
                for label, step in list(steps.items())[1:]
            ),
        ]
        for r in batch:
            results.setdefault(r.name, []).append(r)
    runs = [sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for rs in results.values()]
    by_name = {r.name: r for r in runs}
    io_ms = by_name["io only (oracle prefetch)"].ms_per_token
    oracle = by_name["pipelined (oracle)"]
    compute_ms = float(np.median([r.compute_s / r.tokens * 1e3 for r in results["pipelined (oracle)"]]))
    overlap = oracle.ms_per_token / max(io_ms, compute_ms)
    io_loaded_ms = by_name["io only, one core busy elsewhere"].ms_per_token
    overlap_loaded = oracle.ms_per_token / max(io_loaded_ms, compute_ms)
    extra = {
        r.name: r.ms_per_token / max(io_ms, r.compute_s / r.tokens * 1e3)
        for r in runs
        if r.name.startswith("pipelined (oracle), compute")
    }
    policy_runs = [run(f"policy {p} (skewed trace)", _noop, None, skewed, p) for p in policies]
    # fractions whose slab cannot hold one layer's top-k at once are left out (tiny test models)
    fractions = [f for f in (0.1, 0.25, 0.5) if round(f * layout.n_experts_total) >= k]
    replay = {
        "uniform": replay_fractions(uniform_random_trace(n_tokens * 4, layers, n_experts, k, seed), fractions),
        "skewed": replay_fractions(skewed, fractions),
    }
    return TokenBenchResult(
        runs,
        policy_runs,
        replay,
        io_ms,
        compute_ms,
        overlap,
        compute,
        slots,
        layout.n_experts_total,
        repeat,
        extra,
        io_loaded_ms,
        overlap_loaded,
    )


def _executor_compute(path: str) -> ComputeStep:
    """The real executor (router weights are not needed: routing comes from the trace)."""
    from .._compute.executor import ResidentLayer, moe_forward
    from .._format.hparams import MoEHParams

    model = open_model(path)
    hparams = MoEHParams.from_metadata(model.architecture, model.metadata)
    layout = build_layout(model)
    residents = {
        layer: ResidentLayer(layer, np.zeros((moe.n_experts, hparams.n_embd), dtype=np.float32))
        for layer, moe in layout.layers.items()
    }

    def compute(
        layer: int, x: np.ndarray, views: Mapping[int, ExpertView], ids: np.ndarray, w: np.ndarray
    ) -> np.ndarray:
        return moe_forward(x, ids, w, views, residents[layer], hparams).ffn_out

    return compute
