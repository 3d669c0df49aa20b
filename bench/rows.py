"""Row reads of a huge table: rows per second and bytes read per useful byte, at 1, 48 and 512 rows per call.

The source design reads 48 rows of 84 bytes (one ``Q2_K`` block each) per token from a table of
tens of GiB. This bench builds (once, cached) a model with such a table (8 Mi rows of 256 ``Q2_K``
values: 84 bytes a row, 672 MiB), then, in rotated rounds, reads uniformly random rows through
``ExpertStore.read_rows(..., dequantize=False)`` with a fresh store per run (cold row cache;
``O_DIRECT``), ``--calls`` calls per run, and reports the median rows/s with its range and the
bytes read per useful byte (a row shares its 4 KiB window with 47 others it does not need).

    python bench/rows.py --rounds 5 --json rows-results.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from _results import machine_facts, refuse_foreign  # bench/_results.py, a sibling module

import aioexperts
from aioexperts.testing import cache_dir, tiny_moe_writer
from aioexperts_bench import dumps_json

N_ROWS = 8 << 20
N_COLS = 256
TABLE = "engram.weight"
PER_CALL = (1, 48, 512)


def build(path: Path) -> None:
    """A tiny MoE model plus the table, its rows random ``Q2_K`` blocks, written in chunks."""
    tmp = path.with_suffix(f".{os.getpid()}.partial")
    rng = np.random.default_rng(0)
    w = tiny_moe_writer(tmp, rng)
    row_bytes = 84
    w.add_tensor_info(
        TABLE, (N_ROWS, row_bytes), np.dtype(np.uint8), N_ROWS * row_bytes, gguf.GGMLQuantizationType.Q2_K
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in list(w.tensors[0].values())[:4]:
        w.write_tensor_data(t.tensor)
    chunk = 1 << 20
    assert w.fout is not None
    f = w.fout[0]
    w.write_padding(f, f.tell())
    for start in range(0, N_ROWS, chunk):
        f.write(rng.integers(0, 256, (min(chunk, N_ROWS - start), row_bytes), dtype=np.uint8).tobytes())
    w.close()
    os.replace(tmp, path)


async def run(path: Path, per_call: int, calls: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    async with aioexperts.open(path, slots=2, io=aioexperts.IOOptions(backend="io_uring")) as store:
        t0 = time.perf_counter()
        for _ in range(calls):
            await store.read_rows(TABLE, rng.integers(0, N_ROWS, per_call).tolist(), dequantize=False)
        seconds = time.perf_counter() - t0
        st = store.row_statistics()
        assert st is not None and store.statistics().direct_io
    return {
        "seconds": seconds,
        "rows_per_s": per_call * calls / seconds,
        "bytes_read": st.bytes_read,
        "useful_bytes": st.useful_bytes,
        "bytes_per_useful_byte": st.bytes_read_per_useful_byte,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="read_rows calls per run")
    parser.add_argument("--json", type=Path, default=Path("rows-results.json"))
    args = parser.parse_args()
    path = cache_dir() / "rows-bench-q2_k-8m-v1.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} once (672 MiB)", file=sys.stderr)
        build(path)
    rounds = []
    for r in range(args.rounds):
        order = PER_CALL[r % 3 :] + PER_CALL[: r % 3]
        rounds.append({str(n): asyncio.run(run(path, n, args.calls, seed=1000 * r + n)) for n in order})
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n}: {v['rows_per_s']:.0f} rows/s" for n, v in rounds[-1].items()),
            file=sys.stderr,
        )
    summary = {}
    for n in PER_CALL:
        rate = [row[str(n)]["rows_per_s"] for row in rounds]
        waste = [row[str(n)]["bytes_per_useful_byte"] for row in rounds]
        summary[str(n)] = {
            "rows_per_s_median": statistics.median(rate),
            "rows_per_s_min": min(rate),
            "rows_per_s_max": max(rate),
            "bytes_per_useful_byte_median": statistics.median(waste),
        }
        print(
            f"{n:4d} rows/call: {statistics.median(rate):10.0f} rows/s ({min(rate):.0f}-{max(rate):.0f}),"
            f" {statistics.median(waste):.1f} bytes read per useful byte"
        )
    refuse_foreign(args.json).write_text(
        dumps_json(
            {
                "aioexperts": aioexperts.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine_facts(),
                "parameters": {"rounds": args.rounds, "calls": args.calls, "n_rows": N_ROWS, "row_bytes": 84},
                "units": {"rate": "rows per second", "time": "seconds", "bytes": "bytes"},
                "rounds": rounds,
                "summary": summary,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
