"""Per-token figures: the I/O-compute overlap and tokens per second of the executor.

    python bench/token_pipeline.py [aioexperts-bench options]

The same as ``aioexperts-bench --mode tokens`` (``--help`` lists the options): per round, the
I/O-only and compute-only token times and the pipelined token, measured in the same round
(``overlap = token / max(io, compute)``, target <= 1.15), and the executor's tokens per second at
slabs of 0 %, 25 % and 100 %.
"""

from __future__ import annotations

import sys

from aioexperts.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(["--mode", "tokens", *sys.argv[1:]]))
