"""Resident tensors of a model file are checked at load: a router or selection bias holding NaN
(which makes the choice of experts arbitrary) and a token-to-expert table without one row per token
of the vocabulary are FormatErrors naming the tensor, never a generation that runs on them."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from gguf_rewrite import rewrite

import aioexperts

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
GLM = FIXTURES / "glm4moe-q4_k_m.gguf"
DSV4 = FIXTURES / "next-archs" / "deepseek4-q4_k_m.gguf"
THREADS = aioexperts.IOOptions(backend="threads")


def _load_and_generate(path: Path) -> None:
    async def main() -> None:
        async with aioexperts.load(path, slots=64, n_ctx=64, io=THREADS) as model:
            async for _ in model.generate([1, 2, 3], max_tokens=2):
                pass

    anyio.run(main)


@pytest.mark.skipif(not GLM.exists(), reason="no llama.cpp-made glm4moe fixture")
@pytest.mark.parametrize("tensor", ["blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight"])
def test_a_non_finite_router_or_selection_bias_is_refused_at_load(tmp_path: Path, tensor: str) -> None:
    def poison(data: np.ndarray) -> np.ndarray:
        out = data.astype(np.float32, copy=True)
        out.reshape(-1)[3] = np.nan
        return out.astype(data.dtype)

    bad = rewrite(GLM, tmp_path / "bad.gguf", patch={tensor: poison})
    with pytest.raises(aioexperts.FormatError, match=f"tensor '{tensor}' holds NaN or inf"):
        _load_and_generate(bad)


@pytest.mark.skipif(not DSV4.exists(), reason="no llama.cpp-made deepseek4 fixture")
def test_a_token_table_shorter_than_the_vocabulary_is_refused_at_load(tmp_path: Path) -> None:
    name = "blk.0.ffn_gate_tid2eid.weight"
    bad = rewrite(DSV4, tmp_path / "bad.gguf", patch={name: lambda data: np.ascontiguousarray(data[:256])})
    with pytest.raises(aioexperts.FormatError, match=f"tensor '{name}' has 256 rows, the vocabulary"):
        _load_and_generate(bad)
