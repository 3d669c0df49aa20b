"""The whole-row int8 kernels (``aioexperts._compute.kernels.rowdot``) and their multi-token form.

* ``matmat_int8_<type>``: each token's result is bit for bit the one-token ``matvec_int8_<type>``
  result, for every batch size 1..64 and any position of the token in the batch (the summation
  order of a row never depends on the batch);
* the AVX2 instructions (``pmaddubsw``/``pmaddwd``) and the portable vector IR compute the same
  integers, so a kernel compiled without them gives bit-equal results;
* the products agree with the previous int8 kernels' formula (per-block integer dots, written
  with the generic intrinsics of :mod:`.simd`) within float rounding, and with a float64 product of
  the dequantized matrix within the rounding of ``x`` to 8 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_kernels import INT8_RTOL, rel_l2, sane_blocks

from aioexperts._compute import fused
from aioexperts._compute.kernels import int8, rowdot, rowdot_legacy, rowdots
from aioexperts._format.dequant import dequantize

Q = GGMLQuantizationType
BATCHED = sorted(fused.int8_batched_types(), key=lambda t: t.name)
#: the batched types whose x is quantized to Q8_0 (the others: Q8_K)
Q8_0_X = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.MXFP4)
#: the Q8_0 types whose row loop takes per-lane offsets (:func:`int8.lane_offsets` by this)
LANE_OFFSETS = {Q.Q4_0: 8, Q.Q5_0: 16}


@pytest.fixture(autouse=True)
def int8_numba() -> Iterator[None]:
    fused.set_backend(None)
    fused.set_precision("int8")
    assert fused.backend().name == "numba", fused.backend().reason
    yield
    fused.set_precision(None)
    fused.set_backend(None)


def matrix(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    raw = sane_blocks(qtype, rows, cols, np.random.default_rng(seed)).reshape(rows, -1)
    raw.flags.writeable = False
    return raw


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # magnitudes spread over decades, as hidden states after a norm are not
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10.0, (n, cols))).astype(np.float32)
    x.flags.writeable = False
    return x


def test_the_batched_types() -> None:
    assert set(BATCHED) == {Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4}
    assert fused.INT8_BATCH_MAX == fused.SMALL_BATCH_MAX == 64


@pytest.mark.parametrize("qtype", BATCHED, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 15, 16, 33, 64])
def test_each_token_of_a_batch_is_bit_equal_to_the_token_alone(qtype: GGMLQuantizationType, n: int) -> None:
    rows, cols = 37, 1024
    raw = matrix(qtype, rows, cols, seed=n)
    xt = activations(n, cols, seed=100 + n)
    suffix = qtype.name.lower()
    together = np.empty((n, rows), np.float32)
    getattr(int8, f"matmat_int8_{suffix}")(raw, xt, together)
    via_linear = fused.linear(raw, qtype, (rows, cols), xt)
    via_rows = fused.linear_rows(raw, qtype, (rows, cols), xt)
    tiled = qtype in fused.tiled_types() and n >= fused.TILED_MIN_TOKENS  # llama.cpp's sums in another float order
    for t in range(n):
        alone = np.empty(rows, np.float32)
        getattr(int8, f"matvec_int8_{suffix}")(raw, xt[t], alone)
        np.testing.assert_array_equal(together[t], alone)
        np.testing.assert_array_equal(via_rows[t], alone)
        if tiled:
            assert rel_l2(via_linear[t], alone) <= 1e-6
        else:
            np.testing.assert_array_equal(via_linear[t], alone)
        # the same token at the head of a batch of one through linear: the one-token kernel
        np.testing.assert_array_equal(fused.linear(raw, qtype, (rows, cols), xt[t : t + 1])[0], alone)


@pytest.mark.parametrize("qtype", BATCHED, ids=lambda t: t.name)
def test_int8_batches_end_at_the_limit(qtype: GGMLQuantizationType) -> None:
    rows, cols = 16, 512
    raw = matrix(qtype, rows, cols, seed=5)
    n = fused.INT8_BATCH_MAX + 1
    x = activations(n, cols, seed=6)
    want = x.astype(np.float64) @ dequantize(raw, qtype, (rows, cols)).astype(np.float64).T
    alone = np.concatenate([fused.linear(raw, qtype, (rows, cols), x[t : t + 1]) for t in range(n)])
    above = fused.linear(raw, qtype, (rows, cols), x)  # the float kernels on x rounded as llama.cpp does
    assert not np.array_equal(above, alone) and rel_l2(above, alone) <= 1e-6
    batch = fused.linear_rows(raw, qtype, (rows, cols), x[:-1])
    np.testing.assert_array_equal(batch, alone[:-1])  # the int8 batch kernel up to the limit
    assert 1e-5 < rel_l2(batch, want[:-1]) <= INT8_RTOL


def _portable(qtype: GGMLQuantizationType) -> Callable[..., None]:
    """``matvec_int8_<type>`` compiled afresh (no cache) with the AVX2 intrinsics turned off."""
    import numba

    fn = {
        Q.Q4_0: rowdot_legacy.rowdot_q4_0,
        Q.Q5_0: rowdot_legacy.rowdot_q5_0,
        Q.Q8_0: rowdot.rowdot_q8_0,
        Q.Q2_K: rowdot.rowdot_q2_k,
        Q.Q3_K: rowdot.rowdot_q3_k,
        Q.Q4_K: rowdot.rowdot_q4_k,
        Q.Q5_K: rowdot.rowdot_q5_k,
        Q.Q6_K: rowdot.rowdot_q6_k,
        Q.IQ4_XS: rowdot.rowdot_iq4_xs,
        Q.MXFP4: rowdot.rowdot_mxfp4,
    }[qtype]

    if qtype in LANE_OFFSETS:

        @numba.njit(cache=False)
        def matvec_lanes(raw, q, d, offsets, out):  # type: ignore[no-untyped-def]
            for r in range(raw.shape[0]):
                out[r] = fn(raw[r], q, d, offsets, d.size)

        return matvec_lanes

    if qtype in Q8_0_X:

        @numba.njit(cache=False)
        def matvec0(raw, q, d, out):  # type: ignore[no-untyped-def]
            for r in range(raw.shape[0]):
                out[r] = fn(raw[r], q, d, d.size)

        return matvec0

    @numba.njit(cache=False)
    def matvec_k(raw, q, d, bsums, out):  # type: ignore[no-untyped-def]
        for r in range(raw.shape[0]):
            out[r] = fn(raw[r], q, d, bsums, d.size)

    return matvec_k


@pytest.mark.parametrize("qtype", BATCHED, ids=lambda t: t.name)
def test_portable_ir_gives_the_same_bits_as_avx2(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols = 29, 2048
    raw = matrix(qtype, rows, cols, seed=21)
    x = activations(1, cols, seed=22)[0]
    want = np.empty(rows, np.float32)
    getattr(int8, f"matvec_int8_{qtype.name.lower()}")(raw, x, want)
    monkeypatch.setattr(rowdot, "_avx2", lambda: False)
    kernel = _portable(qtype)
    got = np.empty(rows, np.float32)
    if qtype in Q8_0_X:
        q, d, s = np.empty(cols, np.int8), np.empty(cols // 32, np.float32), np.empty(cols // 32, np.float32)
        int8.quantize_q8_0(x, q, d, s)
        if qtype in LANE_OFFSETS:
            kernel(raw, q, d, int8.lane_offsets(q, np.int32(LANE_OFFSETS[qtype])), got)
        else:
            kernel(raw, q, d, got)
    else:
        q, d, b = np.empty(cols, np.int8), np.empty(cols // 256, np.float32), np.empty(cols // 16, np.int32)
        int8.quantize_q8_k(x, q, d, b)
        kernel(raw, q, d, b, got)
    assert "pmaddubsw" not in next(iter(kernel.inspect_asm().values()))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_several_tokens_of_a_row_portable_and_avx2_give_each_token_alone(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numba

    rows, cols, n = 11, 1024, rowdots.TOKENS + 1
    raw = matrix(qtype, rows, cols, seed=23)
    x = activations(n, cols, seed=24)
    alone = np.empty((n, rows), np.float32)
    for t in range(n):
        getattr(int8, f"matvec_int8_{qtype.name.lower()}")(raw, x[t], alone[t])
    q, d, b = np.empty((n, cols), np.int8), np.empty((n, cols // 256), np.float32), np.empty((n, cols // 16), np.int32)
    for t in range(n):
        int8.quantize_q8_k(x[t], q[t], d[t], b[t])
    fn = rowdots.rowdots_q4_k if qtype == Q.Q4_K else rowdots.rowdots_q5_k
    for avx2 in (True, False):
        if not avx2:
            monkeypatch.setattr(rowdot, "_avx2", lambda: False)

        @numba.njit(cache=False)
        def tokens(raw, q, d, b, t0, out):  # type: ignore[no-untyped-def]
            for r in range(raw.shape[0]):
                out[:, r] = np.asarray(fn(raw[r], q, d, b, d.shape[1], t0))

        got = np.empty((rowdots.TOKENS, rows), np.float32)
        tokens(raw, q, d, int8.bsum_pairs(b), 1, got)  # tokens 1..TOKENS: not from the first
        assert ("pmaddubsw" in next(iter(tokens.inspect_asm().values()))) == (avx2 and rowdot._avx2())
        np.testing.assert_array_equal(got, alone[1:])


def _blockwise_reference(raw: np.ndarray, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """The int8 formula in numpy (float64 sums): llama.cpp's ``ggml_vec_dot_<type>_q8_<0|K>``."""
    from test_kernels import q8_0_reference, q8_k_reference

    rows, cols = raw.shape[0], x.size
    weights = dequantize(raw, qtype, (rows, cols)).astype(np.float64)
    if qtype in Q8_0_X:
        q, d = q8_0_reference(x)
        xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32)
    else:
        q, d, _ = q8_k_reference(x)
        xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 256)
    return weights @ xq


