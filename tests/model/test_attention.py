"""Attention against a per-query float64 transcription of build_attn_mha's softmax (mask, window, sinks)."""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute import attention
from aioexperts._compute.attention import attend


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, sinks, window: int) -> np.ndarray:
    n, n_head, _ = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((n, n_head, v.shape[2]))
    for t in range(n):
        p1 = start + t
        for h in range(n_head):
            visible = [p0 for p0 in range(p1 + 1) if not (window and p1 - p0 >= window)]  # is_masked_swa
            s = np.array([q[t, h].astype(np.float64) @ k[p0, h // group] * scale for p0 in visible])
            m = max(s.max(), sinks[h]) if sinks is not None else s.max()
            e = np.exp(s - m)
            denom = e.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
            out[t, h] = (e[:, None] * v[visible, h // group]).sum(axis=0) / denom
    return out.reshape(n, -1)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("start", [0, 5])
def test_attention_matches_the_reference(
    with_sinks: bool, window: int, start: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(start + window)
    n, n_head, n_kv_head, d, dv = 7, 4, 2, 16, 8
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((start + n, n_kv_head, d)).astype(np.float32)
    v = rng.standard_normal((start + n, n_kv_head, dv)).astype(np.float32)
    sinks = rng.standard_normal(n_head).astype(np.float32) if with_sinks else None
    want = reference(q, k, v, start, 0.3, sinks, window)
    got = attend(q, k, v, start, 0.3, sinks=sinks, window=window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * n_head * (start + n) * 2)  # chunks of 2 queries
    np.testing.assert_allclose(attend(q, k, v, start, 0.3, sinks=sinks, window=window), got, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("with_sinks", "window", "start"), [(False, 0, 0), (True, 40, 9)])
def test_a_prefill_split_over_its_kv_heads_gives_the_same_bits(
    dtype: type, with_sinks: bool, window: int, start: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from threadpoolctl import threadpool_limits

    from aioexperts._compute import pool as pool_module

    rng = np.random.default_rng(start)
    n, n_head, n_kv_head, d = attention.FLASH_TILE_QUERIES + 3, 8, 4, 32
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((start + n, n_kv_head, d)).astype(dtype)
    v = rng.standard_normal((start + n, n_kv_head, d)).astype(dtype)
    sinks = rng.standard_normal(n_head).astype(np.float32) if with_sinks else None
    monkeypatch.setattr(attention, "SPLIT_MIN", 1)
    with threadpool_limits(1):  # as under the pool: BLAS's sums depend on its thread count
        monkeypatch.setattr(pool_module, "_pool", None)
        alone = attend(q, k, v, start, 0.3, sinks=sinks, window=window)
        pool = pool_module.ComputePool(2, limit_native_threads=False)
        monkeypatch.setattr(pool_module, "_pool", pool)
        try:
            maps = pool.statistics().maps
            split = attend(q, k, v, start, 0.3, sinks=sinks, window=window)
            assert pool.statistics().maps == maps + 1
            if dtype is np.float32:  # below FLASH_TILE_QUERIES: not split (F16 takes the flash kernel)
                attend(q[:-4], k[:-4], v[:-4], start, 0.3, sinks=sinks, window=window)
                assert pool.statistics().maps == maps + 1
        finally:
            pool.close()
    np.testing.assert_array_equal(split, alone)
    want = reference(q, k.astype(np.float32), v.astype(np.float32), start, 0.3, sinks, window)
    np.testing.assert_allclose(split, want, rtol=1e-4, atol=1e-5)
