"""Per-token pipeline: tokens/s with prefetch on and off, hit rates, and the I/O-compute overlap.

    python bench/token_pipeline.py [--model PATH] [--compute synthetic|executor] [--repeat 3]

Checks the target of the scheduler on this machine: ``token_time / max(io_time, compute_time)``
<= 1.1 with a compute step as long as the I/O (``--compute synthetic``, the default). With
``--compute executor`` it prints the numpy executor's compute time per token next to the I/O time
of the same experts (the executor's goal is compute <= I/O at 0 % hits).
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from aioexperts._cli.bench import default_model_path, render_tokens
from aioexperts._cli.tokenbench import run_token_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the built-in bench model)")
    parser.add_argument("--compute", choices=("synthetic", "executor"), default="synthetic")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--slab-fraction", type=float, default=0.25)
    args = parser.parse_args()
    console = Console(width=132)
    path = args.model or os.fspath(default_model_path(console))
    result = run_token_bench(
        path,
        n_tokens=args.tokens,
        compute=args.compute,
        repeat=args.repeat,
        slab_fraction=args.slab_fraction,
        progress=lambda s: console.print(f"[dim]{s}[/dim]"),
    )
    render_tokens(result, console)
    if args.compute == "synthetic":
        ok = "met" if result.overlap <= 1.1 else "NOT met"
        console.print(
            f"target overlap <= 1.1: {result.overlap:.2f} ({ok}); "
            f"against the I/O time under the same CPU load: {result.overlap_loaded:.2f}"
        )
    else:
        ratio = result.compute_ms_per_token / result.io_ms_per_token
        console.print(
            f"executor compute {result.compute_ms_per_token:.1f} ms/token vs I/O {result.io_ms_per_token:.1f} ms/token "
            f"of the same experts: compute is {ratio:.2f}x the I/O (goal <= 1.0)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
