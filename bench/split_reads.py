"""Cold latency of one large expert, read whole or split into chunks submitted together.

DeepSeek-class ``Q2_K`` experts are about 12 MiB. Read as one request, a single miss keeps one read
in the device's queue; split into aligned chunks submitted together (``IOOptions(split_bytes=)``),
it keeps several. This bench builds (once, cached) a model of one MoE layer of such experts
(``n_embd`` 7168, ``n_ff_exp`` 2048, ``Q2_K``: 14.4 MB per expert), then, in rotated rounds, asks
a fresh store for one expert it has never read (so the read is cold; ``O_DIRECT`` bypasses the
guest's page cache) with each chunk size, and reports the median latency with its range and the
per-round ratio to the whole read.

    python bench/split_reads.py --rounds 9 --json split-results.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from _results import machine_facts, refuse_foreign  # bench/_results.py, a sibling module
from gguf import GGMLQuantizationType

import aioexperts
from aioexperts.testing import SyntheticSpec, cache_dir, write_synthetic_model
from aioexperts_bench import dumps_json

SPEC = SyntheticSpec(
    n_layer=1, n_embd=7168, n_ff_exp=2048, n_expert=128, n_expert_used=8, expert_type=GGMLQuantizationType.Q2_K
)
CHUNKS: list[int | None] = [None, 4 << 20, 2 << 20, 1 << 20, 512 << 10, 256 << 10, 128 << 10]


def label(chunk: int | None) -> str:
    return "whole" if chunk is None else f"{chunk >> 10} KiB"


async def one_expert(path: Path, expert: int, chunk: int | None) -> float:
    io = aioexperts.IOOptions(backend="io_uring", split_bytes=chunk)
    async with aioexperts.open(path, slots=2, io=io) as store:
        layer = next(iter(store.layout.layers))
        t0 = time.perf_counter()
        async with store.experts(layer, [expert]):
            seconds = time.perf_counter() - t0
        st = store.statistics()
        assert st.direct_io, "the bench needs O_DIRECT (a file system with real direct I/O)"
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9, help="rounds; each reads one new expert per chunk size")
    parser.add_argument("--model", type=Path, help="a model with large experts (default: built once in the cache dir)")
    parser.add_argument("--json", type=Path, default=Path("split-results.json"))
    parser.add_argument("--start", type=int, default=0, help="first expert to read (pick ones no earlier run read)")
    args = parser.parse_args()
    n_needed = args.rounds * len(CHUNKS)
    path = args.model or cache_dir() / "split-bench-q2_k-7168x2048-v1.gguf"
    if args.model is None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} once (1.8 GB)", file=sys.stderr)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        write_synthetic_model(tmp, SPEC)
        os.replace(tmp, path)
    n_experts = aioexperts.build_layout(aioexperts.open_model(path)).layers
    total = next(iter(n_experts.values())).n_experts
    if args.start + n_needed > total:
        parser.error(f"{args.rounds} rounds from expert {args.start} need {n_needed} experts; the model has {total}")
    expert_bytes = next(iter(aioexperts.build_layout(aioexperts.open_model(path)))).n_bytes
    rounds = []
    expert = args.start
    for r in range(args.rounds):
        order = CHUNKS[r % len(CHUNKS) :] + CHUNKS[: r % len(CHUNKS)]  # rotated
        row = {}
        for chunk in order:
            row[label(chunk)] = asyncio.run(one_expert(path, expert, chunk))
            expert += 1
        rounds.append(row)
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items()),
            file=sys.stderr,
        )
    summary = {}
    for chunk in CHUNKS:
        key = label(chunk)
        ms = [row[key] * 1e3 for row in rounds]
        ratio = [row[key] / row["whole"] for row in rounds]
        summary[key] = {
            "ms_median": statistics.median(ms),
            "ms_min": min(ms),
            "ms_max": max(ms),
            "x_whole_median": statistics.median(ratio),
            "x_whole_min": min(ratio),
            "x_whole_max": max(ratio),
        }
    print(f"one cold {expert_bytes / 2**20:.1f} MiB expert, {args.rounds} rounds (median, range; ratio per round):")
    for key, s in summary.items():
        print(
            f"  {key:>9}: {s['ms_median']:7.1f} ms ({s['ms_min']:.1f}-{s['ms_max']:.1f}),"
            f" x whole {s['x_whole_median']:.2f} ({s['x_whole_min']:.2f}-{s['x_whole_max']:.2f})"
        )
    refuse_foreign(args.json).write_text(
        dumps_json(
            {
                "aioexperts": aioexperts.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine_facts(),
                "parameters": {"rounds": args.rounds, "model": str(path), "expert_bytes": expert_bytes},
                "units": {"latency": "seconds"},
                "rounds": rounds,
                "summary_ms": summary,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
