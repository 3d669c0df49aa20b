"""Where the store's CPU per read goes: submission, Iovec handling, reaping, bookkeeping, callbacks.

    python bench/profile_reads.py [--model PATH] [--depth 64] [--rounds 3] [--loop uvloop] [--json]

A cold pass over every expert of the model (a fresh store with a slab holding them all,
io_uring, ``O_DIRECT``, uniform random top-k routing, as in the read bench) is run three ways,
``--rounds`` times each:

1. **plain**: nothing added: CPU per read (user and system, from ``getrusage``), the reference;
2. **timers**: thin wall-clock wrappers (about 0.2 us each) around the synchronous functions of the
   read path, patched onto the classes and the ``liburing`` module in this process only (no source
   changes): inclusive times per read of ``io_uring_submit``, the rest of ``UringBackend.submit``
   (SQE preparation), ``_iovec``, ``UringBackend._reap`` less the completions it delivers (the
   completion walk), the completion callbacks (``_deliver`` -> the scheduler's ``_on_read`` -> the
   cache), the scheduler's ``flush`` less the submit it calls; the remainder of the CPU is the
   request side (``experts()``, ``acquire``, pinning, views, tasks and the event loop);
3. **cProfile**: self time of every function, grouped into the same parts (the profiler slows
   Python code about twice, so use its shares inside a part, and the timers for the split).

The wall-clock timers measure time on the loop thread; with one thread doing all the work (the
io_uring backend) that is its CPU, plus any wait inside a system call (``io_uring_submit``
issues the direct reads inline, which is kernel CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import liburing

import aioexperts._sources.slab as slab_source_module
from aioexperts._cache.cache import ExpertCache
from aioexperts._cache.scheduler import ReadScheduler
from aioexperts._io.backends.uring import UringBackend
from aioexperts._sources.slab import SlabSource
from aioexperts.backends import IOBackend
from aioexperts.testing import ensure_bench_model
from aioexperts_bench import (
    BenchOptions,
    Clock,
    ModelInfo,
    cold_pass,
    drop_page_cache,
    dump_json,
    make_steps,
    model_info,
    open_bench_store,
    requests_in_flight,
    run_on_loop,
    spread,
    store_stats,
)

PARTS = (
    "io_uring_submit (kernel issues the reads)",
    "SQE preparation (rest of submit)",
    "Iovec lookup (_iovec)",
    "completion walk (_reap less callbacks)",
    "completion callbacks (_deliver, _on_read, cache)",
    "scheduler flush (less submit)",
    "expert planning (plan_all_experts, at open)",
    "pinning (cache._pin_all: slot, eviction, enqueue)",
    "views (SlabSource.view)",
    "release (cache.release)",
    "rest: experts()/acquire coroutines, tasks, loop, GC",
)


class Timers:
    """Inclusive wall time and calls of wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += clock() - t0
                calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def undo(self) -> None:
        for f in reversed(self._undo):
            f()
        self._undo.clear()


