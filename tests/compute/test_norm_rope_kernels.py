"""The compiled RMSNorm and RoPE give the numpy arithmetic's bits (kernels/norm.py, kernels/rope.py)."""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute import fused, norms, rope
from aioexperts._format.architectures import RopeType

pytestmark = pytest.mark.skipif(fused.backend().name != "numba", reason="needs numba")


def numpy_rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    squares = np.square(x, dtype=np.float32).astype(np.float64)
    mean = (squares.sum(axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    y = x * scale
    if weight is not None:
        y *= weight
    return y.astype(np.float32, copy=False)


def numpy_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, n_rot: int) -> np.ndarray:
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        h = n_rot // 2
        x0, x1 = x[:, :, :h], x[:, :, h:n_rot]
        out[:, :, :h], out[:, :, h:n_rot] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        x0, x1 = x[:, :, 0:n_rot:2], x[:, :, 1:n_rot:2]
        out[:, :, 0:n_rot:2], out[:, :, 1:n_rot:2] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


# rows of fewer than 8, up to 128 and longer (numpy's pairwise sum in its three regimes), 2-D and per head
SHAPES = [(1, 64), (3, 100), (2, 128), (1, 129), (1, 2048), (4, 1536), (2, 7168), (1, 32, 128), (3, 4, 72), (9, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_has_the_numpy_bits(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    for trial in range(20):
        x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32) if trial % 2 else None
        np.testing.assert_array_equal(norms.rms_norm(x, w, 1e-6), numpy_rms_norm(x, w, 1e-6))
    strided = (rng.standard_normal((shape[0], 2 * shape[-1])).astype(np.float32))[:, ::2]  # not contiguous
    np.testing.assert_array_equal(norms.rms_norm(strided, None, 1e-5), numpy_rms_norm(strided, None, 1e-5))


@pytest.mark.parametrize(("t", "h", "d", "n_rot"), [(1, 32, 128, 128), (3, 4, 128, 64), (2, 8, 64, 32), (1, 2, 96, 96)])
@pytest.mark.parametrize("rope_type", [RopeType.NORM, RopeType.NEOX], ids=lambda r: r.name)
def test_rope_has_the_numpy_bits(t: int, h: int, d: int, n_rot: int, rope_type: RopeType) -> None:
    rng = np.random.default_rng(t * h + d)
    x = (rng.standard_normal((t, h, d)) * 30).astype(np.float32)
    angles = rng.random((t, n_rot // 2)) * 100
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    got = rope.apply_rope(x, cos, sin, rope_type, n_rot)
    np.testing.assert_array_equal(got, numpy_rope(x, cos, sin, rope_type == RopeType.NEOX, n_rot))
    assert got is not x


@pytest.mark.parametrize("shape", [(1, 64), (1, 2048), (3, 100), (2, 7168)], ids=str)
@pytest.mark.parametrize("scale", [0.0, 0.22], ids=["no-scale", "granite-scale"])
def test_add_rms_norm_has_the_bits_of_the_add_then_the_norm(shape: tuple[int, int], scale: float) -> None:
    rng = np.random.default_rng(shape[1])
    for trial in range(10):
        a = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 3)).astype(np.float32)
        b = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 3)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32) if trial % 2 else None
        got = norms.add_rms_norm(a, b, scale, w, 1e-6)
        assert got is not None
        total = a + (b * np.float32(scale) if scale else b)  # residual.add_residual's arithmetic
        np.testing.assert_array_equal(got[0], total)
        np.testing.assert_array_equal(got[1], numpy_rms_norm(total, w, 1e-6))


def test_add_rms_norm_declines_what_it_cannot_serve() -> None:
    a = np.ones((1, 64), dtype=np.float32)
    b = a.copy()
    b[0, 5] = np.inf
    assert norms.add_rms_norm(a, b, 0.0, None, 1e-6) is None  # not finite: the numpy path raises
    b[0, 5] = 3e38
    assert norms.add_rms_norm(np.full_like(a, 3e38), b, 0.0, None, 1e-6) is None  # overflows in the add
    assert norms.add_rms_norm(a, a.astype(np.float64), 0.0, None, 1e-6) is None  # dtype
    two = np.ones((2, 64), np.float32)
    assert norms.add_rms_norm(two, np.ones((2, 65), np.float32)[:, :64], 0.0, None, 1e-6) is None  # strided
    assert norms.add_rms_norm(a, a, 0.0, np.ones(63, np.float32), 1e-6) is None  # weight shape


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (1, 2048), (3, 4, 5)], ids=str)
def test_all_finite_finds_every_nan_and_inf(shape: tuple[int, ...]) -> None:
    x = np.zeros(shape, dtype=np.float32)
    assert norms.all_finite(x)
    for bad in (np.nan, np.inf, -np.inf):
        for i in range(x.size):
            y = x.copy()
            y.reshape(-1)[i] = bad
            assert not norms.all_finite(y)
            assert not norms.all_finite(y.astype(np.float64))  # numpy's path for other dtypes


def test_a_forced_numpy_backend_sends_the_norm_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """compiled_kernel is found once per backend choice: set_backend("numpy") after a first use
    turns the compiled norm off, set_backend(None) on again."""
    assert fused.compiled_kernel("norm", "rms_norm_rows") is not None
    calls: list[str] = []
    numpy_square = np.square
    monkeypatch.setattr(norms.np, "square", lambda *a, **k: calls.append("numpy") or numpy_square(*a, **k))
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    try:
        fused.set_backend("numpy")
        assert fused.compiled_kernel("norm", "rms_norm_rows") is None
        norms.rms_norm(x, None, 1e-6)
        assert calls == ["numpy"]
    finally:
        fused.set_backend(None)
    assert fused.compiled_kernel("norm", "rms_norm_rows") is not None
    norms.rms_norm(x, None, 1e-6)
    assert calls == ["numpy"]  # compiled again
