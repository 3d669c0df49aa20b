"""Cold and warm per-expert read rates of aioexperts against fio, mmap and buffered pread, in one run.

    python bench/read_rates.py [--model PATH] [--repeat 3] [--json]

Prints the table of ``aioexperts-bench`` and checks the targets of the streaming core on this
machine: io_uring O_DIRECT cold >= 0.9x fio (same block size and depth) and >= 3x mmap page faults.
These are benchmark verdicts, not tests: the numbers move with the (shared, virtual) disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console

from aioexperts._cli.bench import default_model_path, render_reads
from aioexperts._cli.readbench import run_read_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the built-in bench model)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    console = Console(file=sys.stderr if args.json else sys.stdout, width=132)
    path = args.model or os.fspath(default_model_path(console))
    results = run_read_bench(
        path, repeat=args.repeat, depth=args.depth, progress=lambda s: console.print(f"[dim]{s}[/dim]")
    )
    by = {(r.method, r.phase): r for r in results}
    uring, fio, mmap = by[("aioexperts io_uring", "cold")], by.get(("fio", "cold")), by[("mmap", "cold")]
    verdicts = {
        "x_mmap": uring.gb_per_s / mmap.gb_per_s,
        "x_fio": uring.gb_per_s / fio.gb_per_s if fio else None,
    }
    if args.json:
        json.dump({"reads": [r.as_dict() for r in results], "targets": verdicts}, sys.stdout, indent=2)
        return 0
    render_reads(results, console)
    if verdicts["x_fio"] is None:
        console.print("fio is not installed: the ratio to the device limit was not measured")
    else:
        ok = "met" if verdicts["x_fio"] >= 0.9 else "NOT met"
        console.print(f"target io_uring cold >= 0.9x fio: {verdicts['x_fio']:.2f}x ({ok})")
    ok = "met" if verdicts["x_mmap"] >= 3 else "NOT met"
    console.print(f"target io_uring cold >= 3x mmap: {verdicts['x_mmap']:.2f}x ({ok})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
