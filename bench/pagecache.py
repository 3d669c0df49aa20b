"""Page-cache mode against the slab mode: cold and half-resident passes, and a memory-limited run.

On the built-in model (``aioexperts-bench``'s, 2.7 GB), each mode serves the same routing (uniform
random top-8 over every MoE layer, ``--tokens`` tokens) and the bench touches one byte of every
page of every expert it gets, as a compute step would:

- ``slab``: ``O_DIRECT`` reads through io_uring into a slab of 25 % of the experts;
- ``pagecache read`` / ``advice`` / ``parallel-advice``: ``open(mode="pagecache")`` with each
  warming method (:class:`aioexperts.PageCacheOptions`).

Passes, in rotated order per round: *cold* (the model's pages dropped from the page cache with
``POSIX_FADV_DONTNEED`` first) and *half* (dropped, then every other expert of the pass read in
with plain ``pread`` first). Reported: payload GB/s (GB = 1e9 bytes) median with range, and the
model's bytes left in the page cache afterwards (``mincore``).

``--limit-mib`` (default 768; 0 skips it) then runs two passes over every expert of the model
(larger than the limit) in a child process placed in a cgroup v1 memory group with that limit
(``/sys/fs/cgroup/memory``, root only; the page cache is charged to the group), per mode: the rate
of each pass and the group's ``memory.failcnt`` (how often it hit the limit). Writes everything to
``--json``.

    python bench/pagecache.py --rounds 3 --json pagecache-results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _results import machine_facts, refuse_foreign  # bench/_results.py, a sibling module

import aioexperts
from aioexperts.testing import ensure_bench_model
from aioexperts_bench import dumps_json

MODES = ("slab", "pagecache read", "pagecache advice", "pagecache parallel-advice", "pagecache uring")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def steps_for(path: str, tokens: int, seed: int) -> list[tuple[int, list[int]]]:
    """``(layer, ids)`` per token and MoE layer: uniform random top-k."""
    layout = aioexperts.build_layout(aioexperts.open_model(path))
    rng = random.Random(seed)
    return [
        (layer, rng.sample(range(moe.n_experts), layout.n_expert_used))
        for _ in range(tokens)
        for layer, moe in layout.layers.items()
    ]


def open_store(path: str, mode: str, n_experts: int) -> aioexperts.ExpertStore:
    if mode == "slab":
        return aioexperts.open(path, slots=max(16, n_experts // 4), io=aioexperts.IOOptions(backend="io_uring"))
    method = mode.split(" ", 1)[1]
    return aioexperts.open(path, mode="pagecache", pagecache=aioexperts.PageCacheOptions(method=method))


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a fresh mapping)."""
    import ctypes

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * mmap.PAGESIZE
    finally:
        mm.close()


def warm_half(path: str, steps: list[tuple[int, list[int]]]) -> None:
    """Read every other distinct expert of ``steps`` with plain pread (into the page cache)."""
    model = aioexperts.open_model(path)
    layout = aioexperts.build_layout(model)
    distinct = list(dict.fromkeys((layer, e) for layer, ids in steps for e in ids))
    fd = os.open(model.shards[0].path, os.O_RDONLY)
    try:
        for layer, e in distinct[::2]:
            for seg in layout.locate(layer, e).segments:
                os.pread(fd, seg.n_bytes, seg.offset)
    finally:
        os.close(fd)


async def one_pass(path: str, mode: str, steps: list[tuple[int, list[int]]], n_experts: int) -> dict[str, float]:
    page = mmap.PAGESIZE
    async with open_store(path, mode, n_experts) as store:
        payload = 0
        touched = 0
        t0 = time.perf_counter()
        for layer, ids in steps:
            async with store.experts(layer, ids) as views:
                for view in views:
                    assert view is not None
                    for proj in (view.gate, view.up, view.down):
                        data = np.frombuffer(proj.data, dtype=np.uint8)
                        touched += int(data[::page].sum())  # fault in every page, as compute would
                        payload += len(data)
                        del data
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "payload_bytes": payload, "gb_per_s": payload / seconds / 1e9, "checksum": touched}


