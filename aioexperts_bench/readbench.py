"""Cold read rates of the store and of the baselines on exactly the same reads, in paired rounds.

1. A recording pass: a fresh store (io_uring, ``O_DIRECT``, a slab holding every expert) reads
   every expert once in the order of uniform random top-k routing; a wrapper around its backend
   records each read it submits (file, aligned offset, length). That list is the work.
2. Rounds (``rounds``, 5 by default): every method runs once per round, in an order rotated by one
   each round; the page cache is dropped (``POSIX_FADV_DONTNEED``) before each pass, outside the
   timed and CPU-counted part.

   - ``io_uring``: a fresh store reads the same experts again (its reads are recorded again and
     checked against the list);
   - ``fio``: fio replays the list (:mod:`.fio`); ``fio-readv`` the same with the store's
     opcode (``READV_FIXED``; fio's default is ``READ_FIXED``); a fio that fails (a non-zero exit
     status) is reported in one line and left out of that and the remaining rounds
     (``failed`` in the results);
   - ``threads``, ``pread``, ``mmap``: Python replays of the list (:mod:`.replay`);
   - ``uring``, ``uring-reused``: a minimal io_uring loop replaying the list into distinct
     memory, and into ``depth`` reused buffers as fio does (:mod:`.replay`): their ratio shows
     whether it matters where reads land on this machine;
   - ``aioexperts-threads`` (not in the default set): the store with its thread-pool backend.

   The store's pass is followed, in the same store, by its warm figures: microseconds per
   ``experts()`` hit and per ``moe()`` call (:mod:`.warmbench`; after the ``io_uring`` pass, or
   after the ``aioexperts-threads`` pass when ``io_uring`` is not measured); ``pread`` and ``mmap`` are
   followed by their warm pass (a second replay, from the page cache).
3. Ratios (x fio, x mmap, x threads, CPU per GiB against fio) are taken per round and summarised
   as median and range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioexperts.backends import liburing_unusable_reason

from . import store_adapter as ea
from .cachestate import DROP_METHOD, drop_page_cache, probe_host_cache
from .fio import FioError, fio_path, fio_version, run_fio_replay
from .loops import run as run_on_loop
from .measure import GB, GIB, Clock, rotated, spread
from .read_replay import Destination, replay_mmap, replay_pread, replay_uring, uring_slot_bytes
from .readlist import ReadList
from .warmbench import warm_figures

__all__ = ("DEFAULT_METHODS", "METHODS", "ReadBenchConfig", "make_steps", "requests_in_flight", "run_read_bench")

#: Every method the read bench knows, and the default set.
METHODS = ("fio", "io_uring", "threads", "pread", "mmap", "uring", "uring-reused", "fio-readv", "aioexperts-threads")
DEFAULT_METHODS = ("fio", "io_uring", "threads", "pread", "mmap", "uring", "uring-reused", "fio-readv")
#: Human names of the methods, for tables.
LABELS = {
    "fio": "fio replay",
    "fio-readv": "fio replay, readv",
    "io_uring": "aioexperts io_uring",
    "threads": "thread pool O_DIRECT",
    "pread": "buffered preadv",
    "mmap": "mmap copy",
    "uring": "raw io_uring, distinct",
    "uring-reused": "raw io_uring, reused",
    "aioexperts-threads": "aioexperts threads",
}

Step = tuple[int, tuple[int, ...]]
Say = Callable[[str], None]


@dataclass(frozen=True)
class ReadBenchConfig:
    """Parameters of the read bench (all recorded in the results file).

    Attributes:
        depth: reads in flight: the store's queue depth, fio's iodepth.
        rounds: paired rounds.
        methods: which methods, in the order of round 1.
        n_threads: threads of the ``threads`` and ``pread`` replays.
        seed: routing seed.
        n_tokens: tokens per pass (None: every expert once).
        loop: event loop of the store passes.
        warm_calls: ``experts()`` calls timed per warm figure.
        moe_tokens: tokens of ``moe()`` calls timed (each through every MoE layer).
        probe_bytes: bytes per host-cache probe read (0: no probe).
    """

    depth: int = 64
    rounds: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    n_threads: int = 8
    seed: int = 0
    n_tokens: int | None = None
    loop: str = "uvloop"
    warm_calls: int = 2000
    moe_tokens: int = 1
    probe_bytes: int = 256 << 20


def make_steps(info: ea.ModelInfo, n_tokens: int, seed: int) -> list[Step]:
    """Uniform random top-k routing, token-major, with no expert repeated within a pass.

    Each layer draws a seeded permutation of its experts and hands out ``k`` at a time (a new
    permutation when one runs out), so a pass of ``n_experts / k`` tokens reads every expert once.
    """
    rng = np.random.default_rng(seed)
    k = info.n_expert_used
    pools: dict[int, list[int]] = {layer: [] for layer in info.layers}
    steps: list[Step] = []
    for _ in range(n_tokens):
        for layer, n in zip(info.layers, info.n_experts, strict=True):
            pool = pools[layer]
            if len(pool) < k:
                pool.extend(int(e) for e in rng.permutation(n) if int(e) not in pool)
            steps.append((layer, tuple(pool[:k])))
            del pool[:k]
    return steps


def requests_in_flight(depth: int, k: int) -> int:
    """Concurrent layer requests that keep ``depth`` reads (3 per expert) queued."""
    return max(2, math.ceil(2 * depth / (3 * k)))


def _pass(method: str, seconds: float, cpu: float, bytes_read: int, n_reads: int, **extra: Any) -> dict[str, Any]:
    return {
        "method": method,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "bytes_read": bytes_read,
        "n_reads": n_reads,
        "gb_per_s": bytes_read / seconds / GB if seconds > 0 else math.nan,
        "cpu_s_per_gib": cpu / (bytes_read / GIB) if bytes_read else math.nan,
        **extra,
    }


async def _store_pass(
    path: str,
    info: ea.ModelInfo,
    steps: Sequence[Step],
    cfg: ReadBenchConfig,
    backend: str,
    slots: int,
    warm: bool,
) -> tuple[dict[str, Any], ReadList, dict[str, Any] | None]:
    recorder = ea.ReadRecorder(info.shard_paths, backend)
    options = ea.BenchOptions(slots=slots, backend=recorder, queue_depth=cfg.depth)
    async with ea.open_bench_store(path, options) as store:
        drop_page_cache(info.shard_paths)
        with Clock() as clock:
            await ea.cold_pass(store, steps, requests_in_flight(cfg.depth, info.n_expert_used))
        st = ea.store_stats(store)
        warm_out = await warm_figures(store, info, steps, cfg.warm_calls, cfg.moe_tokens, cfg.seed) if warm else None
    reads = recorder.read_list()
    features = st.get("backend_features", {})
    record = _pass(
        "io_uring" if backend == "io_uring" else "aioexperts-threads",
        clock.seconds,
        clock.cpu,
        int(st["bytes_read"]),
        int(st["reads"]),
        payload_bytes=int(st["payload_bytes"]),
        n_experts=int(st["misses"]),
        submissions=int(st["submissions"]),
        p50_ms_per_expert=st.get("expert_latency_p50_ms"),
        p99_ms_per_expert=st.get("expert_latency_p99_ms"),
        direct_io=bool(st["direct_io"]),
        fixed_buffers=bool(features.get("fixed_buffers", False)),
        slab_bytes=int(st["n_slots"]) * int(st["slot_bytes"]),
    )
    return record, reads, warm_out


def _replay_pass(method: str, reads: ReadList, dest: Destination, cfg: ReadBenchConfig) -> dict[str, Any]:
    memory = dest.n_bytes
    if method in ("uring", "uring-reused"):
        reused = method == "uring-reused"
        r = replay_uring(reads, dest, cfg.depth, reused=reused)
        note = f"liburing, O_DIRECT, depth {cfg.depth}, {'reused buffers' if reused else 'distinct memory'}"
        memory = (min(cfg.depth, len(reads)) if reused else len(reads)) * uring_slot_bytes(reads)
    elif method == "mmap":
        r = replay_mmap(reads, dest)
        note = "1 thread copying each range out of a read-only shared mapping"
    else:
        direct = method == "threads"
        r = replay_pread(reads, dest, direct=direct, n_threads=cfg.n_threads)
        note = f"{cfg.n_threads} threads, os.preadv, {'O_DIRECT' if direct else 'buffered'}"
    lat = r.latencies * 1e3
    return _pass(
        method,
        r.seconds,
        r.cpu_seconds,
        r.bytes_read,
        r.n_reads,
        p50_ms_per_read=float(np.percentile(lat, 50)),
        p99_ms_per_read=float(np.percentile(lat, 99)),
        memory_bytes=memory,
        registered_buffers=r.registered,
        note=note,
    )


def _fio_pass(reads: ReadList, cfg: ReadBenchConfig, method: str = "fio") -> dict[str, Any]:
    r = run_fio_replay(reads, cfg.depth, vectored=method == "fio-readv")
    return _pass(
        method,
        r.seconds,
        r.cpu_seconds,
        r.bytes_read,
        r.n_reads,
        process_cpu_seconds=r.process_cpu_seconds,
        wall_seconds=r.wall_seconds,
        p50_ms_per_read=r.p50_ms,
        p99_ms_per_read=r.p99_ms,
        registered_files=r.registered_files,
        memory_bytes=r.buffer_bytes,
        command=r.command,
    )


def _ratio_spread(rounds: list[dict[str, Any]], num: str, den: str, key: str = "gb_per_s") -> dict[str, Any] | None:
    values = [
        r["cold"][num][key] / r["cold"][den][key]
        for r in rounds
        if num in r["cold"] and den in r["cold"] and r["cold"][den][key] > 0
    ]
    return spread(values).as_dict() if values else None


def run_read_bench(
    path: str,
    cfg: ReadBenchConfig,
    *,
    step: Say | None = None,
    note: Say | None = None,
) -> dict[str, Any]:
    """Run the read bench (see the module docstring); returns its section of the results file.

    Args:
        path: the model.
        cfg: parameters.
        step: called before each pass with a label such as ``"round 2/5: fio"``.
        note: called with lines worth showing (fio missing or failing, a read list mismatch).

    Raises:
        aioexperts.AioExpertsError, OSError: the model cannot be read.
    """
    say_step = step or (lambda s: None)
    say = note or (lambda s: None)
    info = ea.model_info(path)
    n_tokens = cfg.n_tokens or max(1, min(info.n_experts) // info.n_expert_used)
    steps = make_steps(info, n_tokens, cfg.seed)
    unique = len({(layer, e) for layer, ids in steps for e in ids})
    methods = list(cfg.methods)
    fio_ok = fio_path() is not None
    if {"fio", "fio-readv"} & set(methods) and not fio_ok:
        say("fio is not installed: no fio replay (apt-get install fio); ratios to fio are left out")
        methods = [m for m in methods if m not in ("fio", "fio-readv")]

    say_step("recording the store's reads (first cold pass)")
    recorder = "io_uring" if liburing_unusable_reason() is None else "threads"  # the same reads either way
    record, reads, _ = run_on_loop(_store_pass, path, info, steps, cfg, recorder, unique, False, loop=cfg.loop)
    probe = None
    if cfg.probe_bytes:
        say_step("probing for a host cache below the guest")
        probe = probe_host_cache(info.shard_paths[0], cfg.probe_bytes)

    rounds: list[dict[str, Any]] = []
    failed: dict[str, str] = {}  # method -> why it stopped (fio exiting with an error)
    with Destination(max(reads.total_bytes, len(reads) * uring_slot_bytes(reads))) as dest:
        for r in range(cfg.rounds):
            order = rotated(methods, r)
            cold: dict[str, Any] = {}
            warm: dict[str, Any] = {}
            for method in order:
                say_step(f"round {r + 1}/{cfg.rounds}: {method}")
                if method in ("io_uring", "aioexperts-threads"):
                    backend = "io_uring" if method == "io_uring" else "threads"
                    # the warm figures follow the io_uring store's pass, or the thread pool's without it
                    warm_here = method == "io_uring" or "io_uring" not in methods
                    rec, got, warm_out = run_on_loop(
                        _store_pass, path, info, steps, cfg, backend, unique, warm_here, loop=cfg.loop
                    )
                    rec["same_reads_as_list"] = got.same_reads(reads)
                    rec["same_order_as_list"] = bool(np.array_equal(got.reads, reads.reads))
                    if not rec["same_reads_as_list"]:
                        say(f"round {r + 1}: the store's reads differ from the recorded list")
                    cold[method] = rec
                    if warm_out is not None:
                        warm["store"] = warm_out
                    continue
                if method in failed:
                    continue
                drop_page_cache(info.shard_paths)
                if method in ("fio", "fio-readv"):
                    try:
                        cold[method] = _fio_pass(reads, cfg, method)
                    except FioError as exc:
                        failed[method] = str(exc)
                        say(f"{LABELS[method]}: {exc}; left out of this and the remaining rounds")
                    continue
                cold[method] = _replay_pass(method, reads, dest, cfg)
                if method in ("pread", "mmap"):  # a second replay: from the page cache
                    again = _replay_pass(method, reads, dest, cfg)
                    n_experts = len(steps) * info.n_expert_used
                    again["us_per_expert"] = again["seconds"] / n_experts * 1e6
                    again["experts_per_s"] = n_experts / again["seconds"]
                    warm[method] = again
            rounds.append({"round": r + 1, "order": order, "cold": cold, "warm": warm})

    summary: dict[str, Any] = {}
    for method in methods:
        passes = [rd["cold"][method] for rd in rounds if method in rd["cold"]]
        summary[method] = {
            "label": LABELS[method],
            "gb_per_s": spread(p["gb_per_s"] for p in passes).as_dict(),
            "cpu_s_per_gib": spread(p["cpu_s_per_gib"] for p in passes).as_dict(),
            "bytes_read": sorted({p["bytes_read"] for p in passes}),
            "n_reads": sorted({p["n_reads"] for p in passes}),
        }
        if method in failed:
            summary[method]["failed"] = failed[method]
    ratios = {
        "io_uring_x_fio": _ratio_spread(rounds, "io_uring", "fio"),
        "io_uring_x_mmap": _ratio_spread(rounds, "io_uring", "mmap"),
        "io_uring_x_threads": _ratio_spread(rounds, "io_uring", "threads"),
        "io_uring_x_pread": _ratio_spread(rounds, "io_uring", "pread"),
        "cpu_io_uring_over_fio": _ratio_spread(rounds, "io_uring", "fio", "cpu_s_per_gib"),
        "cpu_io_uring_over_threads": _ratio_spread(rounds, "io_uring", "threads", "cpu_s_per_gib"),
        "distinct_over_reused_memory": _ratio_spread(rounds, "uring", "uring-reused"),
        "raw_reused_x_fio": _ratio_spread(rounds, "uring-reused", "fio"),
        "io_uring_x_raw": _ratio_spread(rounds, "io_uring", "uring"),
        "io_uring_x_fio_readv": _ratio_spread(rounds, "io_uring", "fio-readv"),
        "fio_readv_x_fio": _ratio_spread(rounds, "fio-readv", "fio"),
    }
    return {
        "parameters": {
            "depth": cfg.depth,
            "rounds": cfg.rounds,
            "methods": methods,
            "n_threads": cfg.n_threads,
            "seed": cfg.seed,
            "tokens_per_pass": n_tokens,
            "experts_per_pass": len(steps) * info.n_expert_used,
            "unique_experts": unique,
            "store_slots": unique,
            "concurrent_layer_requests": requests_in_flight(cfg.depth, info.n_expert_used),
            "loop": cfg.loop,
            "fio": fio_version(),
        },
        "drop_method": DROP_METHOD,
        "read_list": {
            "n_reads": len(reads),
            "bytes_requested": reads.total_bytes,
            "bytes_expected": reads.expected_bytes(),
            "median_read_bytes": reads.median_len,
            "max_read_bytes": reads.max_len,
            "order": "the store's submission order in the recording pass",
        },
        "failed": failed,
        "recording_pass": record,
        "host_cache": None if probe is None else probe.as_dict(),
        "rounds": rounds,
        "summary": summary,
        "ratios": ratios,
        "warm": _warm_summary(rounds),
    }


def _warm_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store = [rd["warm"]["store"] for rd in rounds if "store" in rd["warm"]]
    if store:
        out["store"] = {
            key: spread(w[key] for w in store).as_dict()
            for key in store[0]
            if isinstance(store[0][key], int | float) and not isinstance(store[0][key], bool)
        }
    for method in ("pread", "mmap"):
        ws = [rd["warm"][method] for rd in rounds if method in rd["warm"]]
        if ws:
            out[method] = {
                "us_per_expert": spread(w["us_per_expert"] for w in ws).as_dict(),
                "experts_per_s": spread(w["experts_per_s"] for w in ws).as_dict(),
            }
    return out
