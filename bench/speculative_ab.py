"""Decode under a memory limit with and without speculative reads, alternated round by round.

``PrefetchOptions.speculative`` reads the layers beyond the prefetch depth only while the device
would otherwise sit idle. This bench runs ``aioexperts-bench --mode timeline``'s engine (a child
process in a memory cgroup, the page cache dropped first; :func:`aioexperts_bench.run_timeline_bench`)
on the 48-layer built-in model, for each limit and round once with ``speculative=0`` and once with
each value of ``--values``, in rotated order, and keeps per run the decode time per token, the
stall, the bytes read per token, the device's busy share and the pipeline ratio (decode time over
max(I/O, compute) of the run's own timeline). The ratio of a value's decode rate over
``speculative=0``'s is taken within each round.

    .venv/bin/python bench/speculative_ab.py --limits 1/4,1/2 --rounds 3 --json speculative_ab.json
    .venv/bin/python bench/speculative_ab.py --render speculative_ab.json docs/executor.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

from _results import refuse_foreign, replace_region, write_results  # bench/_results.py, a sibling module

from aioexperts.testing import full_model_path

#: the 48-layer built-in full model, as the generator names it (aioexperts-bench --mode generate writes it)
DEFAULT_MODEL = full_model_path(48)
FIGURES = ("ms_per_token", "stall_ms_per_token", "mb_per_token", "device_busy_fraction", "pipeline_ratio")


def run_once(model: Path, limit: Fraction, speculative: int, decode_tokens: int, seed: int) -> dict[str, Any]:
    """One timeline run: the figures of :data:`FIGURES` and the run's status."""
    from aioexperts_bench import TimelineConfig, run_timeline_bench

    cfg = TimelineConfig(
        model=str(model),
        limit=limit,
        decode_tokens=decode_tokens,
        n_ctx=16 + decode_tokens + 16,
        seed=seed,
        speculative=speculative,
    )
    res = run_timeline_bench(cfg)
    s, run = res["summary"], res["run"]
    row: dict[str, Any] = {"status": run["status"], "speculative": speculative}
    if s is None or run["status"] != "ok":
        return row
    return row | {
        "ms_per_token": 1e3 * s["seconds_per_token"],
        "stall_ms_per_token": 1e3 * s["stall_seconds_per_token"],
        "mb_per_token": s["bytes_per_token"] / 1e6,
        "device_busy_fraction": s["device_busy_fraction"],
        "pipeline_ratio": s["pipeline_ratio"],
    }


def summarize(rounds: list[dict[str, Any]], values: list[int]) -> dict[str, Any]:
    """Per limit and value: each figure's median, min and max over the rounds, and the per-round
    speed-up over ``speculative=0`` (its ms per token over the value's)."""
    out: dict[str, Any] = {}
    for limit in dict.fromkeys(r["limit"] for r in rounds):
        mine = [r for r in rounds if r["limit"] == limit]
        per: dict[str, Any] = {}
        for v in [0, *values]:
            runs = [r["runs"][str(v)] for r in mine if r["runs"][str(v)]["status"] == "ok"]
            per[str(v)] = {
                f: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                for f in FIGURES
                if (x := [run[f] for run in runs])
            } | {"ok_runs": len(runs)}
            if v:
                ups = [
                    r["runs"]["0"]["ms_per_token"] / r["runs"][str(v)]["ms_per_token"]
                    for r in mine
                    if r["runs"]["0"]["status"] == "ok" and r["runs"][str(v)]["status"] == "ok"
                ]
                per[str(v)]["speedup_per_round"] = ups
        out[limit] = per
    return out


def render_lines(results: Path) -> list[str]:
    r = json.loads(results.read_text())
    m, p, s = r["machine"], r["parameters"], r["summary"]
    lines = [
        f"<!-- rendered by bench/speculative_ab.py --render {results} DOC; do not edit by hand -->",
        f"`bench/speculative_ab.py`, {p['rounds']} alternated rounds, {p['decode_tokens']} decode tokens per run, "
        f"`{Path(p['model']).name}`; {m.get('cpu', '?')} ({m.get('cores_available', '?')} cores), started "
        f"{r['started']}, load average {m['load_average'][0]:.1f} at the start, aioexperts "
        f"{(m.get('aioexperts_commit') or '?')[:10]}. Median (min-max) over the rounds; speed-up = "
        "`speculative=0`'s time per token over the value's, per round.",
        "",
        "| limit | speculative | ms per token | stall ms per token | MB read per token | device busy | "
        "decode / max(I/O, compute) | speed-up per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for limit, per in s.items():
        for v, e in per.items():
            if not e.get("ok_runs"):
                lines.append(f"| {limit} | {v} | no run completed | | | | | |")
                continue

            def f(name: str, spec: str, e: dict[str, Any] = e) -> str:
                x = e[name]
                return f"{x['median']:{spec}} ({x['min']:{spec}}-{x['max']:{spec}})"

            ups = " / ".join(f"{u:.2f}x" for u in e.get("speedup_per_round", [])) or "-"
            lines.append(
                f"| {limit} | {v} | {f('ms_per_token', '.0f')} | {f('stall_ms_per_token', '.0f')} | "
                f"{f('mb_per_token', '.0f')} | {f('device_busy_fraction', '.2f')} | {f('pipeline_ratio', '.2f')} | "
                f"{ups} |"
            )
    return lines


def render(results: Path, doc: Path, region: str = "speculative_ab") -> None:
    replace_region(doc, region, render_lines(results))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--render":
        rp = argparse.ArgumentParser(prog="speculative_ab.py --render")
        rp.add_argument("results", type=Path)
        rp.add_argument("doc", type=Path)
        ra = rp.parse_args(sys.argv[2:])
        render(ra.results, ra.doc)
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a MoE GGUF on a disk with O_DIRECT")
    parser.add_argument("--limits", default="1/4,1/2", help="memory limits, fractions of the model file's size")
    parser.add_argument("--values", default="1", help="speculative values compared with 0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("speculative_ab-results.json"))
    args = parser.parse_args()
    if not args.model.is_file():
        parser.error(f"{args.model}: no such model file (aioexperts-bench --mode generate writes the built-in one)")
    try:
        limits = [Fraction(x) for x in args.limits.split(",")]
        values = [int(v) for v in args.values.split(",")]
    except (ValueError, ZeroDivisionError) as exc:
        parser.error(f"--limits / --values: {exc}")
    if any(not 0 < x <= 4 for x in limits) or any(v < 1 for v in values) or args.rounds < 1:
        parser.error("limits must be in (0, 4], values >= 1, rounds >= 1")
    refuse_foreign(args.json)
    started = time.time()
    rounds = []
    order = [0, *values]
    for i in range(args.rounds):
        for limit in limits:
            turn = order[i % len(order) :] + order[: i % len(order)]  # rotated
            runs = {}
            for v in turn:
                runs[str(v)] = run_once(args.model, limit, v, args.decode_tokens, args.seed)
                print(f"round {i} limit {limit} speculative {v}: {runs[str(v)]}", file=sys.stderr, flush=True)
            rounds.append({"round": i, "limit": str(limit), "order": turn, "runs": runs})
    params = {
        "model": str(args.model),
        "limits": [str(x) for x in limits],
        "values": values,
        "rounds": args.rounds,
        "decode_tokens": args.decode_tokens,
        "seed": args.seed,
    }
    units = {"ms_per_token": "ms", "stall_ms_per_token": "ms", "mb_per_token": "MB (1e6 bytes)"}
    out = write_results(args.json, "speculative_ab", params, units, rounds, summarize(rounds, values), started)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
