"""Concurrent tokens against the same tokens one after another: throughput must not collapse.

    python bench/concurrency.py [--model PATH] [--tokens 16] [--rounds 5] [--backends numba,numpy]

On the built-in bench model, ``--tokens`` tokens, each routed (seeded, uniform top-8) among the first
``--experts`` experts of every layer, so that the slab holds them all: after one warm-up pass every
expert is a hit and the figure is the compute under concurrency, not the disk. Per round and
backend, interleaved:

* ``sequential``: ``await runner.run_moe_layers(x_t, route_step=...)`` for each token in turn;
* ``concurrent``: one task per token, all started together, each awaiting every MoE layer of its
  token (``run_moe_layers``); the compute pool runs at most one job per core at a time.

Target (issue 12): concurrent wall time <= 1.2x sequential. ``numpy`` is the fallback backend
(numpy kernels + BLAS, capped to one thread per call by the pool). Rounds go to
``concurrency-results.json`` (``--out``; the committed copy: ``docs/results/concurrency.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from _results import fmt_range, summary, write_results
from rich.console import Console

import aioexperts
from aioexperts._compute import fused
from aioexperts._compute.pool import compute_pool
from aioexperts.testing import ensure_bench_model

TARGET = 1.2


def make_route(routing: np.ndarray, layers: list[int]):  # type: ignore[no-untyped-def]
    def route(layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = routing[layers.index(layer)][None, :].astype(np.int32)
        return ids, np.full(ids.shape, 1.0 / ids.shape[1], dtype=np.float32)

    return route


async def measure(path: str, routings: np.ndarray, layers: list[int], xs: np.ndarray, slots: int) -> dict[str, float]:
    routes = [make_route(r, layers) for r in routings]
    async with aioexperts.open(path, slots=slots) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        await runner.warmup()
        for t, route in enumerate(routes):  # warm-up: every expert into the slab, kernels ready
            await runner.run_moe_layers(xs[t : t + 1], route_step=route, prefetch=False)
        store.reset_statistics()
        t0 = time.perf_counter()
        for t, route in enumerate(routes):
            await runner.run_moe_layers(xs[t : t + 1], route_step=route, prefetch=False)
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(
            *(runner.run_moe_layers(xs[t : t + 1], route_step=route, prefetch=False) for t, route in enumerate(routes))
        )
        concurrent = time.perf_counter() - t0
        st = store.statistics()
    return {
        "sequential_s": sequential,
        "concurrent_s": concurrent,
        "ratio": concurrent / sequential,
        "hit_rate": st.hit_rate,
        "tokens": len(routes),
    }


def main() -> int:
    # the bench model's random weights overflow float32 after a few layers (inf/NaN); timing is unaffected
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the built-in bench model)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32, help="experts per layer the routing draws from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="numba,numpy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    console = Console(width=132)
    started = time.time()
    path = args.model or os.fspath(ensure_bench_model())
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    layers = list(layout.layers)
    k, n_embd = layout.n_expert_used, layout.n_embd
    rng = np.random.default_rng(args.seed)
    routings = np.stack(
        [np.stack([rng.permutation(args.experts)[:k] for _ in layers]) for _ in range(args.tokens)]
    )  # (tokens, layers, k)
    xs = (rng.standard_normal((args.tokens, n_embd)) * 0.01).astype(np.float32)
    slots = args.experts * len(layers)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    rounds = []
    for r in range(args.rounds):
        for name in backends:
            fused.set_backend(name)  # type: ignore[arg-type]
            figures = asyncio.run(measure(path, routings, layers, xs, slots))
            rounds.append({"round": r, "backend": name, **figures})
            console.print(
                f"[dim]round {r} {name}: sequential {figures['sequential_s']:.3f} s, "
                f"concurrent {figures['concurrent_s']:.3f} s[/dim]"
            )
    fused.set_backend(None)
    result = {}
    console.print(
        f"\n{args.tokens} tokens x {len(layers)} layers x top-{k} (among {args.experts} experts per layer, all in the "
        f"slab), compute pool of {compute_pool().n_threads} threads; median (min-max) over {args.rounds} rounds"
    )
    for name in backends:
        sel = [x for x in rounds if x["backend"] == name]
        seq = [x["sequential_s"] / x["tokens"] * 1e3 for x in sel]
        conc = [x["concurrent_s"] / x["tokens"] * 1e3 for x in sel]
        ratio = [x["ratio"] for x in sel]
        met = "met" if summary(ratio)["median"] <= TARGET else "missed"
        console.print(
            f"{name:>6}: one after another {fmt_range(seq, '.1f')} ms/token, concurrent {fmt_range(conc, '.1f')} "
            f"ms/token: concurrent/sequential {fmt_range(ratio)} (target <= {TARGET}: {met})"
        )
        result[name] = {"sequential_ms_per_token": summary(seq), "concurrent_ms_per_token": summary(conc),
                        "ratio": summary(ratio)}  # fmt: skip
    out = write_results(
        args.out,
        "concurrency",
        {"model": path, "tokens": args.tokens, "experts_per_layer": args.experts, "rounds": args.rounds,
         "slots": slots, "pool_threads": compute_pool().n_threads, "seed": args.seed, "target": TARGET},
        {"sequential_s": "seconds for all tokens one after another", "concurrent_s": "seconds for all tokens at once",
         "ratio": "concurrent_s / sequential_s"},
        rounds,
        result,
        started,
    )  # fmt: skip
    console.print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
