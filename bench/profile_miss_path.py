"""The runner's miss path: loop-thread CPU per missed expert, and where it goes (issue 36, Build 4).

    .venv/bin/python bench/profile_miss_path.py [--backend threads|fake] [--calls 360] [--json]

A synthetic model (4 layers of 64 experts, top-8, 256 x 256 Q4_K matrices: tiny reads, so the
Python around each read dominates) is run through ``MoERunner.moe`` one token at a time, twice: with
a slab of 16 slots (every expert a miss) and of 256 (every expert a hit after the warm-up). The
event loop's thread CPU (``time.thread_time``: the compute pool's threads are not counted) per call
of the all-miss run, less that of the all-hit run, divided by the misses per call, is the Python
cost of one miss on the loop thread: planning and starting its load, submitting and completing its
reads, building its views. A third, all-miss run under ``cProfile`` (the loop thread only) gives
each function's self time per miss, grouped by part (the profiler slows Python code about twice:
use its shares, and the first figure for the total).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import anyio
import numpy as np

import aioexperts
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=64, n_expert_used=8)
#: function file fragments -> part of the miss path
PARTS = (
    ("_cache/cache.py", "cache (pin, start loads, evict, loaded)"),
    ("_cache/scheduler.py", "scheduler (queue, flush, completions)"),
    ("_io/backends", "backend (submit, deliver)"),
    ("concurrent/futures", "backend (submit, deliver)"),
    ("_sources/", "views (slab source, shared views)"),
    ("_io/slab.py", "views (slab source, shared views)"),
    ("_format/views.py", "views (slab source, shared views)"),
    ("_executor.py", "executor and runner"),
    ("_runner.py", "executor and runner"),
    ("_router.py", "executor and runner"),
    ("_pipeline.py", "executor and runner"),
    ("_store.py", "store face"),
    ("asyncio", "event loop"),
    ("anyio", "event loop"),
    ("selectors.py", "event loop"),
)


def _backend(name: str) -> aioexperts.IOOptions:
    if name == "fake":
        return aioexperts.IOOptions(backend=lambda *a: FakeBackend(*a, auto=True))
    return aioexperts.IOOptions(backend=name)


async def _run(path: str, slots: int, backend: str, calls: int, profile: cProfile.Profile | None) -> dict[str, Any]:
    async with aioexperts.open(path, slots=slots, io=_backend(backend)) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        xs = np.random.default_rng(0).standard_normal((calls + 40, 1, SPEC.n_embd)).astype(np.float32)
        for i in range(40):
            await runner.moe(i % SPEC.n_layer, xs[i])
        store.reset_statistics()
        t0 = time.thread_time()
        if profile is not None:
            profile.enable()
        for i in range(40, 40 + calls):
            await runner.moe(i % SPEC.n_layer, xs[i])
        if profile is not None:
            profile.disable()
        cpu = time.thread_time() - t0
        st = store.statistics()
    return {"cpu_s": cpu, "misses": st.demand_misses, "hits": st.cached_hits, "calls": calls}


def _parts(profile: cProfile.Profile, misses: int) -> dict[str, float]:
    stats = pstats.Stats(profile)
    out: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(w in name for w in ("poll", "preadv", "_thread.lock")):
            continue  # waiting (epoll, locks), and the fake backend's reads on this thread
        part = next((p for frag, p in PARTS if frag in filename), "other")
        out[part] += tottime
    return {k: v / misses * 1e6 for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="threads", choices=("threads", "fake", "io_uring", "io_uring_raw", "auto"))
    p.add_argument("--calls", type=int, default=360)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_synthetic_model(path, SPEC)
        miss = anyio.run(_run, path, 16, args.backend, args.calls, None)
        hit = anyio.run(_run, path, 256, args.backend, args.calls, None)
        profile = cProfile.Profile()
        profiled = anyio.run(_run, path, 16, args.backend, args.calls, profile)
    per_call_miss = miss["cpu_s"] / miss["calls"]
    per_call_hit = hit["cpu_s"] / hit["calls"]
    misses_per_call = miss["misses"] / miss["calls"]
    result = {
        "backend": args.backend,
        "loop_cpu_us_per_call_all_miss": per_call_miss * 1e6,
        "loop_cpu_us_per_call_all_hit": per_call_hit * 1e6,
        "misses_per_call": misses_per_call,
        "loop_cpu_us_per_miss": (per_call_miss - per_call_hit) / misses_per_call * 1e6,
        "profiled_self_us_per_miss_by_part": _parts(profile, profiled["misses"]),
    }
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
        return 0
    print(
        f"{args.backend}: loop-thread CPU {result['loop_cpu_us_per_call_all_miss']:.0f} us per all-miss call, "
        f"{result['loop_cpu_us_per_call_all_hit']:.0f} us per all-hit call: "
        f"{result['loop_cpu_us_per_miss']:.0f} us per miss ({misses_per_call:.0f} misses per call)"
    )
    print("under cProfile, self time per miss (us) by part:")
    for part, us in result["profiled_self_us_per_miss_by_part"].items():
        print(f"  {part:45s} {us:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
