"""Per-expert read rates of aioexperts and of the baselines people use today, on the same routing.

Every method reads the same sequence of experts, cold then warm, into memory the process owns:

- ``aioexperts io_uring``: the engine with ``backend="io_uring"`` and ``O_DIRECT``;
- ``aioexperts threads``: the engine with its thread-pool ``preadv`` backend and ``O_DIRECT``;
- ``buffered pread``: a pool of threads calling ``os.preadv`` on the exact byte ranges, after
  ``POSIX_FADV_DONTNEED`` dropped the file from the page cache;
- ``mmap``: copying each range out of an ``mmap`` of the file (page faults plus readahead), after
  ``DONTNEED``;
- ``fio``: ``fio`` io_uring ``O_DIRECT`` random reads of the same block size and depth, with
  registered buffers and file (``--fixedbufs --registerfiles``, as the engine uses them; without
  them fio measured 1.0-1.5 GB/s here against 2.4-2.7 with them), when fio is installed: the
  device's own limit.

Cold is the first pass after the caches were dropped (a fresh engine; ``DONTNEED`` for buffered
methods); warm is the second pass over the same experts (engine: slab hits; buffered: page cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import mmap
import os
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .._format.layout import ExpertLayout, ExpertLocation, build_layout
from .._format.model import GGUFModel, open_model
from .._io.align import widen
from .._options import IOOptions
from .._store import open as open_store

__all__ = ("Method", "PassResult", "Step", "make_steps", "run_read_bench")

#: ``(layer, expert ids)``: the experts one token routes to in one MoE layer.
Step = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class PassResult:
    """One pass of one method.

    Attributes:
        method: method name.
        phase: ``"cold"`` or ``"warm"``.
        n_experts: experts delivered.
        payload_bytes: expert bytes delivered (gate + up + down).
        seconds: wall time of the pass.
        cpu_seconds: user + system CPU of this process during the pass (kernel workers of io_uring
            included; for fio, fio's own CPU).
        p50_ms, p99_ms: per-expert latency percentiles (ms); None when not measured.
        note: how the method ran (depth, threads, fallbacks).
        gb_per_s_range: lowest and highest GB/s over the repeats (None for a single run).
    """

    method: str
    phase: str
    n_experts: int
    payload_bytes: int
    seconds: float
    cpu_seconds: float
    p50_ms: float | None
    p99_ms: float | None
    note: str = ""
    gb_per_s_range: tuple[float, float] | None = None

    @property
    def gb_per_s(self) -> float:
        """Payload GB/s (1e9 bytes)."""
        return self.payload_bytes / self.seconds / 1e9

    @property
    def experts_per_s(self) -> float:
        """Experts delivered per second."""
        return self.n_experts / self.seconds

    @property
    def cpu_s_per_gib(self) -> float:
        """CPU seconds burnt per GiB delivered."""
        return self.cpu_seconds / (self.payload_bytes / (1 << 30))

    def as_dict(self) -> dict[str, object]:
        """Fields plus the derived rates, for ``--json``."""
        d = asdict(self)
        d.update(gb_per_s=self.gb_per_s, experts_per_s=self.experts_per_s, cpu_s_per_gib=self.cpu_s_per_gib)
        return d


def make_steps(layout: ExpertLayout, n_tokens: int, seed: int) -> list[Step]:
    """Uniform random top-k routing, token-major, with no expert repeated within a pass.

    Each layer draws a seeded random permutation of its experts and hands out ``k`` at a time, a
    new permutation when one runs out: every token gets a uniformly random set of ``k`` distinct
    experts, and a pass of ``n_experts / k`` tokens reads every expert exactly once, so a cold
    pass is all misses.
    """
    rng = np.random.default_rng(seed)
    k = layout.n_expert_used
    pools: dict[int, list[int]] = {layer: [] for layer in layout.layers}
    steps: list[Step] = []
    for _ in range(n_tokens):
        for layer, moe in layout.layers.items():
            pool = pools[layer]
            if len(pool) < k:
                pool.extend(int(e) for e in rng.permutation(moe.n_experts) if int(e) not in pool)
            steps.append((layer, tuple(pool[:k])))
            del pool[:k]
    return steps


def _locations(layout: ExpertLayout, steps: Sequence[Step]) -> list[ExpertLocation]:
    return [layout.locate(layer, e) for layer, ids in steps for e in ids]


class _CpuClock:
    def __enter__(self) -> _CpuClock:
        self.t0 = time.perf_counter()
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.c0 = r.ru_utime + r.ru_stime
        return self

    def __exit__(self, *exc: object) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.seconds = time.perf_counter() - self.t0
        self.cpu = r.ru_utime + r.ru_stime - self.c0


def _percentiles(latencies: Sequence[float]) -> tuple[float | None, float | None]:
    if not latencies:
        return None, None
    arr = np.asarray(latencies) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _baseline_pass(
    method: str, phase: str, locs: Sequence[ExpertLocation], clock: _CpuClock, lat: Sequence[float], note: str
) -> PassResult:
    """A pass of a baseline that timed each expert (``lat``, seconds) over ``locs``."""
    p50, p99 = _percentiles(lat)
    payload = sum(x.n_bytes for x in locs)
    return PassResult(method, phase, len(locs), payload, clock.seconds, clock.cpu, p50, p99, note)


def drop_page_cache(model: GGUFModel) -> None:
    """``POSIX_FADV_DONTNEED`` over every shard (clean pages leave the page cache)."""
    for shard in model.shards:
        fd = os.open(shard.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- aioexperts ------------------------------------------------------------------------------------


async def _engine_passes(
    path: str, steps: Sequence[Step], backend: str, depth: int, slots: int, window: int
) -> list[PassResult]:
    results = []
    async with open_store(path, slots=slots, io=IOOptions(backend=backend, queue_depth=depth)) as engine:
        layout = engine.layout
        payload = sum(loc.n_bytes for loc in _locations(layout, steps))
        n_experts = sum(len(ids) for _, ids in steps)
        for phase in ("cold", "warm"):
            engine.reset_statistics()
            gate = asyncio.Semaphore(window)

            async def one(step: Step, gate: asyncio.Semaphore = gate) -> None:
                async with gate, engine.experts(step[0], step[1]):
                    pass

            with _CpuClock() as clock:
                await asyncio.gather(*(one(s) for s in steps))
            st = engine.statistics()
            mode = "O_DIRECT" if st.direct_io else f"buffered ({st.buffered_reason})"
            note = f"{st.backend}, {mode}, depth {depth}, {st.hits} hits / {st.misses} misses, {st.submissions} submits"
            if st.backend_features.get("fixed_buffers"):
                note += ", fixed buffers"
            p50 = st.expert_latency_p50_ms if phase == "cold" else None
            p99 = st.expert_latency_p99_ms if phase == "cold" else None
            if phase == "warm":
                p50, p99 = clock.seconds / max(len(steps), 1) * 1e3, None
                note += " (warm latency: mean per step)"
            results.append(
                PassResult(
                    f"aioexperts {backend}",
                    phase,
                    n_experts,
                    payload,
                    clock.seconds,
                    clock.cpu,
                    p50,
                    p99,
                    note,
                )
            )
    return results


def engine_method(backend: str, depth: int, slots: int, window: int) -> Method:
    """The aioexperts engine with ``backend``, as a benchmark method."""

    def run(model: GGUFModel, layout: ExpertLayout, steps: Sequence[Step]) -> list[PassResult]:
        return asyncio.run(_engine_passes(model.path, steps, backend, depth, slots, window))

    return Method(f"aioexperts {backend}", run)


# -- baselines --------------------------------------------------------------------------------------


def buffered_pread_method(n_threads: int) -> Method:
    """A pool of ``n_threads`` threads ``preadv``-ing exact ranges through the page cache."""

    def run(model: GGUFModel, layout: ExpertLayout, steps: Sequence[Step]) -> list[PassResult]:
        locs = _locations(layout, steps)
        fds = [os.open(s.path, os.O_RDONLY) for s in model.shards]
        buffers = threading.local()
        try:
            drop_page_cache(model)
            results = []
            for phase in ("cold", "warm"):

                def read(loc: ExpertLocation) -> float:
                    buf = getattr(buffers, "buf", None)
                    if buf is None or len(buf) < loc.n_bytes:
                        buf = buffers.buf = bytearray(layout.max_expert_bytes)
                    t0 = time.perf_counter()
                    view, pos = memoryview(buf), 0
                    for seg in loc.segments:
                        got = os.preadv(fds[seg.shard], [view[pos : pos + seg.n_bytes]], seg.offset)
                        assert got == seg.n_bytes
                        pos += seg.n_bytes
                    return time.perf_counter() - t0

                with _CpuClock() as clock, ThreadPoolExecutor(n_threads) as pool:
                    lat = list(pool.map(read, locs))
                results.append(
                    _baseline_pass(
                        "buffered pread",
                        phase,
                        locs,
                        clock,
                        lat,
                        f"{n_threads} threads, page cache dropped before cold",
                    )
                )
            return results
        finally:
            for fd in fds:
                os.close(fd)

    return Method("buffered pread", run)


def mmap_method() -> Method:
    """Copy each range out of a shared read-only ``mmap`` (page faults and kernel readahead)."""

    def run(model: GGUFModel, layout: ExpertLayout, steps: Sequence[Step]) -> list[PassResult]:
        locs = _locations(layout, steps)
        maps = []
        for shard in model.shards:
            with open(shard.path, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        out = np.empty(layout.max_expert_bytes, dtype=np.uint8)
        try:
            drop_page_cache(model)
            results = []
            for phase in ("cold", "warm"):
                lat = []
                with _CpuClock() as clock:
                    for loc in locs:
                        t0 = time.perf_counter()
                        pos = 0
                        for seg in loc.segments:
                            out[pos : pos + seg.n_bytes] = arrays[seg.shard][seg.offset : seg.offset + seg.n_bytes]
                            pos += seg.n_bytes
                        lat.append(time.perf_counter() - t0)
                results.append(
                    _baseline_pass(
                        "mmap", phase, locs, clock, lat, "1 thread copying from the mapping, default readahead"
                    )
                )
            return results
        finally:
            del arrays
            for m in maps:
                m.close()

    return Method("mmap", run)


def fio_method(depth: int) -> Method | None:
    """fio io_uring ``O_DIRECT`` random reads of the engine's read size and depth; None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None

    def run(model: GGUFModel, layout: ExpertLayout, steps: Sequence[Step]) -> list[PassResult]:
        locs = _locations(layout, steps)
        sizes = [widen(seg.offset, seg.n_bytes, 4096)[1] for loc in locs for seg in loc.segments]
        block = int(np.median(sizes))
        payload = sum(x.n_bytes for x in locs)
        io_size = max(block, payload // block * block)
        files = ":".join(s.path.replace(":", "\\:") for s in model.shards)
        cmd = [
            fio,
            "--name=aioexperts-device",
            f"--filename={files}",
            "--readonly",
            "--rw=randread",
            f"--bs={block}",
            f"--iodepth={depth}",
            "--ioengine=io_uring",
            "--direct=1",
            "--numjobs=1",
            "--fixedbufs",
            "--registerfiles",
            f"--io_size={io_size}",
            "--randrepeat=1",
            "--output-format=json",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
        read = job["read"]
        seconds = read["runtime"] / 1e3
        cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
        lat = read.get("clat_ns", {}).get("percentile", {})
        p50 = lat.get("50.000000")
        p99 = lat.get("99.000000")
        # in experts/s as for the other methods: bytes over the mean bytes of one expert
        n = round(read["io_bytes"] / (payload / len(locs)))
        return [
            PassResult(
                "fio",
                "cold",
                n,
                read["io_bytes"],
                seconds,
                cpu,
                p50 and p50 / 1e6,
                p99 and p99 / 1e6,
                f"io_uring O_DIRECT randread bs={block} iodepth={depth}, registered buffers and file "
                "(as aioexperts uses them); latency per read, experts/s = bytes / mean expert size",
            )
        ]

    return Method("fio", run)


@dataclass(frozen=True)
class Method:
    """A named way to read the experts of a step sequence: ``run(model, layout, steps)``."""

    name: str
    run: Callable[[GGUFModel, ExpertLayout, Sequence[Step]], list[PassResult]]


def run_read_bench(
    path: str,
    *,
    n_tokens: int | None = None,
    seed: int = 0,
    depth: int = 64,
    repeat: int = 1,
    methods: Sequence[str] = ("fio", "io_uring", "threads", "buffered", "mmap"),
    n_threads: int = 8,
    progress: Callable[[str], None] | None = None,
) -> list[PassResult]:
    """Run every method ``repeat`` times on the same routing; returns the median pass of each.

    Args:
        path: the model (any shard of a split set).
        n_tokens: tokens per pass (default: enough for every expert to be read once).
        seed: routing seed.
        depth: reads in flight (engine queue depth, fio iodepth).
        repeat: runs per method; the pass with the median time is kept.
        methods: any of ``fio``, ``io_uring``, ``threads``, ``buffered``, ``mmap``.
        n_threads: threads of the buffered pread pool.
        progress: called with a line of text before each method runs.
    """
    model = open_model(path)
    layout = build_layout(model)
    if n_tokens is None:
        n_tokens = max(1, min(m.n_experts for m in layout.layers.values()) // layout.n_expert_used)
    steps = make_steps(layout, n_tokens, seed)
    unique = len({(layer, e) for layer, ids in steps for e in ids})
    window = max(2, math.ceil(2 * depth / (3 * layout.n_expert_used)))
    table: dict[str, Method | None] = {
        "fio": fio_method(depth),
        "io_uring": engine_method("io_uring", depth, unique, window),
        "threads": engine_method("threads", depth, unique, window),
        "buffered": buffered_pread_method(n_threads),
        "mmap": mmap_method(),
    }
    runs: dict[tuple[str, str], list[PassResult]] = {}
    for r in range(repeat):
        for name in methods:
            method = table[name]
            if method is None:
                continue
            if progress is not None:
                progress(f"run {r + 1}/{repeat}: {method.name}")
            for result in method.run(model, layout, steps):
                runs.setdefault((result.method, result.phase), []).append(result)
    medians = []
    for rs in runs.values():
        median = sorted(rs, key=lambda x: x.seconds)[len(rs) // 2]
        rates = [x.gb_per_s for x in rs]
        medians.append(dataclasses.replace(median, gb_per_s_range=(min(rates), max(rates))) if len(rs) > 1 else median)
    return medians
