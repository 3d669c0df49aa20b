"""``aioexperts-trace``: what a recorded routing trace says about caching its model's experts.

Subcommands:

- ``summary TRACE``: per MoE layer, how concentrated the routing is (the share of requests the
  hottest 10 % of experts serve, the experts never chosen), and the slab size in slots (and
  bytes, with ``--model``) that reaches each target hit rate under LRU and under Belady's optimum;
- ``order TRACE -o FILE [--force]``: a hot-first ordering of every layer's experts (JSON), for a
  repacking step that places the hottest experts first. It never writes over the trace (compared
  by device and inode), and replaces an existing file only if it is an ordering, or with ``--force``.

Traces are the ``.npz`` files of :meth:`aioexperts.RoutingTrace.save` (``docs/trace-format.md``),
recorded with ``MoERunner(store, record_trace=True)``. Errors are printed as one line on stderr with
exit status 2; a closed pipe on stdout (``aioexperts-trace summary --json T | head``) ends it quietly
with status 141.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import AioExpertsError, FormatError, RoutingTrace, build_layout, open_model
from .. import _json as strict_json  # the one strict JSON writer (an import-rule exception)
from ..traces import BELADY, expert_frequencies, format_bytes, slot_table
from ._common import (
    INTERRUPTED_STATUS,
    USAGE_STATUS,
    HelpFormatter,
    OneLineParser,
    add_version,
    error_text,
    input_file,
    model_file,
    plural,
    refuse_to_overwrite,
    stdout_closed,
)
from ._texttable import text_table

__all__ = ("hot_first_order", "main")

HOT_FRACTION = 0.1
"""The "hottest experts" of the summary: this fraction of a layer's experts."""


def hot_first_order(trace: RoutingTrace) -> dict[int, list[int]]:
    """Per MoE layer, every expert id ordered by how many tokens chose it, most first (ties: lower id)."""
    return {
        layer: [int(e) for e in np.lexsort((np.arange(len(counts)), -counts))]
        for layer, counts in expert_frequencies(trace).items()
    }


def _hot_share(counts: np.ndarray) -> float | None:
    """The share of requests the hottest :data:`HOT_FRACTION` of experts serve; None (JSON ``null``)
    for a layer no token was routed through."""
    total = int(counts.sum())
    if total == 0:
        return None
    n_hot = max(1, math.ceil(HOT_FRACTION * len(counts)))
    return float(np.sort(counts)[::-1][:n_hot].sum() / total)


