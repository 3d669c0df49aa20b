"""Sweeps for the plots: read rate and CPU per GiB against queue depth and against read size.

Each point is a cold pass over a quarter of the model's experts (the store's reads of it,
recorded, are the work of fio and the thread pool at that point), ``rounds`` times in rotated
order; the plots show the median and the range. Depth: 1..128 (the store needs at least 3: one
expert is 3 reads). Read size: the recorded reads cut into pieces of 64 KiB up to their own size
(about 868 KiB for the built-in model) for fio and the thread pool; the store's reads are the
model's segments, so the store is one point at its own size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import store_adapter as ea
from .cachestate import drop_page_cache
from .fio import FioError, fio_path, run_fio_replay
from .loops import run as run_on_loop
from .measure import GB, GIB, Clock, rotated, spread
from .read_replay import Destination, replay_pread
from .readbench import ReadBenchConfig, make_steps, requests_in_flight
from .readlist import ReadList

__all__ = ("DEPTHS", "SIZES", "run_sweeps")

DEPTHS = (1, 2, 4, 8, 16, 32, 64, 128)
SIZES = (64 << 10, 128 << 10, 256 << 10, 512 << 10)
Say = Callable[[str], None]


async def _store(path: str, info: ea.ModelInfo, steps: list[Any], depth: int) -> tuple[dict[str, float], ReadList]:
    recorder = ea.ReadRecorder(info.shard_paths)
    options = ea.BenchOptions(slots=len(steps) * info.n_expert_used, backend=recorder, queue_depth=depth)
    async with ea.open_bench_store(path, options) as store:
        drop_page_cache(info.shard_paths)
        with Clock() as clock:
            await ea.cold_pass(store, steps, requests_in_flight(depth, info.n_expert_used))
        n = int(ea.store_stats(store)["bytes_read"])
    return _point(clock.seconds, clock.cpu, n), recorder.read_list()


def _point(seconds: float, cpu: float, n_bytes: int) -> dict[str, float]:
    return {"gb_per_s": n_bytes / seconds / GB, "cpu_s_per_gib": cpu / (n_bytes / GIB), "bytes": n_bytes}


def _others(
    reads: ReadList, depth: int, dest: Destination, methods: list[str], failed: dict[str, str], note: Say | None
) -> dict[str, dict[str, float]]:
    out = {}
    for method in methods:
        if method in failed:
            continue
        drop_page_cache(reads.paths)
        if method == "fio":
            try:
                f = run_fio_replay(reads, depth)
            except FioError as exc:
                failed[method] = str(exc)
                if note:
                    note(f"sweep: {exc}; fio left out of the rest of the sweeps")
                continue
            out[method] = _point(f.seconds, f.cpu_seconds, f.bytes_read)
        else:
            r = replay_pread(reads, dest, direct=True, n_threads=depth)
            out[method] = _point(r.seconds, r.cpu_seconds, r.bytes_read)
    return out


def _summarise(samples: dict[Any, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    return {
        str(x): {
            m: {k: spread(p[k] for p in ps).as_dict() for k in ("gb_per_s", "cpu_s_per_gib")} for m, ps in by.items()
        }
        for x, by in samples.items()
    }


def run_sweeps(path: str, cfg: ReadBenchConfig, *, rounds: int = 2, note: Say | None = None) -> dict[str, Any]:
    """Depth and read-size sweeps of io_uring (the store), fio and the thread pool."""
    info = ea.model_info(path)
    n_tokens = max(1, min(info.n_experts) // info.n_expert_used // 4)
    steps = make_steps(info, n_tokens, cfg.seed + 1)
    others = ["threads"] + (["fio"] if fio_path() else [])
    by_depth: dict[int, dict[str, list[dict[str, float]]]] = {d: {} for d in DEPTHS}
    by_size: dict[int, dict[str, list[dict[str, float]]]] = {s: {} for s in SIZES}
    native: list[dict[str, float]] = []
    base: ReadList | None = None
    failed: dict[str, str] = {}
    for r in range(rounds):
        for depth in DEPTHS:
            if note:
                note(f"sweep round {r + 1}/{rounds}: depth {depth}")
            point: dict[str, dict[str, float]] = {}
            order = rotated(["io_uring", *others], r)
            reads: ReadList | None = None
            if depth >= 3:
                point["io_uring"], reads = run_on_loop(_store, path, info, steps, depth, loop=cfg.loop)
                base = base or reads
            if reads is None:
                _, reads = run_on_loop(_store, path, info, steps, 3, loop=cfg.loop)
                base = base or reads
            with Destination(reads.total_bytes) as dest:
                point.update(_others(reads, depth, dest, [m for m in order if m != "io_uring"], failed, note))
            for m, p in point.items():
                by_depth[depth].setdefault(m, []).append(p)
            if depth == cfg.depth and "io_uring" in point:
                native.append(point["io_uring"])
        assert base is not None
        for size in SIZES:
            if note:
                note(f"sweep round {r + 1}/{rounds}: read size {size >> 10} KiB")
            cut = base.resized(size)
            with Destination(cut.total_bytes) as dest:
                for m, p in _others(cut, cfg.depth, dest, rotated(others, r), failed, note).items():
                    by_size[size].setdefault(m, []).append(p)
    native_size = base.median_len if base else 0
    return {
        "rounds": rounds,
        "depth_for_sizes": cfg.depth,
        "reads_per_point": len(base) if base else 0,
        "failed": failed,
        "depths": _summarise(by_depth),
        "sizes": _summarise(by_size),
        "native_size": native_size,
        "native": {"io_uring": {k: spread(p[k] for p in native).as_dict() for k in ("gb_per_s", "cpu_s_per_gib")}}
        if native
        else {},
    }
