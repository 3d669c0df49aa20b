"""Dense weights: q/k/v stacked into one buffer (``stack_rows``) and the split of the decode
step's products over the compute pool (``invariant_products``): the same bits, one hand-off each."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioexperts._compute import fused
from aioexperts._compute import pool as pool_module
from aioexperts._model.weights import DenseMatrix, invariant_products, stack_rows

Q = GGMLQuantizationType


def dense(name: str, qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> DenseMatrix:
    """Random blocks; the first two bytes of each (Q8_0's float16 scale) a moderate scale."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 2e-3, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    raw.flags.writeable = False
    return DenseMatrix(name, raw, qtype, (rows, cols))


@pytest.fixture
def pool2(monkeypatch: pytest.MonkeyPatch) -> Iterator[pool_module.ComputePool]:
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    monkeypatch.setattr(pool_module, "_pool", pool)
    monkeypatch.setattr(fused, "SPLIT_MIN_BYTES", 1 << 20)
    try:
        yield pool
    finally:
        pool.close()


def test_stacked_rows_give_each_matrix_its_own_bits() -> None:
    cols = 512
    mats = [dense(f"m{i}", Q.Q8_0, rows, cols, seed=i) for i, rows in enumerate((96, 32, 32))]
    got = stack_rows("qkv", mats)
    assert got is not None
    stacked, views = got
    assert stacked.shape == (160, cols) and stacked.n_bytes == sum(m.n_bytes for m in mats)
    x = np.random.default_rng(9).standard_normal((1, cols)).astype(np.float32)
    whole = stacked(x)
    start = 0
    for m, view in zip(mats, views, strict=True):
        assert view.shape == m.shape and view.raw.tobytes() == m.raw.tobytes()
        assert np.shares_memory(view.raw, stacked.raw)
        np.testing.assert_array_equal(whole[:, start : start + m.shape[0]], m(x))
        start += m.shape[0]


def test_matrices_of_other_types_or_widths_are_not_stacked() -> None:
    a = dense("a", Q.Q8_0, 32, 512, seed=1)
    assert stack_rows("ab", [a, dense("b", Q.Q4_K, 32, 512, seed=2)]) is None
    assert stack_rows("ab", [a, dense("b", Q.Q8_0, 32, 1024, seed=2)]) is None
    assert stack_rows("none", []) is None


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_a_split_product_is_one_hand_off_with_the_same_bits(pool2: pool_module.ComputePool, n_tokens: int) -> None:
    # 1024 rows of 2048 Q8_0 columns: 2.2 MB, each half over fused.SPLIT_MIN_BYTES; its parts must
    # not split again (a nested map would only find the other thread busy)
    w = dense("w", Q.Q8_0, 1024, 2048, seed=3)
    x = np.random.default_rng(4).standard_normal((n_tokens, 2048)).astype(np.float32)
    alone = np.concatenate([w.invariant(x[i : i + 1], split=False) for i in range(n_tokens)])
    before = pool2.statistics()
    (got,) = invariant_products([(w, x)], 2)
    after = pool2.statistics()
    # one token: one compiled fan-out (no Python item per part); more: one map
    assert (after.fan_outs - before.fan_outs, after.maps - before.maps) == ((1, 0) if n_tokens == 1 else (0, 1))
    np.testing.assert_array_equal(got, alone)
