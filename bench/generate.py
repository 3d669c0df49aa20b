"""Render the results of ``aioexperts-bench --mode generate`` into README.md and docs/bench.md.

Usage::

    aioexperts-bench --mode generate --routing spread --limits 1/4 --out docs/results/generate-48l-spread-quarter.json
    python bench/generate.py --render docs/results/generate-48l-*.json -- README.md docs/bench.md

Results files of one model are merged (runs and rounds; summary and targets computed again), one
section per model. The region is ``<!-- bench:generate-headline -->`` ... its end marker.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aioexperts_bench import load_generate_results, render_into

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import one_line_error  # noqa: E402  (a sibling module of this script)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--render", nargs="+", required=True, metavar="RESULTS", help="results files, then -- and the docs")
    ap.add_argument("docs", nargs="*", type=Path, help="documents whose region is replaced")
    args = ap.parse_args(argv)
    try:
        results = [load_generate_results(p) for p in args.render]
        for doc in args.docs:
            if not render_into(doc, results, args.render):
                print(f"{doc}: no <!-- bench:generate-headline --> region", file=sys.stderr)
                return 1
    except (OSError, ValueError) as exc:  # a results file or doc missing or of another kind: one line
        print(f"{ap.prog}: error: {one_line_error(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