class GcTimer:
    """Wall time spent in the cyclic garbage collector (``gc.callbacks``), by generation."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def _pass(
    path: str, info: ModelInfo, steps: list[Any], depth: int, profiler: cProfile.Profile | None
) -> dict[str, float]:
    options = BenchOptions(slots=info.n_experts_total, backend="io_uring", queue_depth=depth)
    async with open_bench_store(path, options) as store:
        drop_page_cache(info.shard_paths)
        if profiler is not None:
            profiler.enable()
        with Clock() as clock, GcTimer() as gc_timer:
            await cold_pass(store, steps, requests_in_flight(depth, info.n_expert_used))
        if profiler is not None:
            profiler.disable()
        st = store_stats(store)
        with Clock() as warm:  # the same requests again, all hits: the driver and the hit path
            await cold_pass(store, steps, requests_in_flight(depth, info.n_expert_used))
    return {
        "seconds": clock.seconds,
        "cpu": clock.cpu,
        "user": clock.user,
        "system": clock.system,
        "warm_cpu": warm.cpu,
        "gc_seconds": sum(gc_timer.seconds),
        "gc_collections": gc_timer.collections,
        "reads": st["reads"],
        "bytes": st["bytes_read"],
    }


def _cpu_split(path: str, info: ModelInfo, steps: list[Any], depth: int, loop: str) -> dict[str, float]:
    return run_on_loop(_pass, path, info, steps, depth, None, loop=loop)


def _timed_pass(path: str, info: ModelInfo, steps: list[Any], depth: int, loop: str) -> dict[str, float]:
    timers = Timers()
    timers.wrap(liburing, "io_uring_submit", "io_uring_submit")
    timers.wrap(UringBackend, "submit", "submit")
    timers.wrap(UringBackend, "_iovec", "iovec")
    timers.wrap(UringBackend, "_reap", "reap")
    timers.wrap(IOBackend, "_deliver", "deliver")
    timers.wrap(ReadScheduler, "flush", "flush")
    timers.wrap(ExpertCache, "release", "release")
    timers.wrap(ExpertCache, "_pin_all", "pin")
    timers.wrap(slab_source_module, "plan_all_experts", "plan")  # at open, off the loop: 0 per read
    timers.wrap(SlabSource, "view", "view")
    try:
        base = run_on_loop(_pass, path, info, steps, depth, None, loop=loop)
    finally:
        timers.undo()
    s = timers.seconds
    parts = {
        PARTS[0]: s["io_uring_submit"],
        PARTS[1]: s["submit"] - s["io_uring_submit"] - s["iovec"],
        PARTS[2]: s["iovec"],
        PARTS[3]: s["reap"] - s["deliver"],
        PARTS[4]: s["deliver"],
        PARTS[5]: s["flush"] - s["submit"],
        PARTS[6]: s["plan"],
        PARTS[7]: s["pin"],
        PARTS[8]: s["view"],
        PARTS[9]: s["release"],
    }
    parts[PARTS[10]] = base["cpu"] - sum(parts.values())
    return {"cpu": base["cpu"], "reads": base["reads"], **parts, **{f"calls {k}": v for k, v in timers.calls.items()}}


def _category(filename: str, func: str) -> str:
    name = f"{filename}:{func}"
    if "io_uring_submit" in func:
        return PARTS[0]
    if "_iovec" in func or "Iovec" in func or "raw_buffer" in func or "raw_span" in func:
        return PARTS[2]
    if "io_uring_prep" in func or "get_sqe" in func or "sqe_set" in func or "sq_ready" in func:
        return PARTS[1]
    if "backends/uring.py" in filename and func in ("submit", "_submit_all"):
        return PARTS[1]
    if "CqeIter" in name or "cq_advance" in func or "eventfd_read" in func or func == "_reap" or "res" == func:
        return PARTS[3]
    if "backends/base.py" in filename or func in (
        "_on_read",
        "_check_length",
        "_op_finished",
        "_loaded",
        "_signal_space",
    ):
        return PARTS[4]
    if "scheduler.py" in filename:
        return PARTS[5]
    if "plan.py" in filename or "layout.py" in filename or func in ("plan_expert", "plan_all_experts"):
        return PARTS[6]
    if func == "_view" or "views.py" in filename or ("slab.py" in filename and func == "view"):
        return PARTS[8]
    if func == "release" and "cache.py" in filename:
        return PARTS[9]
    if "cache.py" in filename or "eviction.py" in filename:
        return PARTS[7]
    return PARTS[10]


def _profiled_pass(path: str, info: ModelInfo, steps: list[Any], depth: int, loop: str) -> dict[str, Any]:
    profiler = cProfile.Profile()
    base = run_on_loop(_pass, path, info, steps, depth, profiler, loop=loop)
    stats = pstats.Stats(profiler)
    by_part: dict[str, float] = defaultdict(float)
    top = []
    for (filename, _line, func), (_cc, nc, tottime, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        by_part[_category(filename, func)] += tottime
        top.append((tottime, nc, f"{os.path.basename(filename)}:{func}"))
    total = sum(by_part.values())
    top.sort(reverse=True)
    return {
        "reads": base["reads"],
        "shares": {p: by_part[p] / total for p in PARTS},
        "top": [{"self_us_per_read": t / base["reads"] * 1e6, "calls": n, "function": f} for t, n, f in top[:25]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the built-in bench model)")
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio", "trio"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    path = args.model or os.fspath(ensure_bench_model())
    info = model_info(path)
    steps = make_steps(info, max(1, min(info.n_experts) // info.n_expert_used), seed=0)
    plain, timed, profiled = [], [], []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        gc.collect()
        plain.append(_cpu_split(path, info, steps, args.depth, args.loop))
        gc.collect()
        timed.append(_timed_pass(path, info, steps, args.depth, args.loop))
        gc.collect()
        profiled.append(_profiled_pass(path, info, steps, args.depth, args.loop))
    per_read = {
        "cpu_us": spread(p["cpu"] / p["reads"] * 1e6 for p in plain).as_dict(),
        "user_us": spread(p["user"] / p["reads"] * 1e6 for p in plain).as_dict(),
        "system_us": spread(p["system"] / p["reads"] * 1e6 for p in plain).as_dict(),
        "gb_per_s": spread(p["bytes"] / p["seconds"] / 1e9 for p in plain).as_dict(),
        "gc_us": spread(p["gc_seconds"] / p["reads"] * 1e6 for p in plain).as_dict(),
        "same_requests_all_hits_cpu_us": spread(p["warm_cpu"] / p["reads"] * 1e6 for p in plain).as_dict(),
    }
    parts = {p: spread(t[p] / t["reads"] * 1e6 for t in timed).as_dict() for p in PARTS}
    timed_cpu = spread(t["cpu"] / t["reads"] * 1e6 for t in timed).as_dict()
    shares = {p: spread(x["shares"][p] for x in profiled).as_dict() for p in PARTS}
    result = {
        "model": path,
        "depth": args.depth,
        "rounds": args.rounds,
        "loop": args.loop,
        "reads_per_pass": plain[0]["reads"],
        "plain_per_read": per_read,
        "timers_cpu_us_per_read": timed_cpu,
        "timers_us_per_read": parts,
        "cprofile_shares": shares,
        "cprofile_top": profiled[-1]["top"],
        "calls": {k: v for k, v in timed[-1].items() if k.startswith("calls ")},
    }
    if args.json:
        dump_json(result, sys.stdout, indent=1)
        print()
        return 0
    print(
        f"{result['reads_per_pass']} reads per pass, depth {args.depth}, {args.loop}, median (min-max) of {args.rounds}"
    )
    print(
        f"plain: CPU {per_read['cpu_us']['median']:.1f} us/read (user {per_read['user_us']['median']:.1f}, "
        f"system {per_read['system_us']['median']:.1f}), {per_read['gb_per_s']['median']:.2f} GB/s"
    )
    gc_us = per_read["gc_us"]["median"]
    print(f"cyclic GC during the pass: {gc_us:.1f} us/read ({plain[-1]['gc_collections']} collections by generation)")
    print(
        f"the same requests again, all hits (bench driver + hit path): "
        f"{per_read['same_requests_all_hits_cpu_us']['median']:.1f} us per read of the cold pass"
    )
    print(f"timers: CPU {timed_cpu['median']:.1f} us/read (wrappers add about 0.2 us per wrapped call)")
    print(f"{'part':<54} {'us/read (timers)':>18} {'share (cProfile)':>18}")
    for p in PARTS:
        t, s = parts[p], shares[p]
        print(f"{p:<54} {t['median']:>8.1f} ({t['min']:.1f}-{t['max']:.1f}) {s['median']:>10.0%}")
    print("cProfile top functions by self time (last round):")
    for row in result["cprofile_top"][:15]:
        print(f"  {row['self_us_per_read']:7.2f} us/read  {row['calls']:>7} calls  {row['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
