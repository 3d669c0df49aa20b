"""Cold read rates of aioexperts against fio, a thread pool, buffered pread and mmap, on the same reads.

    python bench/read_rates.py [aioexperts-bench options]

The same as ``aioexperts-bench --mode reads`` (``--help`` lists the options): the store's reads
of one cold pass are recorded and every method replays exactly those reads, in rotated order, for
``--rounds`` rounds; the tables show medians with their ranges and per-round ratios, and the
targets as met or missed. These are benchmark verdicts, not tests.
"""

from __future__ import annotations

import sys

from aioexperts.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(["--mode", "reads", *sys.argv[1:]]))
