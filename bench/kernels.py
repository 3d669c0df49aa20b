"""The compute kernels on one expert matrix, one thread: fused decode against gguf-py and ggml.

    python bench/kernels.py [--rounds 5] [--types Q4_K,Q6_K] [--skip-compile] [--no-ggml] [--out PATH]

For every type with a compiled kernel, on Qwen3-30B-A3B expert matrices (gate/up ``768 x 2048``,
down ``2048 x 768``; ``gguf.quants.quantize`` of N(0, 0.02) weights where gguf-py can quantize the
type, else random bytes with sane scales, as ``bench/dequant.py``), one thread (BLAS capped to one
thread too), interleaved rounds, median of ``--calls`` calls per round:

* ``gguf``: ``gguf.quants.dequantize`` + matmul, the baseline of the ">= 20x" target;
* ``numpy``: the project's numpy kernels (``aioexperts._format.dequant.dequantize``) + matmul;
* ``float``: ``fused.linear`` with one token, the default (fused decode-and-dot);
* ``ggml``: ggml's own CPU mat-vec (``ggml_mul_mat`` of the same bytes by the same token, one
  thread) through llama-cpp-python's ``libggml`` (``aioexperts_bench.ggml_baseline``), when the
  ``baseline`` extra is installed; its output is checked against ``float`` first;
* ``int8``: the same with ``set_precision("int8")`` (x quantized like llama.cpp);
* ``cold``: the float kernel sweeping 96 MiB of copies of the matrix (weights not in any cache);
* ``batch n``: ``fused.linear`` with ``n`` tokens (blocked kernel; dequantize + BLAS above 64)
  against the numpy kernels + matmul;
* ``exact``: compiled exact dequantization, values per second, against the numpy kernels.

GB/s are weight bytes (ggml block bytes) per second. ``x ggml``: ggml's time over ours in the same
round (the speed as a fraction of llama.cpp's own one-thread kernel), target >= 0.7 (issue 20:
uncapped decode at 0.5x llama.cpp); "unmeasured" without the baseline extra (or with
``--no-ggml``), never a figure from elsewhere. Then (unless
``--skip-compile``) the compile cost in fresh processes: cold (empty cache) and warm, for the built-in
model's types, a Q4_K_M model's types and all 15 compiled types; targets: cold <= 30 s, warm <= 2 s.
Every round goes to ``kernels-results.json`` (``--out``; the committed copy: ``docs/results/kernels.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from _results import median_time, summary, write_results
from dequant import ORDER, make_tensor
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from aioexperts._compute import fused
from aioexperts._format import dequant as quant
from aioexperts_bench import ggml_baseline

Q = GGMLQuantizationType

GGUF_TARGET = 20.0
GGML_TARGET = 0.7
COLD_BYTES = 96 << 20
SHAPES = ((768, 2048), (2048, 768))
BATCHES = (4, 16, 64, 256)
COMPILE_TARGET_S = 30.0
WARM_TARGET_S = 2.0


def bench_matrix(
    qtype: Q,
    shape: tuple[int, int],
    rng: np.random.Generator,
    ggml: ggml_baseline.GgmlLibrary | None = None,
    cold_bytes: int = COLD_BYTES,
) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """The timed callables of one type and shape (each returns after one product).

    With ``ggml``, also ggml's mat-vec of the same bytes and token, checked first against the
    float kernel (``BaselineMismatchError`` beyond the tolerance of ggml's rounding of ``x``);
    the second value then holds the relative errors of that check (else it is empty).
    """
    rows, cols = shape
    raw2d = make_tensor(qtype, shape, rng)
    raw = raw2d.reshape(-1)
    view = memoryview(raw).toreadonly()
    x1 = rng.standard_normal((1, cols)).astype(np.float32)
    out1 = np.empty((1, rows), np.float32)
    copies = max(2, cold_bytes // raw.nbytes)
    pool = [memoryview(raw.copy()).toreadonly() for _ in range(copies)]
    cold_index = [0]

    def gguf_matmul() -> object:
        with np.errstate(all="ignore"):
            w = np.asarray(gguf.quants.dequantize(raw2d, qtype), dtype=np.float32)
        return x1 @ w.T

    def numpy_matmul() -> object:
        return x1 @ quant.dequantize(view, qtype, shape, compiled=False).T

    def fused_float() -> object:
        fused.set_precision("float")
        try:
            return fused.linear(view, qtype, shape, x1, out=out1)
        finally:
            fused.set_precision(None)

    def fused_int8() -> object:
        fused.set_precision("int8")
        try:
            return fused.linear(view, qtype, shape, x1, out=out1)
        finally:
            fused.set_precision(None)

    def cold() -> object:
        cold_index[0] = (cold_index[0] + 1) % len(pool)
        return fused.linear(pool[cold_index[0]], qtype, shape, x1, out=out1)

    fns: dict[str, Callable[[], object]] = {
        "gguf": gguf_matmul,
        "numpy": numpy_matmul,
        "float": fused_float,
    }
    agreement: dict[str, float] = {}
    if ggml is not None:
        matvec = ggml_baseline.GgmlMatVec(raw, qtype, shape, library=ggml)
        reference = np.array(fused_float(), copy=True)
        got = matvec(x1)
        agreement["vs_float"] = ggml_baseline.check_agreement(got, reference, qtype)
        agreement["tolerance"] = ggml_baseline.agreement_tolerance(qtype)
        if qtype in fused.int8_types():
            agreement["vs_int8"] = ggml_baseline.relative_error(got, fused_int8())
        matvec.set_input(x1)
        fns["ggml"] = matvec.compute
    fns["cold"] = cold
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
    return fns, agreement


def run_kernels(
    types: list[Q],
    rounds: int,
    calls: int,
    seed: int,
    *,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    ggml: ggml_baseline.GgmlLibrary | None = None,
    cold_bytes: int = COLD_BYTES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every round of every method on every type and shape, and their summary (``ggml``: time it too)."""
    rng = np.random.default_rng(seed)
    cases: dict[tuple[Q, tuple[int, int]], dict[str, Callable[[], object]]] = {}
    agreement: dict[str, dict[str, float]] = {}
    for q in types:
        for s in shapes:
            cases[(q, s)], agreed = bench_matrix(q, s, rng, ggml, cold_bytes)
            if agreed:
                agreement[f"{q.name} {s[0]}x{s[1]}"] = agreed
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
    result = summarize(rounds_out, types, shapes)
    for key, agreed in agreement.items():
        result[key]["ggml_agreement"] = agreed
    return rounds_out, result


def summarize(
    rounds: list[dict[str, Any]], types: list[Q], shapes: tuple[tuple[int, int], ...] | list[tuple[int, int]]
) -> dict[str, Any]:
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
                    if "ggml" in per_round:  # ggml's time over ours, round by round
                        entry[f"x_ggml_{m}"] = summary(
                            [g / t for g, t in zip(per_round["ggml"], per_round[m], strict=True)]
                        )
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


def ggml_baseline_for_run(enabled: bool = True) -> tuple[ggml_baseline.GgmlLibrary | None, dict[str, Any]]:
    """ggml's library if it is to be timed, and what the results file records about it."""
    if not enabled:
        return None, {"measured": False, "reason": "--no-ggml given"}
    reason = ggml_baseline.unavailable_reason()
    if reason is not None:
        return None, {"measured": False, "reason": reason}
    lib = ggml_baseline.load()
    return lib, {
        "measured": True,
        "llama_cpp_python": lib.version,
        "libraries": [str(p) for p in lib.paths],
        "cpu_features": lib.features,
        "threads": 1,
        "how": "ggml_mul_mat(W, x) graph, ggml_graph_compute_with_ctx, plain CPU memory, same bytes and x",
    }


def print_table(result: dict[str, Any], ggml_info: dict[str, Any]) -> None:
    measured = ggml_info.get("measured", False)
    print(
        "\nfused one-token kernels, 1 thread: GB/s of weight bytes, median (min-max) over rounds; "
        f"x gguf target >= {GGUF_TARGET:g}, x ggml (ggml's time / ours, same round) target >= {GGML_TARGET:g}"
    )
    if not measured:
        print(f"x ggml unmeasured: {ggml_info.get('reason', 'no ggml baseline')}")
    header = (
        f"{'type':<7} {'shape':>9} | {'float GB/s':>17} {'x gguf':>6} {'x ggml':>10} | {'int8 GB/s':>17} "
        f"{'x gguf':>6} {'x ggml':>10} | {'ggml GB/s':>9} | {'cold':>5} | {'x numpy':>7} | "
        "batch 4/16/64/256 x numpy | exact Gel/s (x numpy)"
    )
    print(header)
    print("-" * len(header))
    for key, e in result.items():
        qname, shape = key.split()

        def rng_(s: dict[str, float]) -> str:
            return f"{s['median']:5.2f} ({s['min']:4.1f}-{s['max']:4.1f})"

        def ratio(name: str, target: float, e: dict[str, Any] = e, width: int = 6) -> str:
            if name not in e:
                unmeasured = name.startswith("x_ggml") and not measured and name.rsplit("_", 1)[1] in e["gbps"]
                return f"{'unmeasured' if unmeasured else '-':>{width}}"
            value = e[name]["median"]
            return f"{value:{width - 1}.{1 if value >= 10 else 2}f}{' ' if value >= target else '!'}"

        int8 = rng_(e["gbps"]["int8"]) if "int8" in e["gbps"] else f"{'-':>17}"
        batches = "/".join(f"{e[f'batch{n}_speedup']['median']:.1f}" for n in BATCHES)
        ggml_gbps = f"{e['gbps']['ggml']['median']:9.2f}" if "ggml" in e["gbps"] else f"{'-':>9}"
        print(
            f"{qname:<7} {shape:>9} | {rng_(e['gbps']['float'])} {ratio('x_gguf_float', GGUF_TARGET)} "
            f"{ratio('x_ggml_float', GGML_TARGET, width=10)} | {int8} {ratio('x_gguf_int8', GGUF_TARGET)} "
            f"{ratio('x_ggml_int8', GGML_TARGET, width=10)} | {ggml_gbps} | {e['gbps']['cold']['median']:5.2f} | "
            f"{e['x_numpy_float']['median']:7.1f} | {batches:>25} | {e['exact_gelems']['median']:5.2f} "
            f"({e['exact_speedup']['median']:.1f})"
        )
    print("('!': below the target; '-': no int8 kernel)")


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
    parser.add_argument("--no-ggml", action="store_true", help="do not time ggml (x ggml: unmeasured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.time()
    load_start = os.getloadavg()
    types = [Q[n.strip().upper()] for n in args.types.split(",") if n.strip()] or [
        t for t in ORDER if t in fused.compiled_types()
    ]
    assert fused.backend().name == "numba", fused.backend().reason
    ggml, ggml_info = ggml_baseline_for_run(not args.no_ggml)
    with threadpool_limits(limits=1):
        rounds, result = run_kernels(types, args.rounds, args.calls, args.seed, ggml=ggml)
    print_table(result, ggml_info)

    def save(compile_rows: list[dict[str, Any]], compile_result: dict[str, Any]) -> Path:
        return write_results(
            args.out,
            "kernels",
            {"types": [t.name for t in types], "rounds": args.rounds, "calls": args.calls, "threads": 1,
             "shapes": [list(s) for s in SHAPES], "cold_bytes": COLD_BYTES, "batches": list(BATCHES),
             "ggml": ggml_info, "compile_rounds": 0 if args.skip_compile else args.compile_rounds,
             "targets": {"x_gguf": GGUF_TARGET, "x_ggml": GGML_TARGET, "cold_compile_s": COMPILE_TARGET_S,
                         "warm_start_s": WARM_TARGET_S}},
            {"seconds": "median seconds per call within a round", "gbps": "1e9 weight bytes per second",
             "exact_gelems": "1e9 float32 values per second", "x_*": "ratio of speeds (higher is faster)"},
            rounds + [{"compile": True, **x} for x in compile_rows],
            {"kernels": result, "compile": compile_result},
            started,
            machine={"load_average_start": load_start},
        )  # fmt: skip

    out = save([], {})  # the kernel rounds are kept even if the compile runs are cut short
    if not args.skip_compile:
        compile_rows, compile_result = run_compile(args.compile_rounds)
        print_compile(compile_result)
        out = save(compile_rows, compile_result)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
