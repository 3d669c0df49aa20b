"""``MoERunner.moe`` on every shared fixture, against llama.cpp's own outputs (the goldens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import golden_fixture_paths, golden_tolerance, rel_l2

import aioexperts

pytestmark = pytest.mark.anyio

FIXTURES = golden_fixture_paths()
tolerance = golden_tolerance


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
@pytest.mark.parametrize("backend", ["io_uring", "threads"])
async def test_runner_moe_matches_llama_cpp(path: Path, backend: str, anyio_backend: object) -> None:
    golden = np.load(path.with_suffix(".golden.npz"))
    tol = tolerance(path)
    checked = 0
    async with aioexperts.open(path, slots=4, io=aioexperts.IOOptions(backend=backend)) as store:
        runner = aioexperts.MoERunner(store)
        for layer in store.layout.layers:
            if f"moe_in-{layer}" not in golden or f"topk-{layer}" not in golden:
                continue
            x = np.atleast_2d(golden[f"moe_in-{layer}"]).astype(np.float32)
            result = await runner.moe_result(layer, x)
            np.testing.assert_array_equal(result.ids, np.atleast_2d(golden[f"topk-{layer}"]))
            np.testing.assert_allclose(result.weights, np.atleast_2d(golden[f"weights-{layer}"]), rtol=1e-4, atol=1e-6)
            assert rel_l2(result.moe_out, np.atleast_2d(golden[f"moe_out-{layer}"])) <= tol
            if f"shared_out-{layer}" in golden:
                assert result.shared_out is not None
                assert rel_l2(result.shared_out, np.atleast_2d(golden[f"shared_out-{layer}"])) <= tol
            if f"ffn_out-{layer}" in golden:
                assert rel_l2(result.ffn_out, np.atleast_2d(golden[f"ffn_out-{layer}"])) <= tol
                y = await runner.moe(layer, x)  # the plain entry point on its own, now all hits
                assert rel_l2(y, np.atleast_2d(golden[f"ffn_out-{layer}"])) <= tol
            checked += 1
        st = store.statistics()
        assert st.requests == st.hits + st.inflight_joins + st.misses
    assert checked >= 1


async def test_moe_rejects_bad_input_and_stays_usable(anyio_backend: object) -> None:
    if not FIXTURES:
        pytest.skip("shared fixtures not found")
    path = next(p for p in FIXTURES if p.stem == "qwen3moe-f32")
    async with aioexperts.open(path, slots=4) as store:
        runner = aioexperts.MoERunner(store)
        with pytest.raises(aioexperts.InvalidRequestError):
            await runner.moe(0, np.zeros((2, 17), dtype=np.float32))
        with pytest.raises(aioexperts.InvalidRequestError):
            await runner.moe(9, np.zeros((2, 256), dtype=np.float32))
        y = await runner.moe(0, np.ones((2, 256), dtype=np.float32))
        assert y.shape == (2, 256) and y.dtype == np.float32 and np.isfinite(y).all()
