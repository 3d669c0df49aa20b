"""llama.cpp's arithmetic (the default ``"int8"`` precision) against a literal numpy reference.

The reference follows ggml line by line: ``quantize_row_q8_K_ref`` (ggml-quants.c) and the x86
``quantize_row_q8_0`` / ``quantize_row_q8_1`` (ggml-cpu/arch/x86/quants.c, AVX2), written as scalar
loops over each block, then ``ggml_vec_dot_<type>_q8_<K|0|1>``'s sum over blocks of
``d_w * d_x * sum(q_w * q_x)`` (minus the minimum terms), computed here as the float64 product of the
exactly dequantized weights with ``d_x * q_x``, plus ``m_w * s_x`` for Q4_1/Q5_1 where ggml uses the
float16 block sum ``s_x``. Every kernel path (one token, int8 batches, the float kernels on the round
trip for batches and prefill, the numpy backend) must give those numbers to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from quantblocks import reference
from test_kernels import rel_l2, sane_blocks

from aioexperts._compute import activations, fused

Q = GGMLQuantizationType
QUANTIZED = sorted(fused.int8_types(), key=lambda t: t.name)
#: tokens: the one-token kernels, int8 batches, the float kernels' small batches and prefill
TOKENS = (1, 2, 3, 17, fused.SMALL_BATCH_MAX + 6)
#: float32 accumulation of a 512-wide product against float64
FLOAT_RTOL = 2e-6


@pytest.fixture(autouse=True)
def llama_precision() -> Iterator[None]:
    fused.set_precision(None)
    assert fused.precision() == "int8"  # the default
    yield
    fused.set_backend(None)
    fused.set_precision(None)


def nearest_int(value: np.float32) -> int:
    """ggml-quants.c ``nearest_int``: add 1.5 * 2**23 in float32 and read the mantissa bits."""
    shifted = np.float32(value) + np.float32(12582912.0)
    return int(np.array([shifted], np.float32).view(np.int32)[0] & 0x007FFFFF) - 0x00400000


def q8_k_literal(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` then ``d * q`` (float64), one scalar loop per block."""
    out = np.zeros(x.size, np.float64)
    for b in range(x.size // 256):
        block = x[b * 256 : (b + 1) * 256]
        amax, vmax = np.float32(0), np.float32(0)
        for v in block:
            if abs(v) > amax:
                amax, vmax = abs(v), v
        if not amax:
            continue
        iscale = np.float32(-127.0) / vmax
        q = [min(127, nearest_int(iscale * v)) for v in block]
        d = np.float32(1.0) / iscale
        out[b * 256 : (b + 1) * 256] = np.float64(d) * np.array(q, np.float64)
    return out


def q8_0_literal(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x86 AVX2 ``quantize_row_q8_1``: ``(fp16(d) * q`` float64, ``s`` per block); Q8_0 is its first half."""
    out = np.zeros(x.size, np.float64)
    sums = np.zeros(x.size // 32, np.float64)
    for b in range(x.size // 32):
        block = x[b * 32 : (b + 1) * 32]
        max_scalar = np.float32(0)
        for v in block:
            max_scalar = max(max_scalar, abs(v))
        d = max_scalar / np.float32(127.0)
        inverse = np.float32(127.0) / max_scalar if max_scalar != 0 else np.float32(0.0)
        q = [int(np.rint(np.float32(v * inverse))) for v in block]  # _mm256_round_ps, nearest even
        q = [max(-128, min(127, v)) for v in q]  # _mm256_packs: saturate
        d16 = np.float64(np.float16(d))
        out[b * 32 : (b + 1) * 32] = d16 * np.array(q, np.float64)
        sums[b] = np.float64(np.float16(d * np.float32(sum(q))))
    return out, sums


def ggml_product(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
    """``ggml_mul_mat`` on the CPU, in float64 from the literal quantization of each row of ``x``."""
    rows, cols = shape
    weights = reference(raw, qtype, shape).astype(np.float64)
    out = np.empty((len(x), rows), np.float64)
    for t, row in enumerate(x):
        target = activations.vec_dot_type(qtype)
        if target == Q.Q8_K:
            out[t] = weights @ q8_k_literal(row)
            continue
        xq, sums = q8_0_literal(row)
        out[t] = weights @ xq
        if target == Q.Q8_1:  # ggml_vec_dot_q4_1_q8_1: m_w * s_x, not m_w * sum(d_x * q_x)
            blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
            mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float64)
            out[t] += mins @ (sums - xq.reshape(-1, 32).sum(axis=1))
    return out


def activations_for(cols: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 4.0, (n, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero Q8_0 block
    x[-1, 5] = -30.0  # a negative value of largest magnitude (Q8_K keeps its sign)
    return x


def test_every_quantized_type_has_its_vec_dot_type() -> None:
    assert {activations.vec_dot_type(t) for t in QUANTIZED} == {Q.Q8_K, Q.Q8_0, Q.Q8_1}
    assert activations.vec_dot_type(Q.Q4_K) == Q.Q8_K and activations.vec_dot_type(Q.IQ4_XS) == Q.Q8_K
    assert activations.vec_dot_type(Q.MXFP4) == Q.Q8_0 and activations.vec_dot_type(Q.Q5_1) == Q.Q8_1
    assert activations.vec_dot_type(Q.F32) == Q.F32


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_products_are_ggml_s_integer_products(qtype: GGMLQuantizationType, backend: str) -> None:
    rows, cols = 24, 512
    rng = np.random.default_rng(qtype.value + 300)
    raw = sane_blocks(qtype, rows, cols, rng)
    x = activations_for(cols, max(TOKENS), qtype.value)
    want = ggml_product(raw, qtype, (rows, cols), x)
    fused.set_backend(backend)  # type: ignore[arg-type]
    for n in TOKENS:
        got = fused.linear(raw, qtype, (rows, cols), x[:n])
        for t in range(n):
            assert rel_l2(got[t], want[t]) <= FLOAT_RTOL, (qtype.name, backend, n, t, rel_l2(got[t], want[t]))
        rows_alone = fused.linear_rows(raw, qtype, (rows, cols), x[:n])
        assert rel_l2(rows_alone, want[:n]) <= FLOAT_RTOL


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_weights_see_activations_rounded_to_their_type(qtype: GGMLQuantizationType) -> None:
    rows, cols = 16, 256
    raw = sane_blocks(qtype, rows, cols, np.random.default_rng(5))
    x = activations_for(cols, max(TOKENS), 6)
    weights = reference(raw, qtype, (rows, cols)).astype(np.float64)
    want = activations.round_activations(x, qtype).astype(np.float64) @ weights.T
    assert rel_l2(x.astype(np.float64) @ weights.T, want) > 1e-4  # the rounding shows
    for n in TOKENS:
        assert rel_l2(fused.linear(raw, qtype, (rows, cols), x[:n]), want[:n]) <= FLOAT_RTOL


def test_the_float_option_keeps_float32_activations() -> None:
    rows, cols = 16, 512
    raw = sane_blocks(Q.Q4_K, rows, cols, np.random.default_rng(7))
    x = activations_for(cols, 3, 8)
    exact = x.astype(np.float64) @ reference(raw, Q.Q4_K, (rows, cols)).astype(np.float64).T
    assert rel_l2(fused.linear(raw, Q.Q4_K, (rows, cols), x), exact) > 1e-4  # int8: llama.cpp's rounding
    fused.set_precision("float")
    assert rel_l2(fused.linear(raw, Q.Q4_K, (rows, cols), x), exact) <= 1e-5


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_non_finite_activations_stay_non_finite(qtype: GGMLQuantizationType) -> None:
    """The 8-bit quantizers must not turn NaN or inf into finite codes (a wrong answer)."""
    rows, cols = 8, 512
    raw = sane_blocks(qtype, rows, cols, np.random.default_rng(9))
    for n in (1, 2, 3, 20):
        x = activations_for(cols, n, 10)
        x[n - 1, 7] = np.nan if n % 2 else np.inf
        out = fused.linear(raw, qtype, (rows, cols), x)
        assert not np.isfinite(out[n - 1]).any(), (qtype.name, n)
        assert np.isfinite(out[: n - 1]).all()
