"""The tiled k-quant kernels (:mod:`aioexperts._compute.kernels.tiles`): llama.cpp's sums for many tokens."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_int8_rows import activations, matrix
from test_kernels import q8_k_reference, rel_l2

from aioexperts._compute import fused
from aioexperts._compute.kernels import int8, rowdot, tiles
from aioexperts._format.dequant import dequantize

Q = GGMLQuantizationType
TILED = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def tiled_kernel(qtype: GGMLQuantizationType) -> Callable[..., bool]:
    kernel: Callable[..., bool] = getattr(tiles, f"matmat_tiled_{qtype.name.lower()}")
    return kernel


def exact_kernel(qtype: GGMLQuantizationType) -> Callable[..., bool]:
    """``matmat_int8_<type>``: ggml's loop per token bit for bit (the same integers per block)."""
    kernel: Callable[..., bool] = getattr(int8, f"matmat_int8_{qtype.name.lower()}")
    return kernel


# ----------------------------------------------------------------------------------------------
# ggml's dequantize_row_q4_K / q5_K / q6_K, literally, in float64 (blocks along the first axis)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float64)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``get_scale_min_k4`` for ``j < 8``: ``(sc, m)``, ``(n_blocks, 8)`` each."""
    q = scales.astype(np.int64)
    sc = np.empty((len(q), 8), np.int64)
    m = np.empty((len(q), 8), np.int64)
    for j in range(8):
        if j < 4:
            sc[:, j], m[:, j] = q[:, j] & 63, q[:, j + 4] & 63
        else:
            sc[:, j] = (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
            m[:, j] = (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
    return sc, m


def dequantize_k4(blocks: np.ndarray, qh: int | None) -> np.ndarray:
    """Q4_K (``qh`` None, nibbles at byte 16) or Q5_K (fifth bits at byte 16, nibbles at 48)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, 16:144] if qh is None else blocks[:, 48:176]
    high = None if qh is None else blocks[:, qh : qh + 32].astype(np.int64)
    y = np.empty((len(blocks), 256))
    for j in range(4):
        ql = qs[:, 32 * j : 32 * j + 32].astype(np.int64)
        for half, codes in enumerate((ql & 0xF, ql >> 4)):
            s = 2 * j + half
            if high is not None:
                codes = codes + 16 * ((high >> s) & 1)
            y[:, 32 * s : 32 * s + 32] = (d * sc[:, s])[:, None] * codes - (dmin * m[:, s])[:, None]
    return y


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 208)
    scales = blocks[:, 192:208].view(np.int8).astype(np.int64)
    y = np.empty((len(blocks), 256))
    for n in range(2):
        ql = blocks[:, 64 * n : 64 * n + 64].astype(np.int64)
        qh = blocks[:, 128 + 32 * n : 160 + 32 * n].astype(np.int64)
        for l in range(32):  # noqa: E741 (ggml's name)
            i = l // 16
            codes = (
                ((ql[:, l] & 0xF) | (((qh[:, l] >> 0) & 3) << 4)) - 32,
                ((ql[:, l + 32] & 0xF) | (((qh[:, l] >> 2) & 3) << 4)) - 32,
                ((ql[:, l] >> 4) | (((qh[:, l] >> 4) & 3) << 4)) - 32,
                ((ql[:, l + 32] >> 4) | (((qh[:, l] >> 6) & 3) << 4)) - 32,
            )
            for k, code in enumerate(codes):
                y[:, 128 * n + 32 * k + l] = d * scales[:, 8 * n + i + 2 * k] * code
    return y


def literal_weights(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    values = {Q.Q4_K: lambda: dequantize_k4(blocks, None), Q.Q5_K: lambda: dequantize_k4(blocks, 16)}.get(
        qtype, lambda: dequantize_q6_k(blocks)
    )()
    return values.reshape(rows, -1)


def llama_reference(raw: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """``ggml_vec_dot_<type>_q8_K`` per token and row in float64: ``x`` rounded to Q8_K (ggml's
    ``quantize_row_q8_K_ref``), times the weights dequantized as ggml's ``dequantize_row_<type>``."""
    rounded = []
    for t in range(x.shape[0]):
        q, d, _ = q8_k_reference(x[t])
        rounded.append((q.reshape(-1, 256).astype(np.float64) * d.astype(np.float64)[:, None]).reshape(-1))
    return np.stack(rounded) @ literal_weights(raw, qtype).T


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_the_literal_dequantization_is_gguf_s(qtype: GGMLQuantizationType) -> None:
    raw = matrix(qtype, 6, 1024, seed=12)
    want = dequantize(raw, qtype, (6, 1024)).astype(np.float64)
    assert rel_l2(literal_weights(raw, qtype), want) <= 1e-7


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [256, 768, 2048])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
def test_tiled_products_are_llama_cpp_s_sums(qtype: GGMLQuantizationType, n: int, cols: int) -> None:
    rows = 23
    raw = matrix(qtype, rows, cols, seed=n + cols)
    x = activations(n, cols, seed=7 + n)
    got = np.full((n, rows), np.nan, np.float32)
    assert tiled_kernel(qtype)(raw, x, got)
    assert rel_l2(got, llama_reference(raw, qtype, x)) <= 1e-6
    exact = np.empty((n, rows), np.float32)
    assert exact_kernel(qtype)(raw, x, exact)  # ggml's loop bit for bit, the same integers
    assert rel_l2(got, exact) <= 1e-6


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_a_non_finite_x_is_refused_and_nothing_is_written(qtype: GGMLQuantizationType) -> None:
    raw = matrix(qtype, 8, 512, seed=1)
    x = activations(20, 512, seed=2).copy()
    x[13, 100] = np.inf
    out = np.full((20, 8), -1.0, np.float32)
    assert not tiled_kernel(qtype)(raw, x, out)
    assert (out == -1.0).all()


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
@pytest.mark.parametrize(("vnni", "x86"), [(False, True), (False, False)])
def test_the_paths_without_vnni_give_the_same_sums(
    qtype: GGMLQuantizationType, vnni: bool, x86: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pmaddubsw``/``pmaddwd`` (no VNNI) and plain vector IR (no x86): the same integers per
    block as ``vpdpbusd``, the same float operations after them, so the same bits."""
    rows, cols, n = 9, 1024, 2 * tiles.TILE
    raw = matrix(qtype, rows, cols, seed=3)
    x = activations(n, cols, seed=4)
    want = np.empty((n, rows), np.float32)
    assert tiled_kernel(qtype)(raw, x, want)
    monkeypatch.setattr(tiles, "_vnni", lambda: vnni)
    if not x86:
        monkeypatch.setattr(rowdot, "_avx2", lambda: False)
    kernel = numba.njit(cache=False)(tiled_kernel(qtype).py_func)  # compiled now, with these flags
    got = np.empty((n, rows), np.float32)
    assert kernel(raw, x, got)
    asm = next(iter(kernel.inspect_asm().values()))
    assert "vpdpbusd" not in asm
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_linear_takes_the_tiles_from_the_threshold_and_linear_rows_never(qtype: GGMLQuantizationType) -> None:
    if not tiles.fast():
        pytest.skip("no AVX-512 VNNI here: the tiles are off")
    assert qtype in fused.tiled_types()
    rows, cols = 17, 512
    raw = matrix(qtype, rows, cols, seed=8)
    n = fused.TILED_MIN_TOKENS
    x = activations(n, cols, seed=9)
    tiled = np.empty((n, rows), np.float32)
    assert tiled_kernel(qtype)(raw, x, tiled)
    np.testing.assert_array_equal(fused.linear(raw, qtype, (rows, cols), x), tiled)
    exact = np.empty((n, rows), np.float32)
    assert exact_kernel(qtype)(raw, x, exact)
    assert not np.array_equal(tiled, exact)  # another float order: the test can tell the paths apart
    np.testing.assert_array_equal(fused.linear_rows(raw, qtype, (rows, cols), x), exact)
    below = fused.linear(raw, qtype, (rows, cols), x[:-1])
    np.testing.assert_array_equal(below, exact[:-1])  # each token bit for bit alone below the threshold


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_a_short_rest_after_whole_tiles_takes_the_exact_loops(qtype: GGMLQuantizationType) -> None:
    if not tiles.fast():
        pytest.skip("no AVX-512 VNNI here: the tiles are off")
    assert qtype in fused.tiled_types()
    rows, cols, n = 13, 512, tiles.TILE + 3
    raw = matrix(qtype, rows, cols, seed=10)
    x = activations(n, cols, seed=11)
    got = fused.linear(raw, qtype, (rows, cols), x)
    whole = np.empty((tiles.TILE, rows), np.float32)
    assert tiled_kernel(qtype)(raw, x[: tiles.TILE], whole)
    exact = np.empty((n, rows), np.float32)
    assert exact_kernel(qtype)(raw, x, exact)
    np.testing.assert_array_equal(got[: tiles.TILE], whole)
    np.testing.assert_array_equal(got[tiles.TILE :], exact[tiles.TILE :])


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_rows_in_several_chunks_give_each_row_s_bits(qtype: GGMLQuantizationType) -> None:
    """Past :data:`tiles.CHUNK_BYTES` of decoded rows the matrix goes through the tiles in chunks of
    rows (each decoded once for every tile): each row's result is the one it gets alone."""
    cols, n = 2048, 2 * tiles.TILE + 3
    chunk = tiles.CHUNK_BYTES // (4 * (cols // 256) * (tiles.WORDS + tiles.SCALES))
    rows = 2 * chunk + 5
    raw = matrix(qtype, rows, cols, seed=13)
    x = activations(n, cols, seed=14)
    got = np.empty((n, rows), np.float32)
    assert tiled_kernel(qtype)(raw, x, got)
    for r0 in range(0, rows, 7):
        alone = np.empty((n, min(rows, r0 + 7) - r0), np.float32)
        assert tiled_kernel(qtype)(raw[r0 : r0 + 7], x, alone)
        np.testing.assert_array_equal(got[:, r0 : r0 + 7], alone)
    exact = np.empty((n, rows), np.float32)
    assert exact_kernel(qtype)(raw, x, exact)
    assert rel_l2(got, exact) <= 1e-6


def test_warmup_readies_the_tiled_kernels_before_the_first_prefill() -> None:
    """A fresh process: after fused.warmup of the tiled types no tiled kernel compiles or loads at
    the first product of many tokens (it cost the first prefill's first token)."""
    import subprocess
    import sys

    if not tiles.fast():
        pytest.skip("no AVX-512 VNNI here: the tiles are off")
    code = (
        "from gguf import GGMLQuantizationType as T\n"
        "from aioexperts._compute import fused\n"
        "from aioexperts._compute.kernels import tiles\n"
        "report = fused.warmup([T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0])\n"
        "assert {'matmat_tiled_q4_k', 'matmat_tiled_q5_k', 'matmat_tiled_q6_k'} <= set(report.kernels), report\n"
        "for k in (tiles.matmat_tiled_q4_k, tiles.matmat_tiled_q5_k, tiles.matmat_tiled_q6_k):\n"
        "    assert len(k.signatures) == 1, k.signatures\n"
    )
    env = {**__import__("os").environ, "AIOEXPERTS_PRECISION": "int8"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
