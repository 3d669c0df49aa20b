"""Resident decode with the compute pool's threads spinning between fan-outs, and sleeping, alternated.

While the resident decode pass runs (every expert in memory: one compute job per token), the pool's
idle thread and a waiting ``map`` caller poll a counter for ``AIOEXPERTS_COMPUTE_SPIN_US``
microseconds before they sleep (:mod:`aioexperts._compute.pool`), so the pass's few hundred
fan-outs per token start without a futex wake-up. This bench loads the 48-layer built-in model once
(every expert resident), prefills ``--prompt`` tokens, then decodes ``--rounds`` rounds of two blocks
of ``--tokens`` tokens each, one with the spin and one without (the process-wide pool replaced
between blocks: ``configure_compute_pool(spin_us=...)``), in rotated order. The ratio of the
sleeping block's time per token over the spinning block's is taken within each round. With
``--against-us B`` the second block spins ``B`` microseconds instead of sleeping at once (two spin
lengths compared the same way; the results file keeps the keys ``spin_ms_per_token`` for the first
block and ``sleep_ms_per_token`` for the second, whatever it did, and ``against_us``). A run builds
(once) or loads the 48-layer built-in model, 17 GB.

    .venv/bin/python bench/spin_ab.py --rounds 8 --json spin_ab.json
    .venv/bin/python bench/spin_ab.py --render spin_ab.json docs/executor.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _results import one_line_error, refuse_foreign, replace_region, write_results  # bench/_results.py

import aioexperts
from aioexperts._compute.pool import (
    DEFAULT_SPIN_US,
    MAX_SPIN_US,
    SPIN_ENV,
    compute_pool,
    configure_compute_pool,
    default_spin_us,
    default_threads,
)
from aioexperts._errors import ConfigError
from aioexperts.testing import ensure_full_model

MODES = ("spin", "sleep")


async def measure(
    model_path: Path, rounds: int, tokens: int, prompt: int, spin_us: int, against_us: int = 0
) -> list[dict[str, Any]]:
    """Per round: ms per decode token of each mode (``spin``: ``spin_us``, ``sleep``: ``against_us``,
    0 by default)."""
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(10, 1000, prompt + 8 + 2 * rounds * tokens)]
    threads = compute_pool().n_threads
    out: list[dict[str, Any]] = []
    async with aioexperts.load(model_path, n_ctx=len(ids) + 16) as model:
        async with model.sequence() as seq:
            await seq.forward(ids[:prompt], all_logits=False)
            at = prompt
            for token in ids[at : at + 8]:  # warm-up: kernels loaded, caches touched
                await seq.forward([token], all_logits=False)
            at += 8
            for r in range(rounds):
                row: dict[str, Any] = {"round": r, "order": list(MODES if r % 2 == 0 else reversed(MODES))}
                for mode in row["order"]:
                    configure_compute_pool(threads, spin_us=spin_us if mode == "spin" else against_us)
                    times = []
                    for token in ids[at : at + tokens]:
                        t0 = time.perf_counter()
                        await seq.forward([token], all_logits=False)
                        times.append(time.perf_counter() - t0)
                    at += tokens
                    row[f"{mode}_ms_per_token"] = 1e3 * statistics.median(times)
                row["ratio"] = row["sleep_ms_per_token"] / row["spin_ms_per_token"]
                second = f"spin {against_us} us" if against_us else "sleep"
                print(
                    f"round {r}: spin {spin_us} us {row['spin_ms_per_token']:.1f} ms/token, {second} "
                    f"{row['sleep_ms_per_token']:.1f}: {row['ratio']:.3f}x",
                    flush=True,
                )
                out.append(row)
    configure_compute_pool(threads)
    return out


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of each figure over the rounds."""
    summary: dict[str, Any] = {}
    for name in ("spin_ms_per_token", "sleep_ms_per_token", "ratio"):
        values = [row[name] for row in rounds]
        summary[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary


def render_lines(results: Path) -> list[str]:
    r = json.loads(results.read_text())
    p, m, s = r["parameters"], r["machine"], r["summary"]
    isa = f" ({m['cpu_vector_isa']})" if m.get("cpu_vector_isa") else ""

    def fmt(name: str, spec: str) -> str:
        v = s[name]
        return f"{v['median']:{spec}} ({v['min']:{spec}}-{v['max']:{spec}})"

    against = p.get("against_us", 0)
    second = "sleep at once" if not against else f"spin {against} us, then sleep"
    return [
        f"<!-- rendered by bench/spin_ab.py --render {results} DOC; do not edit by hand -->",
        f"`bench/spin_ab.py`, {p['rounds']} rounds of two blocks of {p['tokens']} decode tokens after a "
        f"{p['prompt']}-token prompt, every expert resident, spin {p['spin_us']} us; {m.get('cpu', '?')}{isa} "
        f"({m.get('cores_available', '?')} cores), numba CPU `{m.get('llvm_cpu', '?')}`, started {r['started']}, "
        f"aioexperts {str(m.get('aioexperts_commit'))[:10]}. Median ms per token of each block; each "
        "figure is the median (min-max) of the rounds, the ratio that of the per-round ratios.",
        "",
        "| threads between fan-outs | ms per decode token | second row over first |",
        "|---|---|---|",
        f"| spin {p['spin_us']} us, then sleep | {fmt('spin_ms_per_token', '.1f')} | {fmt('ratio', '.3f')}x |",
        f"| {second} | {fmt('sleep_ms_per_token', '.1f')} | - |",
    ]


def refuse_foreign_results(path: Path) -> None:
    """``path`` is a spin_ab results file, or ValueError (OSError when it cannot be read)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("benchmark") != "spin_ab":
        raise ValueError(f"{path} is not a bench/spin_ab.py results file")


def render(results: Path, doc: Path, region: str = "spin_ab") -> None:
    replace_region(doc, region, render_lines(results))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="A run builds (once) or loads the 48-layer built-in model (17 GB). Examples: "
        "bench/spin_ab.py --rounds 8 --json spin_ab.json; bench/spin_ab.py --spin-us 1000 --against-us 200; "
        "bench/spin_ab.py --render spin_ab.json docs/executor.md",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one block of each setting")
    ap.add_argument("--tokens", type=int, default=6, help="decode tokens per block")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens prefilled first")
    ap.add_argument(
        "--spin-us",
        type=int,
        default=None,
        help=f"microseconds of the spinning block's spin (default $AIOEXPERTS_COMPUTE_SPIN_US, else {DEFAULT_SPIN_US})",
    )
    ap.add_argument(
        "--against-us",
        type=int,
        default=0,
        help="microseconds the second block spins (default 0: it sleeps at once)",
    )
    ap.add_argument("--json", type=Path, default=None, help="results file (default spin_ab-results.json)")
    ap.add_argument("--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"), help="render RESULTS into DOC, no run")
    args = ap.parse_args()
    if args.render:
        try:
            refuse_foreign_results(args.render[0])
            render(*args.render)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # missing, foreign or broken: one line
            print(f"{ap.prog}: error: {one_line_error(exc)}", file=sys.stderr)
            return 2
        return 0
    if args.rounds < 1 or args.tokens < 1 or args.prompt < 1:
        ap.error("--rounds, --tokens and --prompt must be >= 1")
    try:  # the environment's values, checked before the model loads
        default_threads()
        env_spin_us = default_spin_us()
    except ConfigError as exc:
        ap.error(str(exc))
    spin_us = env_spin_us if args.spin_us is None else args.spin_us
    if not 0 < spin_us <= MAX_SPIN_US:
        source = "--spin-us" if args.spin_us is not None else f"{SPIN_ENV} (the default of --spin-us)"
        ap.error(f"{source} must be in [1, {MAX_SPIN_US}] here (the first block's spin), got {spin_us}")
    if not 0 <= args.against_us <= MAX_SPIN_US:
        ap.error(f"--against-us must be in [0, {MAX_SPIN_US}] (the second block's spin)")
    if args.json is not None:
        refuse_foreign(args.json)
    started = time.time()
    path = ensure_full_model(48)
    rounds = asyncio.run(measure(path, args.rounds, args.tokens, args.prompt, spin_us, args.against_us))
    parameters = {"rounds": args.rounds, "tokens": args.tokens, "prompt": args.prompt, "spin_us": spin_us,
                  "against_us": args.against_us, "model": path.name, "command": " ".join(sys.argv)}  # fmt: skip
    out = write_results(args.json, "spin_ab", parameters, {"_ms_per_token": "milliseconds"}, rounds,
                        summarize(rounds), started)  # fmt: skip
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