def rounds(path: str, args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    n_experts = aioexperts.build_layout(aioexperts.open_model(path)).n_experts_total
    out = []
    for r in range(args.rounds):
        steps = steps_for(path, args.tokens, seed=r)
        runs = [(m, p) for m in MODES for p in ("cold", "half")]
        shift = r % len(runs)
        row = {}
        for mode, kind in runs[shift:] + runs[:shift]:
            drop(path)
            if kind == "half":
                warm_half(path, steps)
            result = asyncio.run(one_pass(path, mode, steps, n_experts))
            result["resident_after_bytes"] = resident_bytes(path)
            row[f"{mode} / {kind}"] = result
            print(f"round {r + 1}/{args.rounds}: {mode} {kind}: {result['gb_per_s']:.2f} GB/s", file=sys.stderr)
        out.append(row)
    return out


CHILD = """
import asyncio, json, os, sys, time
sys.path.insert(0, {bench_dir!r})
from pagecache import one_pass, drop, resident_bytes
import aioexperts
open({procs!r}, "w").write(str(os.getpid()))
path, mode = {path!r}, {mode!r}
layout = aioexperts.build_layout(aioexperts.open_model(path))
steps = [(layer, [e]) for layer, moe in layout.layers.items() for e in range(moe.n_experts)]
drop(path)
passes = [asyncio.run(one_pass(path, mode, steps, layout.n_experts_total)) for _ in range(2)]
print(json.dumps(passes, allow_nan=False))
"""


def limited(path: str, limit_mib: int) -> dict[str, object]:
    """Two passes over every expert per mode, in a memory-limited cgroup (v1)."""
    if os.geteuid() != 0 or not (CGROUP_ROOT / "cgroup.procs").exists():
        return {"skipped": "needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory"}
    out: dict[str, object] = {"limit_bytes": limit_mib << 20}
    for mode in MODES:
        group = CGROUP_ROOT / f"aioexperts-bench-{os.getpid()}"
        group.mkdir()
        try:
            (group / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
            code = CHILD.format(
                bench_dir=str(Path(__file__).parent), procs=str(group / "cgroup.procs"), path=path, mode=mode
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                out[mode] = {"error": done.stderr.strip().splitlines()[-1:]}
                continue
            passes = json.loads(done.stdout.strip().splitlines()[-1])
            out[mode] = {
                "passes": passes,
                "failcnt": int((group / "memory.failcnt").read_text()),
                "max_usage_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
            }
            print(
                f"limited to {limit_mib} MiB: {mode}: "
                + ", ".join(f"pass {i + 1} {p['gb_per_s']:.2f} GB/s" for i, p in enumerate(passes)),
                file=sys.stderr,
            )
        finally:
            group.rmdir()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens of random routing per pass")
    parser.add_argument("--limit-mib", type=int, default=768, help="cgroup memory limit of the limited run (0: skip)")
    parser.add_argument("--json", type=Path, default=Path("pagecache-results.json"))
    args = parser.parse_args()
    path = str(ensure_bench_model())
    data = rounds(path, args)
    summary = {}
    for key in data[0]:
        rates = [row[key]["gb_per_s"] for row in data]
        resident = [row[key]["resident_after_bytes"] for row in data]
        summary[key] = {
            "gb_per_s_median": statistics.median(rates),
            "gb_per_s_min": min(rates),
            "gb_per_s_max": max(rates),
            "resident_after_bytes_median": statistics.median(resident),
        }
        print(
            f"{key:36s} {statistics.median(rates):5.2f} GB/s ({min(rates):.2f}-{max(rates):.2f}),"
            f" {statistics.median(resident) / 1e9:.2f} GB of the model left in the page cache"
        )
    limit = limited(path, args.limit_mib) if args.limit_mib else {"skipped": "--limit-mib 0"}
    refuse_foreign(args.json).write_text(
        dumps_json(
            {
                "aioexperts": aioexperts.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine_facts(),
                "parameters": {
                    "rounds": args.rounds,
                    "tokens": args.tokens,
                    "limit_mib": args.limit_mib,
                    "model": path,
                },
                "units": {"rate": "GB/s, GB = 1e9 bytes", "bytes": "bytes", "time": "seconds"},
                "rounds": data,
                "summary": summary,
                "memory_limited": limit,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
