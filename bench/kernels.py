"""The compute kernels on one expert matrix, one thread: fused decode against gguf-py and ggml.

    python bench/kernels.py [--rounds 5] [--types Q4_K,Q6_K] [--skip-compile] [--out PATH]

For every type with a compiled kernel, on Qwen3-30B-A3B expert matrices (gate/up ``768 x 2048``,
down ``2048 x 768``; ``gguf.quants.quantize`` of N(0, 0.02) weights where gguf-py can quantize the
type, else random bytes with sane scales, as ``bench/dequant.py``), one thread (BLAS capped to one
thread too), interleaved rounds, median of ``--calls`` calls per round:

* ``gguf``: ``gguf.quants.dequantize`` + matmul, the baseline of the ">= 20x" target;
* ``numpy``: the project's numpy kernels (``aioexperts._format.dequant.dequantize``) + matmul;
* ``float``: ``fused.linear`` with one token, the default (fused decode-and-dot);
* ``int8``: the same with ``set_precision("int8")`` (x quantized like llama.cpp);
* ``cold``: the float kernel sweeping 96 MiB of copies of the matrix (weights not in any cache);
* ``batch n``: ``fused.linear`` with ``n`` tokens (blocked kernel; dequantize + BLAS above 64)
  against the numpy kernels + matmul;
* ``exact``: compiled exact dequantization, values per second, against the numpy kernels.

GB/s are weight bytes (ggml block bytes) per second. ``x ggml``: the fraction of llama.cpp's own
one-thread kernel on this machine (``docs/notes/KERNELS.md``), target >= 0.4. Then (unless
``--skip-compile``) the compile cost in fresh processes: cold (empty cache) and warm, for the built-in
model's types, a Q4_K_M model's types and all 15 compiled types; targets: cold <= 30 s, warm <= 2 s.
Every round goes to ``kernels-results.json`` (``--out``; the committed copy: ``docs/results/kernels.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from _results import summary, write_results
from dequant import ORDER, make_tensor
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from aioexperts._compute import fused
from aioexperts._format import dequant as quant

Q = GGMLQuantizationType

#: llama.cpp's one-thread mat-vec on this machine, GB/s of weight bytes (docs/notes/KERNELS.md)
GGML_GBPS = {
    Q.Q4_K: 14.7, Q.Q5_K: 13.2, Q.Q6_K: 18.4, Q.Q8_0: 17.6, Q.Q2_K: 10.4, Q.Q3_K: 9.2, Q.Q4_0: 11.8,
    Q.IQ4_XS: 11.1, Q.MXFP4: 4.4, Q.BF16: 20.1, Q.F16: 21.1,
}  # fmt: skip
GGUF_TARGET = 20.0
GGML_TARGET = 0.4
COLD_BYTES = 96 << 20
BATCHES = (4, 16, 64, 256)
COMPILE_TARGET_S = 30.0
WARM_TARGET_S = 2.0


def median_time(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_matrix(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """The timed callables of one type and shape (each returns after one product)."""
    rows, cols = shape
    raw2d = make_tensor(qtype, shape, rng)
    raw = raw2d.reshape(-1)
    view = memoryview(raw).toreadonly()
    x1 = rng.standard_normal((1, cols)).astype(np.float32)
    out1 = np.empty((1, rows), np.float32)
    copies = max(2, COLD_BYTES // raw.nbytes)
    pool = [memoryview(raw.copy()).toreadonly() for _ in range(copies)]
    cold_index = [0]

    def gguf_matmul() -> object:
        with np.errstate(all="ignore"):
            w = np.asarray(gguf.quants.dequantize(raw2d, qtype), dtype=np.float32)
        return x1 @ w.T

    def numpy_matmul() -> object:
        return x1 @ quant.dequantize(view, qtype, shape, compiled=False).T

    def fused_float() -> object:
        return fused.linear(view, qtype, shape, x1, out=out1)

    def fused_int8() -> object:
        fused.set_precision("int8")
        try:
            return fused.linear(view, qtype, shape, x1, out=out1)
        finally:
            fused.set_precision("float")

    def cold() -> object:
        cold_index[0] = (cold_index[0] + 1) % len(pool)
        return fused.linear(pool[cold_index[0]], qtype, shape, x1, out=out1)

    fns: dict[str, Callable[[], object]] = {
        "gguf": gguf_matmul,
        "numpy": numpy_matmul,
        "float": fused_float,
        "cold": cold,
    }
    if qtype in fused.int8_types():
        fns["int8"] = fused_int8
    for n in BATCHES:
        xn = rng.standard_normal((n, cols)).astype(np.float32)
        outn = np.empty((n, rows), np.float32)
        fns[f"batch{n}"] = lambda xn=xn, outn=outn: fused.linear(view, qtype, shape, xn, out=outn)
        fns[f"batch{n}_numpy"] = lambda xn=xn: xn @ quant.dequantize(view, qtype, shape, compiled=False).T
    dense = np.empty(shape, np.float32)
    fns["exact"] = lambda: quant.dequantize(view, qtype, shape, out=dense)
    fns["exact_numpy"] = lambda: quant.dequantize(view, qtype, shape, out=dense, compiled=False)
    return fns


def run_kernels(types: list[Q], rounds: int, calls: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    shapes = [(768, 2048), (2048, 768)]
    cases = {(q, s): bench_matrix(q, s, rng) for q in types for s in shapes}
    nbytes = {(q, s): make_tensor(q, s, np.random.default_rng(0)).nbytes for q in types for s in shapes}
    fused.warmup(types, kinds=["matvec", "matmat", "dequant", "matvec_int8"])
    for fns in cases.values():  # first calls: compile anything left, warm the caches
        for fn in fns.values():
            fn()
    rounds_out: list[dict[str, Any]] = []
    for r in range(rounds):
        for (qtype, shape), fns in cases.items():
            for name, fn in fns.items():  # interleaved: every method of every case in every round
                n = max(2, calls // 8) if name in ("gguf", "numpy") or name.endswith("_numpy") else calls
                seconds = median_time(fn, n)
                rounds_out.append(
                    {"round": r, "type": qtype.name, "shape": list(shape), "method": name, "seconds": seconds,
                     "weight_bytes": nbytes[(qtype, shape)]}
                )  # fmt: skip
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return rounds_out, summarize(rounds_out, types, shapes)


def summarize(rounds: list[dict[str, Any]], types: list[Q], shapes: list[tuple[int, int]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for qtype in types:
        for shape in shapes:
            rows = [x for x in rounds if x["type"] == qtype.name and x["shape"] == list(shape)]
            by_method: dict[str, list[float]] = {}
            for x in rows:
                by_method.setdefault(x["method"], []).append(x["seconds"])
            nbytes = rows[0]["weight_bytes"]
            per_round = dict(by_method.items())
            key = f"{qtype.name} {shape[0]}x{shape[1]}"
            entry: dict[str, Any] = {"weight_bytes": nbytes, "seconds": {m: summary(v) for m, v in per_round.items()}}
            entry["gbps"] = {m: summary([nbytes / t / 1e9 for t in v]) for m, v in per_round.items()}
            gguf_t = per_round["gguf"]
            for m in ("float", "int8"):
                if m in per_round:
                    entry[f"x_gguf_{m}"] = summary([g / t for g, t in zip(gguf_t, per_round[m], strict=True)])
                    if qtype in GGML_GBPS:
                        entry[f"x_ggml_{m}"] = summary([nbytes / t / 1e9 / GGML_GBPS[qtype] for t in per_round[m]])
            entry["x_numpy_float"] = summary(
                [a / b for a, b in zip(per_round["numpy"], per_round["float"], strict=True)]
            )
            for n in BATCHES:
                entry[f"batch{n}_speedup"] = summary(
                    [a / b for a, b in zip(per_round[f"batch{n}_numpy"], per_round[f"batch{n}"], strict=True)]
                )
            values = shape[0] * shape[1]
            entry["exact_gelems"] = summary([values / t / 1e9 for t in per_round["exact"]])
            entry["exact_speedup"] = summary(
                [a / b for a, b in zip(per_round["exact_numpy"], per_round["exact"], strict=True)]
            )
            result[key] = entry
    return result


def print_table(result: dict[str, Any]) -> None:
    print(
        "\nfused one-token kernels, 1 thread: GB/s of weight bytes, median (min-max) over rounds; "
        f"x gguf target >= {GGUF_TARGET:g}, x ggml target >= {GGML_TARGET:g}"
    )
    header = (
        f"{'type':<7} {'shape':>9} | {'float GB/s':>17} {'x gguf':>6} {'x ggml':>6} | {'int8 GB/s':>17} {'x gguf':>6} "
        f"{'x ggml':>6} | {'cold':>5} | {'x numpy':>7} | batch 4/16/64/256 x numpy | exact Gel/s (x numpy)"
    )
    print(header)
    print("-" * len(header))
    for key, e in result.items():
        qname, shape = key.split()

        def rng_(s: dict[str, float]) -> str:
            return f"{s['median']:5.2f} ({s['min']:4.1f}-{s['max']:4.1f})"

        def ratio(name: str, target: float, e: dict[str, Any] = e) -> str:
            if name not in e:
                return f"{'-':>6}"
            value = e[name]["median"]
            return f"{value:5.{1 if value >= 10 else 2}f}{' ' if value >= target else '!'}"

        int8 = rng_(e["gbps"]["int8"]) if "int8" in e["gbps"] else f"{'-':>17}"
        batches = "/".join(f"{e[f'batch{n}_speedup']['median']:.1f}" for n in BATCHES)
        print(
            f"{qname:<7} {shape:>9} | {rng_(e['gbps']['float'])} {ratio('x_gguf_float', GGUF_TARGET)} "
            f"{ratio('x_ggml_float', GGML_TARGET)} | {int8} {ratio('x_gguf_int8', GGUF_TARGET)} "
            f"{ratio('x_ggml_int8', GGML_TARGET)} | {e['gbps']['cold']['median']:5.2f} | "
            f"{e['x_numpy_float']['median']:7.1f} | {batches:>25} | {e['exact_gelems']['median']:5.2f} "
            f"({e['exact_speedup']['median']:.1f})"
        )
    print("('!': below the target; '-': no int8 kernel, or no ggml figure in docs/notes/KERNELS.md)")


COMPILE_PROBE = """
import json, sys, time
t0 = time.perf_counter()
from gguf import GGMLQuantizationType as Q
from aioexperts._compute import fused
types = [Q[name] for name in sys.argv[1].split(",")]
t1 = time.perf_counter()
report = fused.warmup(types)
print(json.dumps({"import_s": t1 - t0, "warmup_s": report.seconds, "total_s": time.perf_counter() - t0,
                  "loaded": report.loaded, "compiled": report.compiled, "kernels": len(report.kernels)},
                 allow_nan=False))
