"""Decode mat-vecs at the built-in model's shapes, 1 and 4 tokens, against ggml's own kernel, one thread.

    python bench/matvec_rows.py [--rounds 7] [--calls 30] [--types Q6_K,Q2_K] [--label after] [--out PATH]

The built-in model (Qwen3-30B-A3B geometry) keeps its experts in Q4_K (gate/up ``768 x 2048``, down
``2048 x 768``) and its attention/dense weights in Q8_0 (q ``4096 x 2048``, o ``2048 x 4096``, k/v
``512 x 2048``); Q6_K (the output head's type in many files) and the other types run at
``768 x 2048`` (Q4_0 and Q5_0 last, so the earlier cases' matrices stay those of runs without
them). Matrices are ``bench/dequant.py``'s (``gguf.quants.quantize`` of N(0, 0.02), else random
bytes with sane scales); ``--types`` times only the cases of the named types (their matrices then
differ from a full run's: one random stream feeds the cases in order).
Methods, interleaved round by round (median of ``--calls`` calls per round), one thread (BLAS too):

* ``ggml``: ``ggml_mul_mat`` of the same bytes by one token (``aioexperts_bench.ggml_baseline``);
* ``float``, ``int8``: ``fused.linear`` with one token at each precision;
* ``float4``, ``int8x4``: ``fused.linear`` with four tokens (``x ggml`` then compares with four
  ggml one-token calls: the time ggml's kernel would need for the four tokens one by one);
* with ``--threads2``, for matrices of at least ``SPLIT_BYTES``: ``int8_t2``, the one-token int8
  product with a 2-thread compute pool in the process and ``fused.SPLIT_MIN_BYTES`` set to
  ``SPLIT_BYTES`` (rows split over the calling thread and one idle worker; the split is off by
  default), against ``ggml_t2``, ggml with 2 threads.

GB/s are weight bytes per second (per call, however many tokens); ``x ggml`` is ggml's time over
ours in the same round (int8 targets: 0.8 for Q4_K, Q6_K, Q8_0, 0.6 for the other types, 1 and 4
tokens). ``--label`` names the run in the results file (``matvec-rows-results.json``; committed
copies under ``docs/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _results import median_time, one_line_error, replace_region, summary, write_results
from dequant import make_tensor
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from aioexperts._compute import fused
from aioexperts_bench import ggml_baseline

Q = GGMLQuantizationType
CASES: tuple[tuple[Q, tuple[int, int]], ...] = (
    (Q.Q4_K, (768, 2048)),
    (Q.Q4_K, (2048, 768)),
    (Q.Q8_0, (4096, 2048)),
    (Q.Q8_0, (2048, 4096)),
    (Q.Q8_0, (512, 2048)),
    (Q.Q6_K, (768, 2048)),
    (Q.Q5_K, (768, 2048)),
    (Q.Q3_K, (768, 2048)),
    (Q.Q2_K, (768, 2048)),
    (Q.IQ4_XS, (768, 2048)),
    (Q.MXFP4, (768, 2048)),
    (Q.Q4_0, (768, 2048)),
    (Q.Q5_0, (768, 2048)),
)
#: issue 33's per-call targets of the int8 kernels against ggml (1 and 4 tokens), by type
INT8_TARGETS: dict[Q, float] = {Q.Q4_K: 0.8, Q.Q6_K: 0.8, Q.Q8_0: 0.8}
INT8_TARGET_OTHERS = 0.6
#: tokens of the batched methods, and how many ggml one-token calls they stand for
BATCH = 4
#: the row-split threshold ``--threads2`` times (4 MiB: the q and o projections)
SPLIT_BYTES = 4 << 20


def case_methods(
    qtype: Q, shape: tuple[int, int], rng: np.random.Generator, lib: ggml_baseline.GgmlLibrary, threads2: bool
) -> tuple[dict[str, Callable[[], object]], dict[str, float], int]:
    rows, cols = shape
    raw = make_tensor(qtype, shape, rng).reshape(-1)
    view = memoryview(raw).toreadonly()
    x1 = rng.standard_normal((1, cols)).astype(np.float32)
    x4 = rng.standard_normal((BATCH, cols)).astype(np.float32)
    out1 = np.empty((1, rows), np.float32)
    out4 = np.empty((BATCH, rows), np.float32)

    def at(precision: str, x: np.ndarray, out: np.ndarray) -> Callable[[], object]:
        def run() -> object:
            fused.set_precision(precision)  # type: ignore[arg-type]
            try:
                return fused.linear(view, qtype, shape, x, out=out)
            finally:
                fused.set_precision(None)

        return run

    matvec = ggml_baseline.GgmlMatVec(raw, qtype, shape, library=lib)
    got = matvec(x1)
    agreement = {
        "vs_float": ggml_baseline.check_agreement(got, at("float", x1, out1)().copy(), qtype),
        "vs_int8": ggml_baseline.relative_error(got, at("int8", x1, out1)().copy()),
    }
    matvec.set_input(x1)
    fns = {
        "ggml": matvec.compute,
        "float": at("float", x1, out1),
        "int8": at("int8", x1, out1),
        "float4": at("float", x4, out4),
        "int8x4": at("int8", x4, out4),
    }
    if threads2 and raw.nbytes >= SPLIT_BYTES:
        from aioexperts._compute import pool as pool_module

        two = ggml_baseline.GgmlMatVec(raw, qtype, shape, n_threads=2, library=lib)
        two.set_input(x1)
        fns["ggml_t2"] = two.compute
        single = at("int8", x1, out1)

        def in_pool() -> object:
            saved = pool_module._pool, fused.SPLIT_MIN_BYTES
            pool_module._pool, fused.SPLIT_MIN_BYTES = POOL2[0], SPLIT_BYTES
            try:
                return single()
            finally:
                pool_module._pool, fused.SPLIT_MIN_BYTES = saved

        fns["int8_t2"] = in_pool
    return fns, agreement, raw.nbytes


#: the 2-thread pool of ``--threads2`` (made once; native libraries stay capped by threadpool_limits)
POOL2: list[Any] = []


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for qtype, shape in CASES:
        key = f"{qtype.name} {shape[0]}x{shape[1]}"
        mine = [r for r in rounds if r["case"] == key]
        if not mine:  # left out by --types
            continue
        by: dict[str, list[float]] = {}
        for r in mine:
            by.setdefault(r["method"], []).append(r["seconds"])
        nbytes = mine[0]["weight_bytes"]
        entry: dict[str, Any] = {
            "weight_bytes": nbytes,
            "seconds": {m: summary(v) for m, v in by.items()},
            "gbps": {m: summary([nbytes / t / 1e9 for t in v]) for m, v in by.items()},
        }
        if "int8_t2" in by:
            entry["x_ggml_t2_int8_t2"] = summary([g / t for g, t in zip(by["ggml_t2"], by["int8_t2"], strict=True)])
            entry["x_int8_t2_over_int8"] = summary([a / b for a, b in zip(by["int8"], by["int8_t2"], strict=True)])
        for m, v in by.items():
            if m in ("ggml", "ggml_t2", "int8_t2"):
                continue
            tokens = BATCH if m.endswith("4") else 1
            entry[f"x_ggml_{m}"] = summary([tokens * g / t for g, t in zip(by["ggml"], v, strict=True)])
        target = INT8_TARGETS.get(qtype, INT8_TARGET_OTHERS)
        entry["int8_target"] = target
        entry["int8_met"] = min(entry["x_ggml_int8"]["median"], entry["x_ggml_int8x4"]["median"]) >= target
        result[key] = entry
    return result


def print_table(result: dict[str, Any], label: str) -> None:
    def rng_(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    print(f"## {label}: GB/s of weights, x ggml (ggml's time over ours; 4 tokens: over 4 ggml calls)")
    print(
        "| case | ggml GB/s | float GB/s | x ggml | int8 GB/s | x ggml | int8x4 x ggml | float4 x ggml | int8 target |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, e in result.items():
        g = e["gbps"]
        met = "met" if e["int8_met"] else "MISSED"
        print(
            f"| {key} | {rng_(g['ggml'])} | {rng_(g['float'])} | {rng_(e['x_ggml_float'])} | {rng_(g['int8'])} "
            f"| {rng_(e['x_ggml_int8'])} | {rng_(e['x_ggml_int8x4'])} | {rng_(e['x_ggml_float4'])} "
            f"| >= {e['int8_target']} {met} |"
        )
    for key, e in result.items():
        if "x_ggml_t2_int8_t2" in e:
            print(
                f"2 threads, {key}: int8 {rng_(e['gbps']['int8_t2'])} GB/s, x ggml(2 threads) "
                f"{rng_(e['x_ggml_t2_int8_t2'])}, over our 1 thread {rng_(e['x_int8_t2_over_int8'])}"
            )


def render(results: Path, doc: Path, region: str = "matvec_rows") -> None:
    """Replace the text between ``<!-- bench:REGION -->`` and its end marker in ``doc`` with the
    table of ``results`` (its machine, date, rounds and per-type targets); one region per CPU kind."""
    r = json.loads(results.read_text())
    m, p = r["machine"], r["parameters"]
    flags = ", ".join(f.upper() for f in m.get("cpu_flags", []))

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    lines = [
        f"<!-- rendered by bench/matvec_rows.py --render {results} DOC"
        + ("" if region == "matvec_rows" else f" --region {region}")
        + "; do not edit by hand -->",
        f"`bench/matvec_rows.py` on a {m['cores_available']}-core {m.get('cpu') or '?'} ({flags}; numba CPU "
        f"`{m.get('llvm_cpu')}`), started {r['started']}, load average {m['load_average_before'][0]:.1f} before; "
        f"one thread, llama-cpp-python {p['llama_cpp_python']}'s ggml in the same rounds. ggml's time over ours, "
        f"median (min-max) of {p['rounds']} interleaved rounds (4 tokens: over 4 ggml calls).",
        "",
        "| matrix | ggml GB/s | int8, 1 token | int8, 4 tokens | target | float, 1 token |",
        "|---|---|---|---|---|---|",
    ]
    for key, e in r["summary"].items():
        verdict = "met" if e["int8_met"] else "**MISSED**"
        lines.append(
            f"| {key} | {e['gbps']['ggml']['median']:.1f} | {cell(e['x_ggml_int8'])} | {cell(e['x_ggml_int8x4'])} "
            f"| >= {e['int8_target']}: {verdict} | {cell(e['x_ggml_float'])} |"
        )
    replace_region(doc, region, lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="calls per timing (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads2", action="store_true", help="also time the 2-thread row split")
    parser.add_argument("--types", help="comma-separated ggml type names to time (default: every case)")
    parser.add_argument(
        "--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"), help="render RESULTS into DOC's region and exit"
    )
    parser.add_argument(
        "--region", default="matvec_rows", help="the region of DOC (<!-- bench:REGION -->; one per CPU kind)"
    )
    args = parser.parse_args()
    if args.render:
        try:
            render(*args.render, region=args.region)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # missing, foreign or broken
            print(f"{parser.prog}: error: {one_line_error(exc)}", file=sys.stderr)
            return 2
        return 0
    cases_timed = CASES
    if args.types:
        names = {name.strip().upper() for name in args.types.split(",") if name.strip()}
        unknown = names - {qtype.name for qtype, _ in CASES}
        if unknown:
            raise SystemExit(f"--types: no case of type {', '.join(sorted(unknown))}")
        cases_timed = tuple((qtype, shape) for qtype, shape in CASES if qtype.name in names)
    reason = ggml_baseline.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"ggml baseline unavailable: {reason}")
    lib = ggml_baseline.load()
    started = time.time()
    load_before = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    if args.threads2:
        from aioexperts._compute.pool import ComputePool

        POOL2.append(ComputePool(2, limit_native_threads=False))
    with threadpool_limits(1):
        cases = {}
        agreement = {}
        sizes = {}
        for qtype, shape in cases_timed:
            key = f"{qtype.name} {shape[0]}x{shape[1]}"
            cases[key], agreement[key], sizes[key] = case_methods(qtype, shape, rng, lib, args.threads2)
        for fns in cases.values():
            for fn in fns.values():
                fn()
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for key, fns in cases.items():
                for name, fn in fns.items():
                    rounds.append(
                        {"round": r, "case": key, "method": name, "seconds": median_time(fn, args.calls),
                         "weight_bytes": sizes[key]}
                    )  # fmt: skip
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    result = summarize(rounds)
    for key, agreed in agreement.items():
        result[key]["ggml_agreement"] = agreed
    print_table(result, args.label)
    print(f"load average before {load_before}, after {os.getloadavg()}")
    path = write_results(
        args.out,
        "matvec-rows",
        {"rounds": args.rounds, "calls": args.calls, "seed": args.seed, "label": args.label, "batch": BATCH,
         "threads": 1, "threads2": args.threads2, "types": args.types, "llama_cpp_python": lib.version},
        {"seconds": "s per call (median of calls)", "gbps": "weight GB/s", "x_ggml": "ggml time / ours"},
        rounds,
        result,
        started,
        machine={"load_average_before": load_before},
    )  # fmt: skip
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
