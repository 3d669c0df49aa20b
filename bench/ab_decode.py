"""Decode speed of two checkouts of aioexperts, old against new, in the same run over interleaved rounds.

Usage::

    git worktree add /tmp/old REV
    python bench/ab_decode.py --old /tmp/old --layers 8 --tokens 16 --rounds 3 --out ab-results.json

Each round runs, in this order (the order alternates each round), one process per checkout: the
built-in full model (``--layers`` layers, written once into the user cache) loaded with every
expert resident, warmed by one 8-token prompt and one decode token, then ``--tokens`` greedy decode
steps of one sequence timed one by one (forward and sampling). A process imports the aioexperts of
its checkout (``PYTHONPATH``); the greedy tokens of both must agree (the restructurings it is for
change no number). Per round: new tokens/s over old tokens/s. The figure is the median (min-max) of
the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

HERE = Path(__file__).resolve().parents[1]

WORKER = r"""
import asyncio, json, sys, time
import aioexperts

async def main(path, n_experts, tokens):
    async with aioexperts.load(path, slots=n_experts, n_ctx=256) as model:
        async with model.sequence() as seq:
            warm = [t async for t in seq.generate(list(range(1, 9)), max_tokens=2)]
            times, got = [], []
            gen = seq.generate([], max_tokens=tokens)
            t0 = time.perf_counter()
            async for token in gen:
                now = time.perf_counter()
                times.append(now - t0)
                got.append(token)
                t0 = now
        print(json.dumps({"file": aioexperts.__file__, "step_seconds": times, "tokens": warm + got}, allow_nan=False))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def run(checkout: Path, model: Path, n_experts: int, tokens: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(model), str(n_experts), str(tokens)],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: the decode run failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(str(checkout)):
        raise SystemExit(f"{checkout}: imported aioexperts from {out['file']}, not from the checkout")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the old checkout (a git worktree)")
    parser.add_argument("--new", type=Path, default=HERE, help="the new checkout (default: this one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from aioexperts.testing import FULL_SPEC, ensure_full_model, print_progress

    started = time.time()
    model = ensure_full_model(args.layers, progress=print_progress())
    n_experts = FULL_SPEC.n_expert * args.layers
    rounds = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        got = {name: run(getattr(args, name).resolve(), model, n_experts, args.tokens) for name in order}
        rate = {name: len(g["step_seconds"]) / sum(g["step_seconds"]) for name, g in got.items()}
        same = got["old"]["tokens"] == got["new"]["tokens"]
        ratio = rate["new"] / rate["old"]
        rounds.append(
            {"round": r + 1, "order": list(order), "tokens_per_second": rate, "ratio": ratio, "same_tokens": same}
        )
        print(
            f"round {r + 1}: old {rate['old']:.2f} tok/s, new {rate['new']:.2f} tok/s, new/old {ratio:.3f}, "
            f"same greedy tokens: {same}",
            flush=True,
        )
    ratios = [x["ratio"] for x in rounds]
    summary = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "same_tokens": all(x["same_tokens"] for x in rounds)}  # fmt: skip
    spread = f"{summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}"
    print(
        f"new/old decode tokens/s: {summary['ratio_median']:.3f} ({spread}) over {args.rounds} interleaved rounds; "
        f"greedy tokens agree: {summary['same_tokens']}"
    )
    parameters = {"layers": args.layers, "tokens": args.tokens, "rounds": args.rounds, "old": str(args.old)}
    write_results(args.out, "ab_decode", parameters, {"tokens_per_second": "tokens/s"}, rounds, summary, started)


if __name__ == "__main__":
    main()
