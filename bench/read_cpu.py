"""CPU seconds per GiB of the same O_DIRECT expert reads: fio, raw io_uring loops, the store.

Issue 20 asks that the reads cost at most twice fio's CPU, and whether a compiled submit/reap
path pays. Each round picks fresh experts of the model (groups of ``--top-k`` in one layer, like a
token's), plans their aligned reads once, and runs, in rotated order, the same reads with:

- ``fio``: ``--ioengine=io_uring --direct=1 --fixedbufs``, the same depth, ``--invalidate=0``
  (the page cache is dropped here beforehand, outside fio's counters); CPU = fio's job counters
  (``usr_cpu + sys_cpu``), ``fio_process_cpu_s`` also gives the whole child process.
- ``raw-python``: the raw ring (:class:`aioexperts._io.uring_raw.RawRing`) driven by a Python loop:
  ``READ_FIXED`` into ``depth`` registered buffers (fio's memory), submit and wait in one
  ``io_uring_enter``, every CQE's ``res`` checked.
- ``raw-numba``: the same loop compiled with numba (``@njit`` over the numpy views of the SQEs and
  CQEs; ``io_uring_enter`` through libc's ``syscall`` called from the compiled code).
- ``store-io_uring`` / ``store-io_uring_raw`` / ``store-threads``: ``aioexperts.open(...)`` on the
  io_uring backend (the liburing wheel where it runs, else the raw ring), on the raw ring forced
  (``backend="io_uring_raw"``: what AVX2-only machines run) or on the thread pool; ``--tasks``
  tasks ask ``store.experts(layer, ids)`` for the groups; a fresh store per run, so every expert
  is a miss.
- ``store-null``: the same store calls over :class:`aioexperts.testing.FakeBackend` with
  ``read=False`` (every read delivered as complete on the next loop tick, nothing read): the CPU
  of the store's own bookkeeping (cache, scheduler, views, the tasks) with no backend, no system
  call and no wake-up, a floor under the store's figures. Its bytes are the bytes requested.

CPU is this process's (or fio's) user + system time around the reads only (``resource.getrusage``;
io_uring's kernel workers are threads of the process and count). The page cache is dropped
(``POSIX_FADV_DONTNEED``) before every run.

    .venv/bin/python bench/read_cpu.py --rounds 3 --json docs/results/read_cpu.json
    .venv/bin/python bench/read_cpu.py --render docs/results/read_cpu.json docs/architecture.md \
        [--decode docs/results/generate-....json]

``--decode`` adds what the store's read CPU is worth in a decode token under the memory limits of a
``aioexperts-bench --mode generate`` results file (its bytes read per token times this file's
store CPU per GiB, against the token's time).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _results import refuse_foreign, replace_region, write_results  # bench/_results.py, a sibling module

import aioexperts
from aioexperts._io.plan import plan_expert
from aioexperts._io.uring_raw import (
    IORING_ENTER_GETEVENTS,
    IORING_OP_READ_FIXED,
    SYS_IO_URING_ENTER,
    RawRing,
)
from aioexperts.testing import FakeBackend, full_model_path
from aioexperts_bench import GIB, ReadList, drop_page_cache, fio_path, run_fio_replay

METHODS = ("fio", "raw-python", "raw-numba", "store-io_uring", "store-io_uring_raw", "store-threads", "store-null")
#: the 48-layer built-in full model, as the generator names it now (aioexperts-bench --mode generate writes it)
DEFAULT_MODEL = full_model_path(48)


def cpu_seconds() -> float:
    """User + system CPU of this process (every thread, io_uring's kernel workers included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def usage() -> tuple[float, float, int]:
    """(user s, system s, voluntary context switches: the process's sleeps/wake-ups)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_nvcsw


# -- the read list ----------------------------------------------------------------------------


def group_capacity(layout: aioexperts.ExpertLayout, top_k: int) -> int:
    """How many groups of ``top_k`` experts the model holds with no expert twice."""
    return sum(layout.layers[layer].n_experts // top_k for layer in layout.layers) if top_k >= 1 else 0


def pick_groups(layout: aioexperts.ExpertLayout, n_groups: int, top_k: int, rng: random.Random) -> list[Any]:
    """``n_groups`` groups of ``top_k`` distinct experts, each group in one layer, no expert twice.

    Raises:
        ValueError: the model holds fewer than ``n_groups`` such groups (:func:`group_capacity`).
    """
    capacity = group_capacity(layout, top_k)
    if top_k < 1 or n_groups > capacity:
        raise ValueError(
            f"{n_groups} groups of {top_k} distinct experts do not fit in this model: it holds {capacity} "
            f"({len(layout.layers)} MoE layers; no expert is read twice)"
        )
    free = {layer: list(range(layout.layers[layer].n_experts)) for layer in layout.layers}
    groups = []
    while len(groups) < n_groups:
        layer = rng.choice([layer for layer, left in free.items() if len(left) >= top_k])
        ids = sorted(rng.sample(free[layer], top_k))
        free[layer] = [e for e in free[layer] if e not in ids]
        groups.append((layer, ids))
    return groups


def read_list(model: aioexperts.GGUFModel, layout: aioexperts.ExpertLayout, groups: list[Any]) -> ReadList:
    rows = [
        (r.shard, r.file_offset, r.n_bytes)
        for layer, ids in groups
        for e in ids
        for r in plan_expert(layout.locate(layer, e), 4096).reads
    ]
    return ReadList(tuple(s.path for s in model.shards), np.asarray(rows, dtype=np.int64).reshape(-1, 3))


# -- raw loops -----------------------------------------------------------------------------------


class RawSetup:
    """A raw ring of ``depth`` entries with ``depth`` registered buffers of the longest read."""

    def __init__(self, reads: ReadList, depth: int) -> None:
        self.fds = [os.open(p, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC) for p in reads.paths]
        self.buf_bytes = -(-reads.max_len // mmap.PAGESIZE) * mmap.PAGESIZE
        self.buffers = mmap.mmap(
            -1, depth * self.buf_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        )
        anchor = ctypes.c_char.from_buffer(self.buffers)
        self.base = ctypes.addressof(anchor)
        del anchor
        self.ring = RawRing(depth)
        self.ring.register_buffers([(self.base + i * self.buf_bytes, self.buf_bytes) for i in range(depth)])
        self.depth = depth
        sizes = [os.fstat(fd).st_size for fd in self.fds]
        self.shard_fd = np.asarray(self.fds, dtype=np.int64)
        self.expected = np.asarray(
            [max(0, min(n, sizes[s] - off)) for s, off, n in reads.reads.tolist()], dtype=np.int64
        )

    def close(self) -> None:
        self.ring.close()
        self.buffers.close()
        for fd in self.fds:
            os.close(fd)


def raw_python(setup: RawSetup, reads: ReadList) -> int:
    """Every read through the raw ring, ``depth`` in flight; the bytes read."""
    ring, depth, base, size = setup.ring, setup.depth, setup.base, setup.buf_bytes
    rows = reads.reads.tolist()
    expected = setup.expected.tolist()
    fds = setup.fds
    free = list(range(depth))
    slot_of: dict[int, int] = {}
    n, nxt, done, total = len(rows), 0, 0, 0
    while done < n:
        k = min(len(free), n - nxt)
        if k:
            slots = [free.pop() for _ in range(k)]
            batch = rows[nxt : nxt + k]
            ring.queue(
                [
                    (IORING_OP_READ_FIXED, 0, fds[s], off, base + slot * size, length, nxt + 1 + i, slot)
                    for i, ((s, off, length), slot) in enumerate(zip(batch, slots, strict=True))
                ]
            )
            slot_of.update(zip(range(nxt + 1, nxt + k + 1), slots, strict=True))
            nxt += k
        ret = ring.enter(k, 1, IORING_ENTER_GETEVENTS)
        if ret < 0 and -ret not in (4, 11):  # EINTR, EAGAIN: wait again
            raise OSError(-ret, os.strerror(-ret))
        users, results = ring.reap()
        for user_data, res in zip(users, results, strict=True):
            if res != expected[user_data - 1]:
                raise OSError(-res if res < 0 else 5, f"read {user_data - 1} returned {res}")
            free.append(slot_of.pop(user_data))
            total += res
        done += len(users)
    return total


_NUMBA_LOOP: Any = None


def numba_loop() -> Any:
    """The compiled loop (built once; numba's compile time is not measured)."""
    global _NUMBA_LOOP
    if _NUMBA_LOOP is not None:
        return _NUMBA_LOOP
    from numba import njit

    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long] * 7

    @njit(cache=False, nogil=True)
    def loop(
        sqe64, cqe64, sq_tail, cq_head, cq_tail, sq_mask, cq_mask, ring_fd, reads, shard_fd, expected, base, size, depth
    ):  # noqa: E501
        n = reads.shape[0]
        free = np.arange(depth)
        n_free = depth
        slot_of = np.zeros(n, np.int64)
        nxt = 0
        done = 0
        total = 0
        tail = np.uint64(sq_tail[0])
        while done < n:
            k = 0
            while n_free > 0 and nxt < n:  # fill the SQEs, then publish the tail
                n_free -= 1
                slot = free[n_free]
                idx = tail & np.uint64(sq_mask)
                fd = np.uint64(shard_fd[reads[nxt, 0]]) & np.uint64(0xFFFFFFFF)
                sqe64[idx, 0] = np.uint64(IORING_OP_READ_FIXED) | (fd << np.uint64(32))
                sqe64[idx, 1] = np.uint64(reads[nxt, 1])
                sqe64[idx, 2] = np.uint64(base + slot * size)
                sqe64[idx, 3] = np.uint64(reads[nxt, 2])
                sqe64[idx, 4] = np.uint64(nxt + 1)
                sqe64[idx, 5] = np.uint64(slot)
                sqe64[idx, 6] = np.uint64(0)
                sqe64[idx, 7] = np.uint64(0)
                slot_of[nxt] = slot
                tail = (tail + np.uint64(1)) & np.uint64(0xFFFFFFFF)
                nxt += 1
                k += 1
            sq_tail[0] = np.uint32(tail)
            ret = syscall(SYS_IO_URING_ENTER, ring_fd, k, 1, IORING_ENTER_GETEVENTS, 0, 0)
            if ret < 0:
                return -1
            head = np.uint64(cq_head[0])
            ctail = np.uint64(cq_tail[0])
            while head != ctail:  # read each CQE, then hand it back
                idx = head & np.uint64(cq_mask)
                user = np.int64(cqe64[idx, 0]) - 1
                res = np.int64(np.int32(np.uint32(cqe64[idx, 1] & np.uint64(0xFFFFFFFF))))
                if res != expected[user]:
                    return -2 - user
                free[n_free] = slot_of[user]
                n_free += 1
                total += res
                done += 1
                head = (head + np.uint64(1)) & np.uint64(0xFFFFFFFF)
            cq_head[0] = np.uint32(head)
        return total

    _NUMBA_LOOP = loop
    return loop


def raw_numba(setup: RawSetup, reads: ReadList) -> int:
    ring = setup.ring
    loop = numba_loop()
    got = loop(
        ring.sqes.view(np.uint64).reshape(-1, 8),
        ring.cqes.view(np.uint64).reshape(-1, 2),
        ring._sq_tail,
        ring._cq_head,
        ring._cq_tail,
        ring.sq_mask,
        ring.cq_mask,
        ring.fd,
        reads.reads,
        setup.shard_fd,
        setup.expected,
        setup.base,
        setup.buf_bytes,
        setup.depth,
    )
    ring._tail = int(ring._sq_tail[0])  # the compiled loop moved the tail behind the ring object's back
    if got < 0:
        raise OSError(5, f"the compiled loop failed ({got})")
    return int(got)


def warm_numba(reads: ReadList, depth: int) -> None:
    """Compile the loop on a few reads (not measured)."""
    small = ReadList(reads.paths, reads.reads[: 2 * depth])
    setup = RawSetup(small, depth)
    try:
        raw_numba(setup, small)
    finally:
        setup.close()


# -- through the store ----------------------------------------------------------------------------


async def through_store(
    path: Path, backend: str, groups: list[Any], depth: int, tasks: int, top_k: int
) -> tuple[int, float, float, dict[str, Any]]:
    """The store's reads of ``groups``: (bytes read, CPU s, wall s, details); the details hold the
    backend's features and the read window's own user s, system s and wake-ups."""
    chosen: Any = backend
    if backend == "null":  # the bookkeeping alone: every read "completes" at once, nothing is read

        def chosen(*a: Any) -> FakeBackend:
            return FakeBackend(*a, auto=True, read=False)

    io = aioexperts.IOOptions(backend=chosen, queue_depth=depth)
    async with aioexperts.open(path, slots=max(4 * top_k * tasks, 64), io=io) as store:
        queue = list(groups)

        async def worker() -> None:
            while queue:
                layer, ids = queue.pop()
                async with store.experts(layer, ids):
                    pass

        u0, w0 = usage(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(tasks)))
        u1, wall = usage(), time.perf_counter() - w0
        cpu = (u1[0] - u0[0]) + (u1[1] - u0[1])
        st = store.statistics()
        assert st.direct_io or backend == "null", f"the bench needs O_DIRECT: {st.buffered_reason}"
        window = {"window_user_s": u1[0] - u0[0], "window_sys_s": u1[1] - u0[1], "window_wakeups": u1[2] - u0[2]}
        return st.bytes_read, cpu, wall, {"backend": st.backend, **st.backend_features, **window}