def _summary(trace: RoutingTrace, targets: Sequence[float], expert_bytes: int | None) -> dict[str, Any]:
    freq = expert_frequencies(trace)
    layers = [
        {
            "layer": layer,
            "n_experts": len(counts),
            "requests": int(counts.sum()),
            "never_chosen": int((counts == 0).sum()),
            "hot_share": _hot_share(counts),
            "hottest": [int(e) for e in np.argsort(-counts, kind="stable")[:5]],
        }
        for layer, counts in freq.items()
    ]
    sizes = []
    t0 = last = time.monotonic()
    replays = 0

    def progress(policy: str, slots: int, hit_rate: float) -> None:  # a long trace: say where it is
        nonlocal last, replays
        replays += 1
        now = time.monotonic()
        if now - last >= 2.0:
            last = now
            print(
                f"aioexperts-trace: {policy} at {slots} slots hits {100 * hit_rate:.1f} % "
                f"({replays} replays, {now - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    requested = any(layer["requests"] for layer in layers)
    # an empty trace (0 tokens, or only -1 ids) is valid: it asks for no slot at any hit rate
    found = slot_table(trace, targets, ("lru", BELADY), progress) if requested else {}
    for i, target in enumerate(targets):
        row: dict[str, Any] = {"hit_rate": target}
        for policy in ("lru", BELADY):
            slots = found[policy][i] if requested else 0
            row[policy] = slots
            row[f"{policy}_bytes"] = None if slots is None or expert_bytes is None else slots * expert_bytes
        sizes.append(row)
    return {
        "n_tokens": trace.n_tokens,
        "n_layers": trace.n_layers,
        "k": trace.k,
        "n_experts_total": trace.n_experts_total,
        "hot_fraction": HOT_FRACTION,
        "expert_bytes": expert_bytes,
        "layers": layers,
        "slab_sizes": sizes,
    }


def _print_summary(path: str, s: dict[str, Any]) -> None:
    print(
        f"{path}: {plural(s['n_tokens'], 'token')}, {plural(s['n_layers'], 'MoE layer')}, top-{s['k']}, "
        f"{plural(s['n_experts_total'], 'expert')}"
    )
    print(
        text_table(
            ("layer", "experts", "requests", "never chosen", f"hottest {s['hot_fraction']:.0%} serve", "hottest ids"),
            [
                (
                    r["layer"],
                    r["n_experts"],
                    r["requests"],
                    r["never_chosen"],
                    "-" if r["hot_share"] is None else f"{r['hot_share']:.1%}",
                    " ".join(map(str, r["hottest"])),
                )
                for r in s["layers"]
            ],
            right=(True, True, True, True, True, False),
        )
    )
    print()
    print("slab size that reaches a hit rate (slots; LRU as the cache runs it, Belady as the offline optimum):")

    def cell(slots: int | None, n_bytes: int | None) -> str:
        if slots is None:
            return "unreachable"
        text = f"{slots} ({slots / s['n_experts_total']:.0%})"
        return f"{text}, {format_bytes(n_bytes)}" if n_bytes is not None else text

    print(
        text_table(
            ("hit rate", "LRU", "Belady"),
            [
                (f"{r['hit_rate']:.0%}", cell(r["lru"], r["lru_bytes"]), cell(r[BELADY], r[f"{BELADY}_bytes"]))
                for r in s["slab_sizes"]
            ],
            right=(True, True, True),
        )
    )
    print("'unreachable': compulsory misses (each expert's first request) keep the hit rate below the target.")


_ORDER_KEYS = frozenset({"trace", "n_tokens", "layers"})


def _is_order_file(path: str) -> bool:
    """Whether ``path`` is an ordering this tool wrote (a JSON object with its keys)."""
    try:
        if os.path.getsize(path) > 1 << 30:
            return False
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and set(doc) == _ORDER_KEYS


def _hit_rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"hit rates must be numbers in (0, 1], got {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"hit rates must be numbers in (0, 1], got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    fmt = HelpFormatter
    parser = OneLineParser(
        prog="aioexperts-trace",
        description="Read a routing trace: per-layer expert frequency, slab size per target hit rate, hot-first order.",
        formatter_class=fmt,
    )
    add_version(parser, "aioexperts-trace")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="expert frequency and slab sizes", formatter_class=fmt)
    p.add_argument("trace", help="a routing trace (.npz)")
    p.add_argument("--hit-rate", type=_hit_rates, default="0.5,0.8,0.9", help="target hit rates, comma-separated")
    p.add_argument("--model", help="the model the trace was recorded on, to give slab sizes in bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p = sub.add_parser("order", help="write a hot-first expert ordering (JSON)", formatter_class=fmt)
    p.add_argument("trace", help="a routing trace (.npz)")
    p.add_argument("-o", "--output", required=True, help="the JSON file to write")
    p.add_argument("--force", action="store_true", help="replace an existing file that is not an ordering")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``aioexperts-trace``; returns the exit status (0 ok, 2 error)."""
    args = _parser().parse_args(argv)
    try:
        model = model_file(args.model) if getattr(args, "model", None) else None  # before the trace is read
        trace = RoutingTrace.load(input_file(args.trace, "trace file"))
        if args.command == "summary":
            expert_bytes = None
            if model is not None:
                layout = build_layout(open_model(model))
                model_geometry = (tuple(layout.layers), tuple(m.n_experts for m in layout.layers.values()))
                if model_geometry != (trace.layers, trace.n_experts):
                    raise FormatError(
                        f"the trace is not of this model: it has MoE layers {list(trace.layers)} with "
                        f"{list(trace.n_experts)} experts, the model {list(model_geometry[0])} with "
                        f"{list(model_geometry[1])}"
                    )
                expert_bytes = layout.max_expert_bytes
            summary = _summary(trace, args.hit_rate, expert_bytes)
            if args.json:
                print(strict_json.dumps(summary, indent=2))
            else:
                _print_summary(args.trace, summary)
        else:
            output = os.path.expanduser(args.output)
            refuse_to_overwrite(output, [args.trace], ours=_is_order_file, force=args.force, what="the ordering")
            order = hot_first_order(trace)
            freq = expert_frequencies(trace)
            doc = {
                "trace": os.path.abspath(args.trace),
                "n_tokens": trace.n_tokens,
                "layers": {
                    str(layer): {"hot_first": ids, "counts": [int(freq[layer][e]) for e in ids]}
                    for layer, ids in order.items()
                },
            }
            with open(output, "w") as f:
                strict_json.dump(doc, f, indent=1)
            print(f"wrote {args.output}: {plural(len(order), 'layer')}")
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:  # `aioexperts-... | head`: the reader has what it wanted
        return stdout_closed()
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-trace: error: {error_text(exc)}", file=sys.stderr)
        return USAGE_STATUS
    except KeyboardInterrupt:
        print("aioexperts-trace: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
