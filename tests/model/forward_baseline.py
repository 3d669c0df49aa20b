"""Every forward route's numbers, saved once and compared after a restructuring (issue 32).

``python tests/model/forward_baseline.py`` (from the checkout, with the shared fixtures found as in
``tests/conftest.py``) writes ``tests/data/forward-baseline-<cpu>.npz``: for every shared fixture
that :func:`aioexperts.load` runs, the prefill logits of its prompt, the logits of the same prompt
token by token (the one-sequence decode step), its greedy continuation, three sequences decoding at
once (the batched decode step) and the 64 greedy tokens of the built-in model at its test size. The
kernels' sums differ between CPU kinds (AVX-512 groups rows by 4, AVX2 by 3), so each CPU kind has
its own file.

The AVX2 file can be written on an AVX-512 machine: numba compiling for ``znver2`` with the host's
features less every ``avx512*``, ``gfni``, ``vaes``, ``vpclmulqdq`` and ``avxvnni*``
(``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``), numpy without its AVX-512 loops
(``NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"``), OpenBLAS's Haswell kernels
(``OPENBLAS_CORETYPE=Zen``) and a kernel cache of its own (``AIOEXPERTS_CACHE``); the script then
writes ``-avx512`` (the CPU's flags), renamed to ``-avx2``. Checked on an AMD Zen 4: the committed
AVX2 file of 2026-12-05 was reproduced bit for bit this way before it was rewritten.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np

import aioexperts

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
THREADS = aioexperts.IOOptions(backend="threads")
N_CONTINUE = 8


def cpu_kind() -> str:
    """``avx512`` where the CPU has AVX-512F, else ``avx2``."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return "avx512" if " avx512f" in flags else "avx2"


def baseline_path() -> Path:
    return DATA / f"forward-baseline-{cpu_kind()}.npz"


async def fixture_numbers(path: Path) -> dict[str, np.ndarray]:
    """The numbers of every route for the shared fixture ``path`` (its forward.npz prompt)."""
    tokens = np.load(path.with_name(path.stem + ".forward.npz"))["tokens"].tolist()
    out: dict[str, np.ndarray] = {}
    async with aioexperts.load(path, slots=8, io=THREADS, n_ctx=64) as model:
        out["prefill"] = await model.logits(tokens)
        async with model.sequence() as seq:
            out["decode"] = np.concatenate([await seq.forward([t]) for t in tokens])
        out["greedy"] = np.array([t async for t in model.generate(tokens, max_tokens=N_CONTINUE)], dtype=np.int64)
        prompts = [tokens[:4], tokens[4:9], tokens[9:12]]

        async def one(p: list[int]) -> list[int]:
            return [t async for t in model.generate(p, max_tokens=N_CONTINUE)]

        together = await asyncio.gather(*(one(p) for p in prompts))
        out["together"] = np.array(together, dtype=np.int64)
    return out


async def builtin_numbers(path: Path) -> dict[str, np.ndarray]:
    """64 greedy tokens of the built-in model (test size) from a fixed prompt."""
    async with aioexperts.load(path, slots=8, io=THREADS, n_ctx=128) as model:
        got = [t async for t in model.generate([1, 2, 3, 4, 5], max_tokens=64)]
    return {"greedy": np.array(got, dtype=np.int64)}


def fixtures() -> list[Path]:
    sys.path.insert(0, str(HERE.parent))
    from conftest import shared_fixture_paths

    out = []
    for p in shared_fixture_paths():
        if not p.with_name(p.stem + ".forward.npz").exists():
            continue
        if aioexperts.open_model(p).architecture in {"deepseek4", "qwen35moe"}:
            continue  # load() refuses these (issue 34)
        out.append(p)
    return out


def write_builtin(tmp: Path) -> Path:
    sys.path.insert(0, str(HERE.parent))
    from conftest import TINY_FULL_SPEC_FIELDS

    from aioexperts.testing._full_model import FullModelSpec, write_full_model

    return write_full_model(tmp / "tiny-full.gguf", FullModelSpec(**TINY_FULL_SPEC_FIELDS))  # type: ignore[arg-type]


def main() -> None:
    import tempfile

    saved: dict[str, Any] = {}
    for p in fixtures():
        for k, v in asyncio.run(fixture_numbers(p)).items():
            saved[f"{p.stem}/{k}"] = v
        print(p.stem, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for k, v in asyncio.run(builtin_numbers(write_builtin(Path(tmp)))).items():
            saved[f"builtin/{k}"] = v
    DATA.mkdir(exist_ok=True)
    np.savez_compressed(baseline_path(), **saved)
    print(f"wrote {baseline_path()} ({len(saved)} arrays)")


if __name__ == "__main__":
    main()