"""

COMPILE_SETS = {
    "built-in model (Q4_K, F32)": "Q4_K,F32",
    "Q4_K_M model (Q4_K, Q6_K, F32)": "Q4_K,Q6_K,F32",
    "all 15 compiled types": ",".join(t.name for t in sorted(fused.compiled_types(), key=lambda t: t.name)),
}


def run_compile(rounds: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOEXPERTS_", "NUMBA_"))}
    for r in range(rounds):
        for label, names in COMPILE_SETS.items():
            with tempfile.TemporaryDirectory() as cache:
                for phase in ("cold", "warm"):
                    proc = subprocess.run(
                        [sys.executable, "-c", COMPILE_PROBE, names],
                        env={**env, "AIOEXPERTS_CACHE": cache},
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    figures = json.loads(proc.stdout.strip().splitlines()[-1])
                    rows.append({"round": r, "set": label, "phase": phase, **figures})
                    print(f"compile round {r} {label} {phase}: {figures['total_s']:.1f} s", file=sys.stderr)
    result: dict[str, Any] = {}
    for label in COMPILE_SETS:
        for phase in ("cold", "warm"):
            sel = [x for x in rows if x["set"] == label and x["phase"] == phase]
            result[f"{label} {phase}"] = {
                "total_s": summary([x["total_s"] for x in sel]),
                "warmup_s": summary([x["warmup_s"] for x in sel]),
                "kernels": sel[0]["kernels"],
                "compiled": sel[0]["compiled"],
                "loaded": sel[0]["loaded"],
            }
    return rows, result


def print_compile(result: dict[str, Any]) -> None:
    print("\nfirst use in a fresh process (import + warmup), median (min-max) seconds over rounds")
    for key, e in result.items():
        target = COMPILE_TARGET_S if key.endswith("cold") else WARM_TARGET_S
        t = e["total_s"]
        met = "met" if t["median"] <= target else "missed"
        verdict = f"target <= {target:g} s: {met}" if "model" in key else "(not a model: for information)"
        print(
            f"  {key:<42} {t['median']:6.2f} ({t['min']:.2f}-{t['max']:.2f}) s; {e['kernels']} kernels, "
            f"{e['compiled']} compiled, {e['loaded']} loaded; {verdict}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=24, help="calls per timing (median kept)")
    parser.add_argument("--types", default="", help="comma-separated ggml type names (default: all compiled types)")
    parser.add_argument("--compile-rounds", type=int, default=2)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.time()
    types = [Q[n.strip().upper()] for n in args.types.split(",") if n.strip()] or [
        t for t in ORDER if t in fused.compiled_types()
    ]
    assert fused.backend().name == "numba", fused.backend().reason
    with threadpool_limits(limits=1):
        rounds, result = run_kernels(types, args.rounds, args.calls, args.seed)
    print_table(result)
    compile_rows: list[dict[str, Any]] = []
    compile_result: dict[str, Any] = {}
    if not args.skip_compile:
        compile_rows, compile_result = run_compile(args.compile_rounds)
        print_compile(compile_result)
    out = write_results(
        args.out,
        "kernels",
        {"types": [t.name for t in types], "rounds": args.rounds, "calls": args.calls, "threads": 1,
         "shapes": [[768, 2048], [2048, 768]], "cold_bytes": COLD_BYTES, "batches": list(BATCHES),
         "ggml_gbps_1_thread": {t.name: v for t, v in GGML_GBPS.items()},
         "targets": {"x_gguf": GGUF_TARGET, "x_ggml": GGML_TARGET, "cold_compile_s": COMPILE_TARGET_S,
                     "warm_start_s": WARM_TARGET_S}},
        {"seconds": "median seconds per call within a round", "gbps": "1e9 weight bytes per second",
         "exact_gelems": "1e9 float32 values per second", "x_*": "ratio of speeds (higher is faster)"},
        rounds + [{"compile": True, **x} for x in compile_rows],
        {"kernels": result, "compile": compile_result},
        started,
    )  # fmt: skip
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
