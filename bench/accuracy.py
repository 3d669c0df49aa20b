"""Accuracy against llama.cpp: every fixture's MoE layers through the runner, float and int8 precision.

    .venv/bin/python bench/accuracy.py [--fixtures DIR] [--out PATH]

For every ``*.gguf`` of the llama.cpp-made fixtures (``--fixtures``, else ``$AIOEXPERTS_FIXTURES``,
else ``../shared/fixtures`` beside the checkout; its ``more-archs/`` folder included), each MoE layer
that has a golden runs through ``aioexperts.open`` + ``MoERunner.moe_result`` on the golden's MoE
input (``moe_in-L``, 16 tokens; the last layer holds only the last token), once per precision of the
one-token kernels (``fused.set_precision``: ``float``, the default, and ``int8``, which quantizes
``x`` as llama.cpp's CPU backend does). Per fixture, layer and precision it records:

* ``ids_exact``: the selected experts equal llama.cpp's ``topk-L``, same order;
* ``weights_max_abs``: the largest absolute difference of the routing weights to ``weights-L``;
* ``moe_out_rel_l2`` and ``shared_out_rel_l2`` (where the model has a shared expert):
  ``||ours - golden|| / ||golden||`` in float64, against ``moe_out-L`` and ``shared_out-L``.

The summary keeps, per fixture and precision, the worst over its layers, and whether the
architecture's routing rules are verified against llama.cpp (``store.hparams.verified``). It takes
about a minute (kernels compile on first use). Every row goes to ``accuracy-results.json``
(``--out``; the committed copy the docs are rendered from: ``docs/results/accuracy.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _results import write_results  # bench/_results.py, a sibling module

import aioexperts
from aioexperts._compute import fused

PRECISIONS = ("float", "int8")


def fixtures_dir(given: Path | None) -> Path:
    """``--fixtures``, else ``$AIOEXPERTS_FIXTURES``, else ``../shared/fixtures`` beside the checkout.

    Raises:
        SystemExit: none of them holds a ``*.gguf``.
    """
    repo = Path(__file__).resolve().parents[1]
    env = os.environ.get("AIOEXPERTS_FIXTURES")
    candidates = [given] if given else [*([Path(env)] if env else []), repo.parent / "shared" / "fixtures"]
    for cand in candidates:
        if cand is not None and cand.is_dir() and any(cand.rglob("*.gguf")):
            return cand
    raise SystemExit(
        "no fixtures: no *.gguf in " + " or ".join(map(str, candidates)) + " (set $AIOEXPERTS_FIXTURES or --fixtures)"
    )


def _rel_l2(ours: np.ndarray, golden: np.ndarray) -> float:
    golden64 = golden.astype(np.float64)
    return float(np.linalg.norm(ours.astype(np.float64) - golden64) / np.linalg.norm(golden64))


async def measure(path: Path, precision: str) -> tuple[bool, list[dict[str, Any]]]:
    """Every MoE layer of ``path`` that has a golden, at ``precision``: ``(verified, rows)``."""
    fused.set_precision(precision)  # type: ignore[arg-type]
    gold = np.load(path.with_name(path.name.removesuffix(".gguf") + ".golden.npz"))
    rows = []
    async with aioexperts.open(path, slots=16) as store:
        runner = aioexperts.MoERunner(store)
        for layer in store.layout.layers:
            if f"moe_out-{layer}" not in gold:
                continue

            def g(key: str, layer: int = layer) -> np.ndarray:
                return np.atleast_2d(gold[f"{key}-{layer}"])

            r = await runner.moe_result(layer, g("moe_in").astype(np.float32))
            row: dict[str, Any] = {
                "layer": layer,
                "tokens": int(g("moe_in").shape[0]),
                "ids_exact": bool(np.array_equal(r.ids, g("topk"))),
                "weights_max_abs": float(np.abs(r.weights - g("weights")).max()),
                "moe_out_rel_l2": _rel_l2(r.moe_out, g("moe_out")),
                "shared_out_rel_l2": None,
            }
            if r.shared_out is not None and f"shared_out-{layer}" in gold:
                row["shared_out_rel_l2"] = _rel_l2(r.shared_out, g("shared_out"))
            rows.append(row)
        verified = bool(store.hparams.verified)
    return verified, rows


def _worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    shared = [r["shared_out_rel_l2"] for r in rows if r["shared_out_rel_l2"] is not None]
    return {
        "ids_exact": all(r["ids_exact"] for r in rows),
        "weights_max_abs": max(r["weights_max_abs"] for r in rows),
        "moe_out_rel_l2": max(r["moe_out_rel_l2"] for r in rows),
        "shared_out_rel_l2": max(shared) if shared else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixtures", type=Path, help="the fixtures folder (default: $AIOEXPERTS_FIXTURES, else "
                        "../shared/fixtures beside the checkout)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="results file (default: accuracy-results.json here)")
    args = parser.parse_args(argv)
    root = fixtures_dir(args.fixtures)
    paths = sorted(root.glob("*.gguf")) + sorted(root.glob("more-archs/*.gguf"))
    started = time.time()
    rounds: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    try:
        for path in paths:
            entry: dict[str, Any] = {"folder": str(path.parent.relative_to(root)) if path.parent != root else ""}
            for precision in PRECISIONS:
                verified, rows = asyncio.run(measure(path, precision))
                rounds += [{"fixture": path.stem, "precision": precision, **row} for row in rows]
                entry["verified"] = verified
                entry["layers"] = [row["layer"] for row in rows]
                entry[precision] = _worst(rows)
            summary[path.stem] = entry
            print(
                f"{path.stem:20} verified {'yes' if entry['verified'] else 'no ':3} layers {entry['layers']}: "
                + ", ".join(
                    f"{p} ids {'exact' if entry[p]['ids_exact'] else 'DIFFER'} moe_out {entry[p]['moe_out_rel_l2']:.1e}"
                    for p in PRECISIONS
                ),
                flush=True,
            )
    finally:
        fused.set_precision(None)
    out = write_results(
        args.out,
        "accuracy",
        {
            "fixtures": os.fspath(root),
            "fixture_files": [str(p.relative_to(root)) for p in paths],
            "precisions": list(PRECISIONS),
            "kernels": fused.backend().name,
            "path": "aioexperts.open(path, slots=16) + MoERunner.moe_result(layer, moe_in)",
        },
        {
            "moe_out_rel_l2": "||ours - golden||_2 / ||golden||_2 in float64 over every token of the layer",
            "shared_out_rel_l2": "the same for the shared expert's output (None: no shared expert)",
            "weights_max_abs": "largest absolute difference of the routing weights",
            "ids_exact": "selected expert ids equal llama.cpp's, same order",
        },
        rounds,
        summary,
        started,
    )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
