"""CPU per GiB of the store's O_DIRECT expert reads with the slab on 4 KiB pages or on huge pages.

Issue 36: a direct read into 4 KiB pages is one DMA segment per page, which the block layer walks and,
past the device's segment limit, splits into several requests (each one more interrupt and more
completion work); the slab is therefore laid out for transparent huge pages (``Slab(thp=True)``:
a 2 MiB-aligned start, ``MADV_HUGEPAGE`` before the pre-fault). This bench alternates, in one
process and round by round in rotated order, the store's reads (``bench/read_cpu.py``'s
``through_store``: ``--tasks`` tasks asking ``store.experts(layer, ids)`` for fresh groups of
``--top-k`` experts, a fresh store per run, the page cache dropped before each) with the slab:

- ``4k``: on 4 KiB pages (``thp=False``, the layout before issue 36's change);
- ``thp``: from a 2 MiB boundary on transparent huge pages (the default);
- ``2mib-slots``: every slot rounded up to 2 MiB (``CacheOptions(hugepages=True)``).

    .venv/bin/python bench/slab_layout.py --rounds 4 --json slab_layout.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

from _results import refuse_foreign, write_results  # bench/_results.py, a sibling module
from read_cpu import (  # bench/read_cpu.py
    DEFAULT_MODEL,
    UNITS,
    group_capacity,
    per_gib_summary,
    pick_groups,
    through_store,
)

import aioexperts
from aioexperts._io.slab import Slab
from aioexperts._sources import stack
from aioexperts_bench import GIB, drop_page_cache

LAYOUTS = ("4k", "thp", "2mib-slots")


def use_layout(layout: str) -> None:
    """Make every slab the store builds from now on take ``layout`` (see the module docstring)."""

    class LaidOut(Slab):
        def __init__(
            self, n_slots: int, slot_bytes: int, *, hugepages: bool = False, lock: bool = False, **kw: Any
        ) -> None:
            super().__init__(n_slots, slot_bytes, hugepages=layout == "2mib-slots", lock=lock, thp=layout != "4k")

    stack.Slab = LaidOut  # type: ignore[misc]  # ReadStack.build_slab makes its slab through this name


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a MoE GGUF on a disk with O_DIRECT")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--groups", type=int, default=48, help="groups (one layer's top-k experts) per run")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--depth", type=int, default=32, help="reads in flight (ring depth)")
    parser.add_argument("--tasks", type=int, default=2, help="concurrent store.experts() callers")
    parser.add_argument("--backend", default="io_uring", help="io_uring, io_uring_raw or threads")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--json", type=Path, default=Path("slab_layout-results.json"))
    args = parser.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    if not args.model.is_file():
        parser.error(f"{args.model} does not exist (`aioexperts-bench --mode generate` writes the 48-layer model)")
    refuse_foreign(args.json)
    started = time.time()
    model = aioexperts.open_model(args.model)
    layout_of_model = aioexperts.build_layout(model)
    n_runs = args.rounds * len(layouts)
    if args.rounds < 1 or args.groups < 1 or args.groups * n_runs > group_capacity(layout_of_model, args.top_k):
        parser.error(f"{args.rounds} rounds x {len(layouts)} layouts x --groups {args.groups} fresh groups do not fit")
    groups = pick_groups(layout_of_model, args.groups * n_runs, args.top_k, random.Random(args.seed))
    paths = [s.path for s in model.shards]
    rounds = []
    run = 0
    for r in range(args.rounds):
        order = layouts[r % len(layouts) :] + layouts[: r % len(layouts)]
        row: dict[str, Any] = {"round": r, "order": order}
        for name in order:
            use_layout(name)
            batch = groups[run * args.groups : (run + 1) * args.groups]
            run += 1
            drop_page_cache(paths)
            got, cpu, wall, details = asyncio.run(
                through_store(args.model, args.backend, batch, args.depth, args.tasks, args.top_k)
            )
            row[name] = {
                "bytes": got,
                "cpu_s": cpu,
                "cpu_s_per_gib": cpu / (got / GIB),
                "gb_s": got / 1e9 / wall,
                "wakeups": details["window_wakeups"],
                "backend": details.get("backend"),
            }
            print(
                f"round {r + 1}: {name:>10} {row[name]['cpu_s_per_gib'] * 1e3:6.1f} ms CPU/GiB, "
                f"{row[name]['gb_s']:.2f} GB/s, {row[name]['wakeups']} voluntary context switches",
                file=sys.stderr,
            )
        rounds.append(row)
    summary = {name: per_gib_summary(rounds, name) for name in layouts}
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = write_results(
        args.json,
        "slab_layout",
        {**params, "layouts": layouts},
        UNITS,
        rounds,
        summary,
        started,
    )
    for name, s in summary.items():
        print(f"{name:>10}: {s}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
