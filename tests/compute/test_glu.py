"""The SwiGLU's compiled tail (kernels/glu.py) has the bits of numpy's steps, special values included."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from aioexperts._compute import fused, glu

pytestmark = pytest.mark.skipif(fused.backend().name != "numba", reason="needs numba")


def _numpy_swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g, tmp, out = g.copy(), np.empty_like(g), np.empty_like(g)
    np.negative(g, out=tmp)
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(tmp, out=tmp)
        tmp += np.float32(1.0)
        np.divide(g, tmp, out=g)
        np.multiply(g, u, out=out)
    return out


def _inputs(rng: np.random.Generator, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    g = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0, 200.0], size=shape)).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    flat = g.reshape(-1)
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 104.0, -104.0], np.float32)
    flat[: specials.size] = specials
    u.reshape(-1)[specials.size : 2 * specials.size] = np.array([np.inf, -np.inf, np.nan] * 3 + [0.0, -0.0], np.float32)
    return g, u


@pytest.mark.parametrize("shape", [(1, 768), (8, 768), (3, 17)])
def test_the_compiled_tail_gives_numpys_bits(shape: tuple[int, int]) -> None:
    assert fused.compiled_kernel("glu", "silu_mul_tail") is not None
    g, u = _inputs(np.random.default_rng(sum(shape)), shape)
    want = _numpy_swiglu(g, u)
    gg, tmp, out = g.copy(), np.empty_like(g), np.empty_like(g)
    glu.swiglu(gg, u.copy(), tmp, out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))  # NaNs and signed zeros too


def test_arrays_the_tail_does_not_take_go_through_numpy() -> None:
    g, u = _inputs(np.random.default_rng(3), (4, 64))
    want = _numpy_swiglu(g, u)
    gg, uu = np.asfortranarray(g), np.asfortranarray(u)  # not C-contiguous
    tmp, out = np.empty_like(gg), np.empty_like(gg)
    with np.errstate(invalid="ignore"):
        glu.swiglu(gg, uu, tmp, out)
    assert np.array_equal(np.ascontiguousarray(out).view(np.uint32), want.view(np.uint32))
    one = g[0].copy()  # 1-D
    tmp1, out1 = np.empty_like(one), np.empty_like(one)
    with np.errstate(invalid="ignore"):
        glu.swiglu(one, u[0].copy(), tmp1, out1)
    assert np.array_equal(out1.view(np.uint32), want[0].view(np.uint32))


@pytest.mark.parametrize("low", [-80.0, -87.9, -88.0, -88.1, -89.0, -104.0])
def test_the_compiled_negation_says_when_exp_may_overflow_and_keeps_numpys_bits(low: float) -> None:
    """``negate_rows`` is ``np.negative`` bit for bit (NaN signs too) and says True exactly when a
    ``-g`` exceeds 88 (numpy's ``exp`` overflows from 88.72); the SwiGLU then gives numpy's bits
    with warnings as errors, whichever way it went."""
    from aioexperts._compute.kernels.glu import EXP_OVERFLOW_FROM

    negate = fused.compiled_kernel("glu", "negate_rows")
    assert negate is not None
    rng = np.random.default_rng(7)
    g = rng.uniform(low, 20.0, size=(8, 768)).astype(np.float32)
    g[0, :4] = [np.nan, -np.nan, 0.0, -0.0]
    g[1, 0] = np.float32(low)
    tmp = np.empty_like(g)
    said = negate(g, tmp)
    assert np.array_equal(tmp.view(np.uint32), np.negative(g).view(np.uint32))
    assert said == bool(np.nanmax(-g) > EXP_OVERFLOW_FROM)
    u = rng.standard_normal(g.shape).astype(np.float32)
    want = _numpy_swiglu(g, u)
    gg, tmp2, out = g.copy(), np.empty_like(g), np.empty_like(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        glu.swiglu(gg, u.copy(), tmp2, out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
