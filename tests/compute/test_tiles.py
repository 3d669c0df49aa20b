"""The tiled Q4_K kernels (:mod:`aioexperts._compute.kernels.tiles`): llama.cpp's sums for many tokens."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_int8_rows import activations, matrix
from test_kernels import q8_k_reference, rel_l2

from aioexperts._compute import fused
from aioexperts._compute.kernels import int8, rowdot, tiles
from aioexperts._format.dequant import dequantize

Q = GGMLQuantizationType


def llama_reference(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``ggml_vec_dot_q4_K_q8_K`` per token and row in float64: ``x`` rounded to Q8_K (ggml's
    ``quantize_row_q8_K_ref``), times the dequantized weights."""
    rows, cols = raw.shape[0], x.shape[1]
    w = dequantize(raw, Q.Q4_K, (rows, cols)).astype(np.float64)
    rounded = []
    for t in range(x.shape[0]):
        q, d, _ = q8_k_reference(x[t])
        rounded.append((q.reshape(-1, 256).astype(np.float64) * d.astype(np.float64)[:, None]).reshape(-1))
    return np.stack(rounded) @ w.T


@pytest.mark.parametrize("cols", [256, 768, 2048])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
def test_tiled_products_are_llama_cpp_s_sums(n: int, cols: int) -> None:
    rows = 23
    raw = matrix(Q.Q4_K, rows, cols, seed=n + cols)
    x = activations(n, cols, seed=7 + n)
    got = np.full((n, rows), np.nan, np.float32)
    assert tiles.matmat_tiled_q4_k(raw, x, got)
    assert rel_l2(got, llama_reference(raw, x)) <= 1e-6
    exact = np.empty((n, rows), np.float32)
    assert int8.matmat_int8_q4_k(raw, x, exact)  # ggml's loop bit for bit, the same integers
    assert rel_l2(got, exact) <= 1e-6


def test_a_non_finite_x_is_refused_and_nothing_is_written() -> None:
    raw = matrix(Q.Q4_K, 8, 512, seed=1)
    x = activations(20, 512, seed=2).copy()
    x[13, 100] = np.inf
    out = np.full((20, 8), -1.0, np.float32)
    assert not tiles.matmat_tiled_q4_k(raw, x, out)
    assert (out == -1.0).all()


@pytest.mark.parametrize(("vnni", "x86"), [(False, True), (False, False)])
def test_the_paths_without_vnni_give_the_same_sums(vnni: bool, x86: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pmaddubsw``/``pmaddwd`` (no VNNI) and plain vector IR (no x86): the same integers per
    block as ``vpdpbusd``, the same float operations after them, so the same bits."""
    rows, cols, n = 9, 1024, 2 * tiles.TILE
    raw = matrix(Q.Q4_K, rows, cols, seed=3)
    x = activations(n, cols, seed=4)
    want = np.empty((n, rows), np.float32)
    assert tiles.matmat_tiled_q4_k(raw, x, want)
    monkeypatch.setattr(tiles, "_vnni", lambda: vnni)
    if not x86:
        monkeypatch.setattr(rowdot, "_avx2", lambda: False)
    kernel = numba.njit(cache=False)(tiles.matmat_tiled_q4_k.py_func)  # compiled now, with these flags
    got = np.empty((n, rows), np.float32)
    assert kernel(raw, x, got)
    asm = next(iter(kernel.inspect_asm().values()))
    assert "vpdpbusd" not in asm
    np.testing.assert_array_equal(got, want)


def test_linear_takes_the_tiles_from_the_threshold_and_linear_rows_never() -> None:
    if Q.Q4_K not in fused.tiled_types():
        pytest.skip("no AVX-512 VNNI here: the tiles are off")
    rows, cols = 17, 512
    raw = matrix(Q.Q4_K, rows, cols, seed=8)
    n = fused.TILED_MIN_TOKENS
    x = activations(n, cols, seed=9)
    tiled = np.empty((n, rows), np.float32)
    assert tiles.matmat_tiled_q4_k(raw, x, tiled)
    np.testing.assert_array_equal(fused.linear(raw, Q.Q4_K, (rows, cols), x), tiled)
    exact = np.empty((n, rows), np.float32)
    assert int8.matmat_int8_q4_k(raw, x, exact)
    np.testing.assert_array_equal(fused.linear_rows(raw, Q.Q4_K, (rows, cols), x), exact)
    below = fused.linear(raw, Q.Q4_K, (rows, cols), x[:-1])
    np.testing.assert_array_equal(below, exact[:-1])  # each token bit for bit alone below the threshold


def test_a_short_rest_after_whole_tiles_takes_the_exact_loops() -> None:
    if Q.Q4_K not in fused.tiled_types():
        pytest.skip("no AVX-512 VNNI here: the tiles are off")
    rows, cols, n = 13, 512, tiles.TILE + 3
    raw = matrix(Q.Q4_K, rows, cols, seed=10)
    x = activations(n, cols, seed=11)
    got = fused.linear(raw, Q.Q4_K, (rows, cols), x)
    whole = np.empty((tiles.TILE, rows), np.float32)
    assert tiles.matmat_tiled_q4_k(raw, x[: tiles.TILE], whole)
    exact = np.empty((n, rows), np.float32)
    assert int8.matmat_int8_q4_k(raw, x, exact)
    np.testing.assert_array_equal(got[: tiles.TILE], whole)
    np.testing.assert_array_equal(got[tiles.TILE :], exact[tiles.TILE :])
