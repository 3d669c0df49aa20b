"""Soak: ``MoERunner.moe`` from many tasks with random cancellations; RSS and descriptors stay flat.

Runs for ``--minutes`` (10 by default) on a small generated model (or ``--model``), with
``--tasks`` concurrent sequences, each running MoE layers and being cancelled at random moments
(a timeout shorter than the layer, or a cancel from outside). Every ``--report`` seconds it samples
the resident set size (``/proc/self/statm``) and the open descriptors (``/proc/self/fd``), checks
the store's invariants (nothing pinned, nothing in flight once the tasks are idle), and at the end
writes the samples and a verdict to a JSON file: the RSS of the last quarter may exceed that of the
first quarter by at most ``--rss-slack-mib`` and the descriptor count must not grow.

    python bench/soak.py --minutes 10 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _results import machine_facts, refuse_foreign  # bench/_results.py, a sibling module

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model
from aioexperts_bench import dumps_json

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def sequence(runner: aioexperts.MoERunner, rng: random.Random, stop: float, counts: dict[str, int]) -> None:
    layers = list(runner.store.layout.layers)
    n_embd = runner.store.hparams.n_embd
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    while time.monotonic() < stop:
        x = (0.01 * nrng.standard_normal((rng.choice((1, 1, 1, 4)), n_embd))).astype(np.float32)
        layer = rng.choice(layers)
        try:
            if rng.random() < 0.3:
                await asyncio.wait_for(runner.moe(layer, x), timeout=rng.uniform(0.0, 0.004))
            else:
                task = asyncio.ensure_future(runner.moe(layer, x))
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    task.cancel()
                await task
            counts["done"] += 1
        except (asyncio.CancelledError, TimeoutError):
            counts["cancelled"] += 1
        except aioexperts.SlabExhaustedError:
            counts["slab_exhausted"] += 1


async def soak(args: argparse.Namespace, model: Path) -> dict[str, object]:
    rng = random.Random(args.seed)
    samples = []
    counts = {"done": 0, "cancelled": 0, "slab_exhausted": 0}
    t0 = time.monotonic()
    stop = t0 + args.minutes * 60
    async with aioexperts.open(model, cache=aioexperts.CacheOptions(slots=args.slots, wait_for_slots=True)) as store:
        runner = aioexperts.MoERunner(store, record_trace=True, trace_max_tokens=4096)
        while time.monotonic() < stop:
            window = min(stop, time.monotonic() + args.report)
            await asyncio.gather(
                *(sequence(runner, random.Random(rng.random()), window, counts) for _ in range(args.tasks))
            )
            st = store.statistics()
            assert st.pinned_slots == 0 and st.in_flight == 0, st  # idle between windows
            samples.append(
                {
                    "seconds": time.monotonic() - t0,
                    "rss_bytes": rss_bytes(),
                    "fds": n_fds(),
                    **counts,
                    "reads": st.reads,
                }
            )
            last = samples[-1]
            print(
                f"{last['seconds']:7.0f} s  RSS {last['rss_bytes'] / 2**20:7.1f} MiB  fds {last['fds']:3d}"
                f"  done {counts['done']}  cancelled {counts['cancelled']}",
                file=sys.stderr,
            )
    quarter = max(1, len(samples) // 4)
    first = max(s["rss_bytes"] for s in samples[:quarter])
    last = max(s["rss_bytes"] for s in samples[-quarter:])
    fds_first = samples[0]["fds"]
    fds_last = samples[-1]["fds"]
    return {
        "rss_first_quarter_max_bytes": first,
        "rss_last_quarter_max_bytes": last,
        "rss_growth_bytes": last - first,
        "rss_flat": last - first <= args.rss_slack_mib * 2**20,
        "fds_first": fds_first,
        "fds_last": fds_last,
        "fds_flat": fds_last <= fds_first,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run")
    parser.add_argument("--tasks", type=int, default=16, help="concurrent sequences")
    parser.add_argument("--slots", type=int, default=12, help="slab slots (small: requests wait for slots)")
    parser.add_argument("--report", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--rss-slack-mib", type=float, default=8.0, help="allowed RSS growth, first to last quarter")
    parser.add_argument("--model", type=Path, help="a MoE GGUF (default: a small generated one)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("soak-results.json"), help="where to write the samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "soak.gguf"
            write_synthetic_model(
                model, SyntheticSpec(n_layer=4, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=4)
            )
        if args.loop == "uvloop":
            import uvloop

            result = uvloop.run(soak(args, model))
        else:
            result = asyncio.run(soak(args, model))
    result.update(
        {
            "aioexperts": aioexperts.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_facts(),
            "parameters": {k: str(v) for k, v in vars(args).items()},
            "units": {"rss": "bytes", "time": "seconds"},
        }
    )
    refuse_foreign(args.json).write_text(dumps_json(result, indent=1))
    ok = bool(result["rss_flat"] and result["fds_flat"])
    mib_first = result["rss_first_quarter_max_bytes"] / 2**20  # type: ignore[operator]
    mib_last = result["rss_last_quarter_max_bytes"] / 2**20  # type: ignore[operator]
    print(
        f"RSS {mib_first:.1f} -> {mib_last:.1f} MiB, fds {result['fds_first']} -> {result['fds_last']}:"
        f" {'flat' if ok else 'GROWING'} ({args.json})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
