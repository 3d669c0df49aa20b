"""A decode step's attention with its KV heads split over the pool in one hand-off
(``GQABlock._decode_by_heads``) gives the bits of the general path (q/k/v as one split product,
then the flash attention split over heads), on every llama.cpp-made fixture whose blocks are GQA."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._compute.pool import configure_compute_pool
from aioexperts._model.blocks import GQABlock

THREADS = aioexperts.IOOptions(backend="threads")
FORWARD = [p for p in shared_fixture_paths() if p.with_name(p.stem + ".forward.npz").exists()]


def _decode(path: Path, steps: int) -> np.ndarray:
    """Logits of a prefill of 6 tokens and ``steps`` decode steps."""

    async def main() -> np.ndarray:
        tokens = np.load(path.with_name(path.stem + ".forward.npz"))["tokens"].tolist()
        async with aioexperts.load(path, slots=8, io=THREADS) as model:
            async with model.sequence() as seq:
                rows = [await seq.forward(tokens[:6])]
                rows += [await seq.forward([t]) for t in tokens[6 : 6 + steps]]
        return np.concatenate(rows)

    return anyio.run(main)


@pytest.mark.parametrize("path", FORWARD, ids=lambda p: p.stem)
def test_decode_by_heads_gives_the_general_paths_bits(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configure_compute_pool(2)
    served = []
    real = GQABlock._decode_by_heads

    def counted(self, *a):
        y = real(self, *a)
        served.append(y is not None)
        return y

    monkeypatch.setattr(GQABlock, "_decode_by_heads", counted)
    got = _decode(path, 5)
    monkeypatch.setattr(GQABlock, "_decode_by_heads", lambda self, *a: None)
    want = _decode(path, 5)
    assert np.array_equal(got, want)
    arch = aioexperts.open_model(path).architecture
    if arch in ("qwen3moe", "qwen2moe", "llama", "gpt-oss", "granitemoe"):  # GQA, F16 cache, per-head norms at most
        assert served and all(served), arch
