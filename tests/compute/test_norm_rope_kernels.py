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
