"""Benchmark aioexperts' dequantization kernels against gguf-py's ``gguf.quants.dequantize``.

For each type with a fast kernel, builds one realistic expert projection (Qwen3-30B-A3B sizes:
gate/up ``(768, 2048)``, down ``(2048, 768)``): ``gguf.quants.quantize`` of N(0, 0.02) weights where
gguf-py can quantize the type, else random bytes whose f16 scale fields hold sane values. Then times,
in the same run, each after one warm-up call, best of ``--repeat`` consecutive calls:

* ``ref rows``: ``gguf.quants.dequantize`` on the ``(rows, row_bytes)`` array, the way
  ``GGUFReader`` hands tensors out (gguf-py then works 16 rows at a time, its fast path);
* ``ref flat``: the same on the flat byte array, as the previous placeholder body of
  ``aioexperts._format.dequant.dequantize`` called it;
* ``ours``: :func:`aioexperts._format.dequant.dequantize` on a read-only memoryview, new output;
* ``ours out=``: the same writing into a preallocated array.

The speed-ups are ``ref / ours``; GB/s is float32 output bytes per second of ``ours``. ``exact``
checks the outputs bit for bit (NaN positions included). gguf-py's timings depend on glibc malloc's
state (its temporaries straddle the dynamic mmap threshold, so they are either recycled heap or
fresh page-faulting mmaps): the ref columns, ``ref flat`` most, can differ by 2-3x between runs.
An 8 MiB array is allocated and freed first (``--no-warm`` skips it) to start from the steady state
of a process that has already freed large arrays.

Usage: ``python bench/dequant.py [--repeat N] [--json] [--shapes 768x2048,2048x768] [--types ...]``
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioexperts._format.dequant import dequantize, supported_types
from aioexperts_bench import dumps_json

Q = GGMLQuantizationType

#: types gguf-py can quantize: realistic blocks from N(0, 0.02) weights
QUANTIZABLE = {Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4}
#: the others: random bytes, with these f16 scale fields (byte offsets in a block) made sane
SCALE_FIELDS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
ORDER = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
    Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
]  # fmt: skip


def make_tensor(qtype: GGMLQuantizationType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """The ggml bytes of one ``shape`` tensor of ``qtype``, as ``(rows, row_bytes)`` uint8."""
    rows, cols = shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = cols // block_size * type_size
    weights = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    if qtype == Q.F32:
        return weights.view(np.uint8).reshape(rows, row_bytes)
    if qtype in QUANTIZABLE:
        quantized = np.ascontiguousarray(gguf.quants.quantize(weights, qtype))
        return quantized.view(np.uint8).reshape(rows, row_bytes)
    raw = rng.integers(0, 256, rows * row_bytes, dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in SCALE_FIELDS[qtype]:
        scales = rng.uniform(2e-4, 2e-3, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, row_bytes)


def bit_exact(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.asarray(a, dtype=np.float32).reshape(-1)
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    nan = np.isnan(b)
    return bool((np.isnan(a) == nan).all() and (a.view(np.uint32)[~nan] == b.view(np.uint32)[~nan]).all())


def bench_type(qtype: GGMLQuantizationType, shape: tuple[int, int], repeat: int, rng: np.random.Generator) -> dict:
    rows_bytes = make_tensor(qtype, shape, rng)
    flat_bytes = rows_bytes.reshape(-1)
    view = memoryview(flat_bytes).toreadonly()
    out = np.empty(shape, dtype=np.float32)

    def ref_rows() -> np.ndarray:
        with np.errstate(all="ignore"):
            return gguf.quants.dequantize(rows_bytes, qtype)

    def ref_flat() -> np.ndarray:
        with np.errstate(all="ignore"):
            return gguf.quants.dequantize(flat_bytes, qtype)

    def ours() -> np.ndarray:
        return dequantize(view, qtype, shape, compiled=False)

    def ours_out() -> np.ndarray:
        return dequantize(view, qtype, shape, out=out, compiled=False)

    fns: dict[str, Callable[[], np.ndarray]] = {
        "ref_rows": ref_rows,
        "ref_flat": ref_flat,
        "ours": ours,
        "ours_out": ours_out,
    }
    exact = bit_exact(ours(), np.asarray(ref_rows()).reshape(shape)) and bit_exact(ours_out(), ref_flat())
    best = {}
    for name, fn in fns.items():  # each in its own loop: interleaving them mixes malloc states
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    n_values = shape[0] * shape[1]
    return {
        "type": qtype.name,
        "shape": list(shape),
        "mb_in": rows_bytes.nbytes / 1e6,
        "ms_ref_rows": best["ref_rows"] * 1e3,
        "ms_ref_flat": best["ref_flat"] * 1e3,
        "ms_ours": best["ours"] * 1e3,
        "ms_ours_out": best["ours_out"] * 1e3,
        "speedup_rows": best["ref_rows"] / best["ours"],
        "speedup_flat": best["ref_flat"] / best["ours"],
        "gb_per_s_out": n_values * 4 / best["ours"] / 1e9,
        "exact": exact,
    }


def format_table(results: list[dict]) -> str:
    header = (
        f"{'type':<7} {'shape':>10} {'MB in':>6} {'ref rows':>9} {'ref flat':>9} {'ours':>7} "
        f"{'ours out=':>9} {'x rows':>7} {'x flat':>7} {'GB/s out':>8}  exact"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = r["speedup_rows"]
        lines.append(
            f"{r['type']:<7} {'x'.join(map(str, r['shape'])):>10} {r['mb_in']:6.2f} "
            f"{r['ms_ref_rows']:9.3f} {r['ms_ref_flat']:9.3f} {r['ms_ours']:7.3f} {r['ms_ours_out']:9.3f} "
            f"{ratio:7.1f} {r['speedup_flat']:7.1f} {r['gb_per_s_out']:8.1f}  {'yes' if r['exact'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions, best is kept (10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--shapes", default="768x2048,2048x768", help="comma-separated ROWSxCOLS (768x2048,2048x768)")
    parser.add_argument("--types", default="", help="comma-separated ggml type names (all with a kernel)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-warm", action="store_true", help="skip the 8 MiB malloc warm-up")
    args = parser.parse_args(argv)

    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
    types = [Q[name.strip().upper()] for name in args.types.split(",") if name.strip()] or [
        t for t in ORDER if t in supported_types()
    ]
    rng = np.random.default_rng(args.seed)
    if not args.no_warm:
        warm = np.empty(8 << 20, dtype=np.uint8)
        warm.fill(0)
        del warm

    started = time.perf_counter()
    results = [
        bench_type(qtype, shape, max(1, args.repeat), rng)  # type: ignore[arg-type]
        for shape in shapes
        for qtype in types
    ]
    elapsed = time.perf_counter() - started
    if args.json:
        meta = {"numpy": np.__version__, "python": platform.python_version(), "repeat": args.repeat}
        print(dumps_json({**meta, "results": results}, indent=1))
    else:
        print(
            f"dequantize, best of {args.repeat}, numpy {np.__version__}, python {platform.python_version()}, "
            f"{platform.machine()}; ms per tensor; x = ref / ours"
        )
        print(format_table(results))
        print(f"({elapsed:.1f} s)")
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
