"""Batch-invariant products (fused.linear_rows, matrows_<type>): each row bit for bit its one-token result."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from aioexperts._compute import fused

pytestmark = pytest.mark.skipif(fused.backend().name != "numba", reason="the numba backend serves matrows")

SHAPES = [(96, 512), (40, 768)]


@pytest.fixture(autouse=True)
def float_precision() -> Iterator[None]:
    """matrows_<type> serves the float precision (the int8 one has its own batch kernels)."""
    fused.set_precision("float")
    yield
    fused.set_precision(None)


def _q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks with finite, moderate scales (d = 0.01, dmin = 0.002)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
    return blocks.reshape(-1)


def _q8_0(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 32, 34), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.array([0.01], np.float16).tobytes(), np.uint8)
    return blocks.reshape(-1)


def _alone(data: np.ndarray, qtype: Q, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
    return np.concatenate([fused.linear(data, qtype, shape, x[i : i + 1]) for i in range(len(x))])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("make", "qtype"), [(_q4_k, Q.Q4_K), (_q8_0, Q.Q8_0)])
def test_each_row_is_its_one_token_result_in_any_batch(make: Any, qtype: Q, shape: tuple[int, int]) -> None:
    rows, cols = shape
    data = make(rows, cols, 1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, cols)).astype(np.float32)
    alone = _alone(data, qtype, shape, x)
    for n in (1, 2, 3, 4, 5, 7, 16, 20):
        got = fused.linear_rows(data, qtype, shape, x[:n])
        assert got.tobytes() == alone[:n].tobytes(), f"{qtype.name}, {n} rows"
    order = rng.permutation(20)
    assert fused.linear_rows(data, qtype, shape, x[order]).tobytes() == alone[order].tobytes()
    weights = fused._quant.dequantize(data, qtype, shape).astype(np.float64)
    ref = x.astype(np.float64) @ weights.T
    assert np.abs(alone - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16])
@pytest.mark.parametrize(("make", "qtype"), [(_q4_k, Q.Q4_K), (_q8_0, Q.Q8_0)])
def test_products_up_to_16_tokens_are_matrows(make: Any, qtype: Q, n: int) -> None:
    """linear() itself is batch-invariant for Q4_K and Q8_0 up to ROWS_MAX_TOKENS (one kernel for 1..16 tokens)."""
    shape = (64, 512)
    data = make(*shape, 3)
    x = np.random.default_rng(4).standard_normal((n, shape[1])).astype(np.float32)
    assert qtype in fused.rows_types() and n <= fused.ROWS_MAX_TOKENS
    assert fused.linear(data, qtype, shape, x).tobytes() == _alone(data, qtype, shape, x).tobytes()


def test_the_numpy_backend_is_batch_invariant_too() -> None:
    shape = (64, 512)
    data = _q4_k(*shape, 5)
    x = np.random.default_rng(6).standard_normal((5, shape[1])).astype(np.float32)
    fused.set_backend("numpy")
    try:
        got = fused.linear_rows(data, Q.Q4_K, shape, x)
        alone = _alone(data, Q.Q4_K, shape, x)
    finally:
        fused.set_backend(None)
    assert got.tobytes() == alone.tobytes()
