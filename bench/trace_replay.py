"""Trace replay: hit rates of LRU, LFU, LFUDA and Belady's optimum at slabs of 10 %, 25 % and 50 %.

    python bench/trace_replay.py [--trace FILE.npz] [--tokens 2000] [--seed 0]

Without ``--trace`` it replays two generated traces of the bench model's geometry (8 MoE layers,
128 experts, top-8): uniform random routing and a skewed one (Zipf popularity per layer and
token-to-token locality). A trace recorded with ``MoERunner(store, record_trace=True)`` and
``runner.routing_trace().save(path)`` can be replayed with ``--trace``.
"""

from __future__ import annotations

import argparse
import sys

from aioexperts._predict.simulate import format_replay_table, replay_fractions
from aioexperts._predict.trace import RoutingTrace, skewed_random_trace, uniform_random_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a routing trace (.npz, docs/trace-format.md)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.trace:
        traces = {args.trace: RoutingTrace.load(args.trace)}
    else:
        layers, n, k = list(range(8)), 128, 8
        traces = {
            "uniform": uniform_random_trace(args.tokens, layers, n, k, args.seed),
            "skewed": skewed_random_trace(args.tokens, layers, n, k, args.seed),
        }
    for name, trace in traces.items():
        print(f"{name}: {trace.n_tokens} tokens x {trace.n_layers} layers, top-{trace.k}")
        print(format_replay_table(replay_fractions(trace)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
