"""The vector F16 flash attention (kernels/halfvec.py) gives the scalar kernel's bits, and attend() uses it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aioexperts._compute import fused
from aioexperts._compute.attention import attend

pytestmark = pytest.mark.skipif(fused.flash_kernel() is None, reason="numba kernels unavailable")


def _kernels() -> Any:
    from aioexperts._compute.kernels import flash, halfvec

    return flash, halfvec


CASES = [
    # tokens, heads, kv heads, head size, positions, window, sinks
    (1, 32, 4, 128, 270, 0, False),
    (1, 8, 8, 64, 40, 0, False),
    (3, 8, 2, 64, 50, 16, True),
    (5, 4, 1, 128, 9, 0, True),
    (1, 4, 1, 96, 33, 4, False),
]


@pytest.mark.parametrize(("n", "heads", "kv_heads", "dim", "n_kv", "window", "sink"), CASES)
def test_vector_kernel_equals_the_scalar_kernel_bit_for_bit(
    n: int, heads: int, kv_heads: int, dim: int, n_kv: int, window: int, sink: bool
) -> None:
    flash, _ = _kernels()
    rng = np.random.default_rng(n * 1000 + n_kv)
    q = (rng.standard_normal((n, heads, dim)) * 3).astype(np.float32)
    k = (rng.standard_normal((n_kv, kv_heads, dim)) * 2).astype(np.float16)
    v = rng.standard_normal((n_kv, kv_heads, dim)).astype(np.float16)
    sinks = rng.standard_normal(heads).astype(np.float32) if sink else np.empty(0, np.float32)
    scale = np.float32(1 / np.sqrt(dim))
    want = np.empty((n, heads, dim), np.float32)
    got = np.empty((n, heads, dim), np.float32)
    flash.flash_attend_f16(q, k.astype(np.float32), v.astype(np.float32), n_kv - n, scale, sinks, window, want)
    flash.flash_attend_f16_bits(q, k.view(np.uint16), v.view(np.uint16), n_kv - n, scale, sinks, window, got, 0, heads)
    assert np.array_equal(got, want)
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_attend_runs_the_vector_kernel_on_an_f16_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    flash, halfvec = _kernels()
    if not halfvec.hardware_half():
        pytest.skip("this CPU converts float16 in software: the scalar kernel serves")
    calls = []
    real = flash.flash_attend_f16_bits

    def counted(*args: Any) -> None:
        calls.append(args[1].dtype)
        real(*args)

    monkeypatch.setattr(flash, "flash_attend_f16_bits", counted)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((20, 2, 64)).astype(np.float16) for _ in range(2))
    out = attend(q, k, v, 19, 0.125)
    assert calls == [np.dtype(np.uint16)]  # the cache's own bits, no float32 copy
    scalar = np.empty((1, 8, 64), np.float32)
    flash.flash_attend_f16(
        q, k.astype(np.float32), v.astype(np.float32), 19, np.float32(0.125), np.empty(0, np.float32), 0, scalar
    )
    assert np.array_equal(out, scalar.reshape(1, -1))


def test_heads_split_over_the_pool_give_the_same_bits() -> None:
    from aioexperts._compute.pool import compute_pool

    flash, _ = _kernels()
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 16, 64)).astype(np.float32)
    k, v = (rng.standard_normal((300, 4, 64)).astype(np.float16) for _ in range(2))
    whole = np.empty((1, 16, 64), np.float32)
    flash.flash_attend_f16_bits(
        q, k.view(np.uint16), v.view(np.uint16), 299, np.float32(0.125), np.empty(0, np.float32), 0, whole, 0, 16
    )
    parts = np.full((1, 16, 64), np.nan, np.float32)
    for lo, hi in ((0, 5), (5, 16)):
        flash.flash_attend_f16_bits(
            q, k.view(np.uint16), v.view(np.uint16), 299, np.float32(0.125), np.empty(0, np.float32), 0, parts, lo, hi
        )
    assert np.array_equal(parts, whole)
    # a call writes its own heads only (3..9 cuts two KV heads' groups of 4 in the middle)
    alone = np.full((1, 16, 64), np.nan, np.float32)
    flash.flash_attend_f16_bits(
        q, k.view(np.uint16), v.view(np.uint16), 299, np.float32(0.125), np.empty(0, np.float32), 0, alone, 3, 9
    )
    assert np.isnan(alone[:, :3]).all() and np.isnan(alone[:, 9:]).all()
    assert np.array_equal(alone[:, 3:9], whole[:, 3:9])
    assert compute_pool().n_threads >= 1  # the pool exists: attend() may split its heads
    assert 16 * 300 >= fused.FLASH_SPLIT_MIN
    assert np.array_equal(attend(q, k, v, 299, 0.125), whole.reshape(1, -1))


def test_norm_rope_store_kv_is_the_two_norm_rope_calls_and_numpys_float16_cache_writes() -> None:
    """RowAttention's one call (``kernels/flash.py: norm_rope_store_kv``): q and k as
    ``norm_rope_heads`` makes them, and the key and value rows written at ``start`` with the bits of
    ``cache[start] = row`` (numpy's float16 rounding: halfway cases to even, overflow to inf,
    subnormals, signed zeros, infinities, quiet NaNs); no other row of the caches touched. (All 2**32
    float32 patterns but the signaling NaNs were checked against numpy once, outside the suite.)"""
    flash, _ = _kernels()
    from aioexperts._compute.kernels.rope import norm_rope_heads

    rng = np.random.default_rng(11)
    n_head, n_kv, dim, n_ctx, start = 4, 2, 64, 5, 3
    q = rng.standard_normal((1, n_head, dim)).astype(np.float32)
    k = rng.standard_normal((1, n_kv, dim)).astype(np.float32) * np.float32(300.0)
    v = rng.standard_normal((n_kv, dim)).astype(np.float32)
    special = np.array(
        [65504.0, 65520.0, 65519.99, 1e6, -1e6, 6e-8, 2.98e-8, 2.99e-8, -0.0, 0.0, np.inf, -np.inf, np.nan,
         -np.nan, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6.1e-5, -6.0e-5],
        dtype=np.float32,
    )  # fmt: skip
    v.reshape(-1)[: special.size] = special
    wq, wk = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
    cos = rng.standard_normal((1, dim // 2)).astype(np.float32)
    sin = rng.standard_normal((1, dim // 2)).astype(np.float32)
    eps = np.float32(1e-6)
    for norm in (True, False):
        want_q, want_k = np.empty_like(q), np.empty_like(k)
        norm_rope_heads(q, norm, wq, eps, cos, sin, True, dim, np.empty_like(q), want_q)
        norm_rope_heads(k, norm, wk, eps, cos, sin, True, dim, np.empty_like(k), want_k)
        k_cache = rng.standard_normal((n_ctx, n_kv, dim)).astype(np.float16)
        v_cache = rng.standard_normal((n_ctx, n_kv, dim)).astype(np.float16)
        want_kc, want_vc = k_cache.copy(), v_cache.copy()
        want_kc[start] = want_k[0]
        with np.errstate(over="ignore"):
            want_vc[start] = v
        got_q, got_k = np.empty_like(q), np.empty_like(k)
        flash.norm_rope_store_kv(
            q, norm, wq, np.empty_like(q), got_q, k, norm, wk, np.empty_like(k), got_k, v, eps, cos, sin,
            True, dim, k_cache.view(np.uint16), v_cache.view(np.uint16), start,
        )  # fmt: skip
        assert np.array_equal(got_q.view(np.uint32), want_q.view(np.uint32))
        assert np.array_equal(got_k.view(np.uint32), want_k.view(np.uint32))
        assert np.array_equal(k_cache.view(np.uint16), want_kc.view(np.uint16)), norm
        assert np.array_equal(v_cache.view(np.uint16), want_vc.view(np.uint16)), norm