@pytest.mark.parametrize("qtype", BATCHED, ids=lambda t: t.name)
def test_products_follow_the_int8_formula(qtype: GGMLQuantizationType) -> None:
    rows, cols = 64, 4096
    raw = matrix(qtype, rows, cols, seed=31)
    x = activations(1, cols, seed=32)
    got = fused.linear(raw, qtype, (rows, cols), x)[0]
    want = _blockwise_reference(raw, qtype, x[0])
    # the quantized x exactly, the weights exactly: only float32 accumulation differs
    assert rel_l2(got, want) <= 1e-6, qtype.name
    block_size, _ = GGML_QUANT_SIZES[qtype]
    assert cols % block_size == 0


@pytest.mark.parametrize("precision", ["float", "int8"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_large_products_split_over_an_existing_pool_give_the_same_bits(
    precision: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioexperts._compute import pool as pool_module

    fused.set_precision(precision)  # type: ignore[arg-type]
    monkeypatch.setattr(fused, "SPLIT_MIN_BYTES", 1 << 20)  # the default, pinned here
    rows, cols = 1031, 1024  # odd rows: uneven parts; 1.1 MB of Q8_0 >= SPLIT_MIN_BYTES
    raw = matrix(Q.Q8_0, rows, cols, seed=41)
    x = activations(n, cols, seed=42)
    monkeypatch.setattr(pool_module, "_pool", None)
    alone = fused.linear(raw, Q.Q8_0, (rows, cols), x)
    pool = pool_module.ComputePool(2, limit_native_threads=False)
    monkeypatch.setattr(pool_module, "_pool", pool)
    try:

        def hand_offs() -> int:  # a map, or for one int8 token a compiled fan-out
            stats = pool.statistics()
            return stats.maps + stats.fan_outs

        maps = hand_offs()
        split = fused.linear(raw, Q.Q8_0, (rows, cols), x)
        # float batches of a type without matrows: the blocked kernel, never split
        splits = precision == "int8" or n <= fused.MATVEC_MAX_TOKENS or Q.Q8_0 in fused.rows_types()
        assert hand_offs() == maps + splits
        maps = hand_offs()
        # split=False: a caller that splits the rows itself keeps the product on its thread
        inline = fused.linear(raw, Q.Q8_0, (rows, cols), x, split=False)
        assert hand_offs() == maps
        np.testing.assert_array_equal(inline, alone)
        small = matrix(Q.Q8_0, 64, cols, seed=43)
        fused.linear(small, Q.Q8_0, (64, cols), x)
        assert hand_offs() == maps  # small matrices stay on the calling thread
    finally:
        pool.close()
    np.testing.assert_array_equal(split, alone)


@pytest.mark.skipif(not rowdot._avx512bw(), reason="the 512-bit pairs need AVX-512BW")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_512_bit_pairs_give_the_256_bit_bits(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-token k-quant kernels take two 32-value pieces per 512-bit ``pmaddubsw``/``pmaddwd``
    where the CPU has AVX-512BW (:func:`rowdot.scaled_sums`): the same integers, so the same bits."""
    import re

    rows, cols = 37, 2048
    raw = matrix(qtype, rows, cols, seed=31)
    x = activations(1, cols, seed=32)[0]
    q, d, b = np.empty(cols, np.int8), np.empty(cols // 256, np.float32), np.empty(cols // 16, np.int32)
    int8.quantize_q8_k(x, q, d, b)
    results = {}
    for wide in (True, False):
        monkeypatch.setattr(rowdot, "_avx512bw", lambda wide=wide: wide)
        kernel = _portable(qtype)  # compiled now (no cache), with the flag of this pass
        got = np.empty(rows, np.float32)
        kernel(raw, q, d, b, got)
        asm = next(iter(kernel.inspect_asm().values()))
        assert bool(re.search(r"vpmaddubsw[^\n]*%zmm", asm)) == wide
        results[wide] = got
    np.testing.assert_array_equal(results[True], results[False])