# -- one run of one method ------------------------------------------------------------------------


def run_method(method: str, path: Path, reads: ReadList, groups: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    drop_page_cache(list(reads.paths))
    row: dict[str, Any] = {}
    u0 = usage()
    if method == "fio":
        res = run_fio_replay(reads, args.depth)
        got, cpu = res.bytes_read, res.cpu_seconds
        row["fio_process_cpu_s"] = res.process_cpu_seconds
        wall = res.seconds
    elif method in ("raw-python", "raw-numba"):
        setup = RawSetup(reads, args.depth)
        try:
            c0, w0 = cpu_seconds(), time.perf_counter()
            got = raw_python(setup, reads) if method == "raw-python" else raw_numba(setup, reads)
            cpu, wall = cpu_seconds() - c0, time.perf_counter() - w0
        finally:
            setup.close()
    else:
        backend = method.split("-", 1)[1]
        got, cpu, wall, features = asyncio.run(through_store(path, backend, groups, args.depth, args.tasks, args.top_k))
        row["backend"] = features.get("backend")
        row["ring"] = features.get("ring")
        # the raw ring's reaps (each one a wake-up of the loop by its completions) and whether they are batched
        row["reaps"] = features.get("wakeups")
        row["batch_wakeups"] = features.get("batch_wakeups")
        row.update({k: v for k, v in features.items() if k.startswith("window_")})
    u1 = usage()
    if method != "fio":  # the read window's share is in cpu_s; these span the whole run (set-up included)
        row.update(user_s=u1[0] - u0[0], sys_s=u1[1] - u0[1], wakeups=u1[2] - u0[2])
    gib = got / GIB
    row.update(bytes=got, cpu_s=cpu, wall_s=wall, cpu_s_per_gib=cpu / gib if gib else None, gb_s=got / 1e9 / wall)
    return row


#: the units of a read-CPU results file (also bench/slab_layout.py's)
UNITS = {"cpu_s_per_gib": "CPU seconds per 2**30 bytes read", "gb_s": "1e9 bytes per second"}


def per_gib_summary(rounds: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The rounds' figures of run ``name`` (each round's ``row[name]`` has ``cpu_s_per_gib`` and
    ``gb_s``): CPU ms per GiB median, min and max, and the median GB/s."""
    per_gib = [row[name]["cpu_s_per_gib"] * 1e3 for row in rounds]
    return {
        "cpu_ms_per_gib_median": statistics.median(per_gib),
        "cpu_ms_per_gib_min": min(per_gib),
        "cpu_ms_per_gib_max": max(per_gib),
        "gb_s_median": statistics.median(row[name]["gb_s"] for row in rounds),
    }


def render_lines(results: Path, decode: Path | None = None) -> list[str]:
    """The region's text of a results file: per method CPU ms per GiB (median, min-max of the
    rounds), GB/s, the median of the per-round ratios to fio, and the target's verdict; with
    ``decode`` (a results file of ``aioexperts-bench --mode generate``), what the store's reads
    cost per decode token under its memory limits (:func:`decode_share_lines`)."""
    r = json.loads(results.read_text())
    s, p, m = r["summary"], r["parameters"], r["machine"]
    load = p.get("load_average_start", [float("nan")])[0], p.get("load_average_end", [float("nan")])[0]
    commit = (m.get("aioexperts_commit") or "")[:10] or "unknown"
    lines = [
        f"<!-- rendered by bench/read_cpu.py --render {results} DOC; do not edit by hand -->",
        f"`bench/read_cpu.py`, {p['rounds']} rounds of {p['groups']} groups of {p['top_k']} fresh experts, depth "
        f"{p['depth']}, {p['tasks']} store tasks; {m.get('cpu', '?')} ({m.get('cores_available', '?')} cores), "
        f"Linux {m.get('kernel', '?')}, started {r['started']}, load average {load[0]:.1f} at the start and "
        f"{load[1]:.1f} at the end, aioexperts {commit}. CPU is the process's user + system time per GiB read "
        "(fio: its job's); each figure is the median (min-max) of the rounds, x fio the median of the per-round "
        "ratios.",
        "",
        "| method | CPU ms per GiB | GB/s | x fio |",
        "|---|---|---|---|",
    ]
    for method in p["methods"]:
        e = s[method]
        ratio = f"{e['x_fio_median']:.2f} ({e['x_fio_min']:.2f}-{e['x_fio_max']:.2f})" if "x_fio_median" in e else "-"
        rate = "- (nothing read)" if method == "store-null" else f"{e['gb_s_median']:.2f}"
        lines.append(
            f"| {method} | {e['cpu_ms_per_gib_median']:.1f} ({e['cpu_ms_per_gib_min']:.1f}-"
            f"{e['cpu_ms_per_gib_max']:.1f}) | {rate} | {ratio} |"
        )
    target = s.get("target")
    if target:
        verdict = "met" if target["met"] else "MISSED"
        lines += ["", f"Target: {target['what']}: {target['value']:.2f}x, **{verdict}**."]
    if decode is not None:
        lines[0] = lines[0].replace(" DOC;", f" DOC --decode {decode};")
        lines += ["", *decode_share_lines(s["store-io_uring"]["cpu_ms_per_gib_median"], m.get("cpu"), decode)]
    return lines


def decode_share(cpu_ms_per_gib: float, generate: dict[str, Any]) -> list[dict[str, Any]]:
    """The store's read CPU per decode token under each memory limit of a generate results file.

    Per limit (engine ``aioexperts``, runs with status ok): the median over the rounds of the expert
    bytes read per token and of the mean decode token time (``1 / decode_tok_s``), and their
    product with ``cpu_ms_per_gib`` (this file's store-io_uring median): ``{"limit", "rounds",
    "mib_per_token", "token_ms", "read_cpu_ms", "share"}``, share of the token in [0, 1]; limits
    without a read (``none``) are left out.
    """
    by_limit: dict[str, list[dict[str, Any]]] = {}
    for run in generate["runs"]:
        if run.get("engine") == "aioexperts" and run.get("status") == "ok" and run.get("decode_tok_s"):
            by_limit.setdefault(run["limit"], []).append(run)
    out = []
    for limit, runs in by_limit.items():
        per_token = statistics.median(run.get("expert_bytes_per_token") or 0.0 for run in runs)
        if limit == "none" or per_token <= 0:
            continue
        token_ms = statistics.median(1e3 / run["decode_tok_s"] for run in runs)
        read_ms = per_token / GIB * cpu_ms_per_gib
        out.append(
            {
                "limit": limit,
                "rounds": len(runs),
                "mib_per_token": per_token / 2**20,
                "token_ms": token_ms,
                "read_cpu_ms": read_ms,
                "share": read_ms / token_ms,
            }
        )
    return out


def decode_share_lines(cpu_ms_per_gib: float, cpu: str | None, decode: Path) -> list[str]:
    """The sentence of :func:`decode_share` for ``decode`` (a generate results file)."""
    generate = json.loads(decode.read_text())
    rows = decode_share(cpu_ms_per_gib, generate)
    other_cpu = generate.get("machine", {}).get("cpu")
    parts = [
        f"at {row['limit']}, {row['mib_per_token']:.0f} MiB read per token x {cpu_ms_per_gib:.1f} ms/GiB = "
        f"{row['read_cpu_ms']:.1f} ms of the token's {row['token_ms']:.0f} ms ({100 * row['share']:.1f} %)"
        for row in rows
    ]
    where = "" if other_cpu in (None, cpu) else f" (measured on {other_cpu}, not this file's CPU)"
    return [
        f"What the store's read CPU is worth in a decode token under a memory limit (`{decode}`{where}, engine "
        f"aioexperts, medians of its rounds; the token's time is the decode rate's inverse): "
        + ("; ".join(parts) if parts else "no run under a limit in that file")
        + "."
    ]


def render(results: Path, doc: Path, region: str = "read_cpu", decode: Path | None = None) -> None:
    """Replace the text between ``<!-- bench:REGION -->`` and its end marker in ``doc``."""
    replace_region(doc, region, render_lines(results, decode))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--render":
        rp = argparse.ArgumentParser(prog="read_cpu.py --render", description="render a results file into a doc")
        rp.add_argument("results", type=Path)
        rp.add_argument("doc", type=Path)
        rp.add_argument("--decode", type=Path, help="a generate results file: read CPU per decode token")
        ra = rp.parse_args(sys.argv[2:])
        render(ra.results, ra.doc, decode=ra.decode)
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a MoE GGUF on a disk with O_DIRECT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=48, help="groups (one layer's top-k experts) per round")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--depth", type=int, default=32, help="reads in flight (ring depth, fio iodepth)")
    parser.add_argument("--tasks", type=int, default=2, help="concurrent store.experts() callers")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("read_cpu-results.json"))
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if "fio" in methods and fio_path() is None:
        parser.error("fio is not installed")
    if not args.model.is_file():
        parser.error(
            f"{args.model} does not exist (the 48-layer built-in model: `aioexperts-bench --mode generate` "
            "or `python bench/model_speed.py --layers 48` writes it once)"
        )
    refuse_foreign(args.json)
    started = time.time()
    load_start = os.getloadavg()
    model = aioexperts.open_model(args.model)
    layout = aioexperts.build_layout(model)
    rng = random.Random(args.seed)
    for name in ("rounds", "groups", "top_k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    capacity = group_capacity(layout, args.top_k)
    if args.groups * args.rounds > capacity:
        parser.error(
            f"--groups {args.groups} x --rounds {args.rounds} = {args.groups * args.rounds} groups of "
            f"--top-k {args.top_k} fresh experts, but {args.model.name} holds {capacity} "
            f"({len(layout.layers)} MoE layers): lower --groups or --rounds"
        )
    all_groups = pick_groups(layout, args.groups * args.rounds, args.top_k, rng)
    if "raw-numba" in methods:
        warm_numba(read_list(model, layout, all_groups[:4]), args.depth)
    rounds = []
    for r in range(args.rounds):
        groups = all_groups[r * args.groups : (r + 1) * args.groups]
        reads = read_list(model, layout, groups)
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        row: dict[str, Any] = {"round": r, "order": order, "n_reads": len(reads), "bytes_requested": reads.total_bytes}
        for method in order:
            row[method] = run_method(method, args.model, reads, groups, args)
            print(
                f"round {r + 1}: {method:>15} {row[method]['cpu_s_per_gib'] * 1e3:7.1f} ms CPU/GiB, "
                f"{row[method]['gb_s']:.2f} GB/s",
                file=sys.stderr,
            )
        if "fio" in methods:
            fio = row["fio"]["cpu_s_per_gib"]
            row["x_fio"] = {m: row[m]["cpu_s_per_gib"] / fio for m in methods if m != "fio"}
        rounds.append(row)
    summary: dict[str, Any] = {}
    for m in methods:
        entry = per_gib_summary(rounds, m)
        if "fio" in methods and m != "fio":
            x = [row["x_fio"][m] for row in rounds]
            entry.update(x_fio_median=statistics.median(x), x_fio_min=min(x), x_fio_max=max(x))
        summary[m] = entry
    if "fio" in methods and "store-io_uring" in methods:
        x = summary["store-io_uring"]["x_fio_median"]
        summary["target"] = {
            "what": "store-io_uring CPU s/GiB <= 2x fio's (median of the per-round ratios)",
            "value": x,
            "met": x <= 2.0,
        }
    if "raw-python" in methods and "raw-numba" in methods:
        saved = [row["raw-python"]["cpu_s_per_gib"] - row["raw-numba"]["cpu_s_per_gib"] for row in rounds]
        summary["numba_saves_ms_per_gib"] = {
            "median": statistics.median(saved) * 1e3,
            "min": min(saved) * 1e3,
            "max": max(saved) * 1e3,
        }
    params = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "methods": methods,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }
    out = write_results(
        args.json,
        "read_cpu",
        params,
        UNITS,
        rounds,
        summary,
        started,
    )
    for m, s in summary.items():
        print(f"{m:>16}: {s}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
