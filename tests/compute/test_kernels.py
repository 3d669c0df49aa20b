"""aioexperts._compute.fused with the numba kernels: exact dequantization and fused products.

Exact dequantization (its one entry, ``aioexperts._format.dequant.dequantize``, runs the compiled
kernels fused plugs in) must equal gguf-py bit for bit (random bytes, extreme f16 / e8m0 scales, every
16-bit pattern); the fused products (one token, small batches, prefill) must agree with a float64
product of the exactly dequantized matrix within 1e-5 relative, rows of any count, NaN and inf
included. numba is a required dependency: these tests fail (they do not skip) without it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from quantblocks import (
    EXTREME_E8M0,
    EXTREME_F16,
    F16_SCALES,
    assert_bit_exact,
    random_blocks,
    reference,
)

from aioexperts._compute import fused
from aioexperts._errors import ConfigError, FormatError
from aioexperts._format.dequant import dequantize

Q = GGMLQuantizationType
TYPES = sorted(fused.compiled_types(), key=lambda t: t.name)
#: F32 has no compiled kernel: BLAS multiplies a zero-copy view of its bytes
PRODUCT_TYPES = sorted([*TYPES, Q.F32], key=lambda t: t.name)
#: relative L2 error allowed for the float (fastmath) kernels against float64
FUSED_RTOL = 1e-5
#: token counts covering the three kernels and their edges
TOKEN_COUNTS = (1, 2, 3, 4, 5, 17, fused.SMALL_BATCH_MAX, fused.SMALL_BATCH_MAX + 1)


@pytest.fixture(autouse=True)
def numba_backend() -> Iterator[None]:
    fused.set_backend(None)
    fused.set_precision("float")  # the float kernels (tests/compute/test_llama_arithmetic.py: the default)
    assert fused.backend().name == "numba", fused.backend().reason
    yield
    fused.set_backend(None)
    fused.set_precision(None)


def test_the_fifteen_types_have_kernels_and_f32_goes_to_blas() -> None:
    assert {t.name for t in TYPES} == {
        "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
    }  # fmt: skip
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.array_equal(fused.linear(values, Q.F32, (2, 4), np.ones((1, 4), np.float32)), [[6.0, 22.0]])


# ----------------------------------------------------------------------------------------------
# exact dequantization


def check_exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    ours = dequantize(memoryview(raw).toreadonly(), qtype, shape)
    if qtype in fused.compiled_types():
        assert f"dequant_{qtype.name.lower()}" in fused.ready_kernels()  # the compiled kernel served
    assert_bit_exact(ours, reference(raw, qtype, shape))
    return ours


def test_the_one_dequantize_entry_runs_the_compiled_kernel_unless_told_not_to() -> None:
    raw = random_blocks(Q.Q4_K, 4, seed=3)
    numpy_values = dequantize(raw, Q.Q4_K, (2, 512), compiled=False)
    assert "dequant_q4_k" not in fused.ready_kernels()
    assert_bit_exact(dequantize(raw, Q.Q4_K, (2, 512)), numpy_values)
    assert "dequant_q4_k" in fused.ready_kernels()
    fused.set_backend("numpy")
    assert fused.ready_kernels() == frozenset()
    assert_bit_exact(dequantize(raw, Q.Q4_K, (2, 512)), numpy_values)
    assert fused.ready_kernels() == frozenset()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_exact_random_blocks(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    cols = block_size * max(1, 512 // block_size)
    for rows in (1, 7, 24):
        check_exact(random_blocks(qtype, rows * cols // block_size, seed=qtype.value + rows), qtype, (rows, cols))


@pytest.mark.parametrize("qtype", sorted(F16_SCALES, key=lambda t: t.name), ids=lambda t: t.name)
def test_exact_extreme_f16_scales(qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    offsets = F16_SCALES[qtype]
    combos = list(itertools.product(EXTREME_F16, repeat=len(offsets)))
    blocks = random_blocks(qtype, len(combos) * 2, seed=7).reshape(-1, type_size)
    for i, combo in enumerate(combos):
        for offset, bits in zip(offsets, combo, strict=True):
            blocks[2 * i : 2 * i + 2, offset : offset + 2] = np.array([bits], "<u2").view(np.uint8)
    values = check_exact(blocks.reshape(-1), qtype, (len(blocks), block_size))
    assert np.isnan(values).any()
    assert np.isinf(values).any()


def test_exact_extreme_e8m0_scales() -> None:
    block_size, type_size = GGML_QUANT_SIZES[Q.MXFP4]
    blocks = random_blocks(Q.MXFP4, len(EXTREME_E8M0) * 4, seed=8).reshape(-1, type_size)
    blocks[:, 0] = np.repeat(EXTREME_E8M0, 4)
    values = check_exact(blocks.reshape(-1), Q.MXFP4, (len(blocks), block_size))
    assert np.isinf(values).any()


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_exact_every_16_bit_pattern(qtype: GGMLQuantizationType) -> None:
    check_exact(np.arange(1 << 16, dtype=np.uint16).view(np.uint8), qtype, (256, 256))


def test_exact_f32_copies_and_out_parameter() -> None:
    values = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    out = np.full((4, 8), 7.0, np.float32)
    assert dequantize(values.tobytes(), Q.F32, (4, 8), out=out) is out
    np.testing.assert_array_equal(out, values)
    with pytest.raises(ConfigError):
        dequantize(values.tobytes(), Q.F32, (4, 8), out=np.empty((4, 16), np.float32)[:, ::2])


def test_exact_types_without_kernel_use_the_numpy_path() -> None:
    raw = random_blocks(Q.TQ2_0, 4, seed=9)
    block_size, _ = GGML_QUANT_SIZES[Q.TQ2_0]
    assert Q.TQ2_0 not in fused.compiled_types()
    assert_bit_exact(dequantize(raw, Q.TQ2_0, (2, 2 * block_size)), reference(raw, Q.TQ2_0, (2, 2 * block_size)))


# ----------------------------------------------------------------------------------------------
# fused products


def sane_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ggml bytes whose scales are finite and moderate (as in quantized models)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal(rows * cols).astype(np.float32)
        if qtype == Q.F32:
            return values.view(np.uint8)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = random_blocks(qtype, rows * cols // block_size, seed=int(rng.integers(1 << 30))).reshape(-1, type_size)
    for offset in F16_SCALES.get(qtype, ()):
        scales = rng.uniform(-2e-3, 2e-3, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(118, 124, len(blocks))
    return blocks.reshape(-1)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("qtype", PRODUCT_TYPES, ids=lambda t: t.name)
def test_fused_products_match_float64(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(qtype.value)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    for rows, cols in ((13, 2 * max(block_size, 256)), (8, 256)):
        raw = sane_blocks(qtype, rows, cols, rng)
        weights = reference(raw, qtype, (rows, cols)).astype(np.float64)
        for n in TOKEN_COUNTS:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            got = fused.linear(memoryview(raw).toreadonly(), qtype, (rows, cols), x)
            assert got.shape == (n, rows) and got.dtype == np.float32
            assert rel_l2(got, x.astype(np.float64) @ weights.T) <= FUSED_RTOL, (qtype.name, rows, cols, n)


#: MXFP4 has no NaN or inf scale (ggml reads e8m0 255 as 2**127): a huge finite scale overflows in
#: the dequantized weights but not always in the fused product, which applies the scale to a sum
NAN_INF_TYPES = [t for t in PRODUCT_TYPES if t != Q.MXFP4]


@pytest.mark.parametrize("qtype", NAN_INF_TYPES, ids=lambda t: t.name)
def test_fused_products_propagate_nan_and_inf(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(99)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 2 * max(block_size, 256)
    raw = sane_blocks(qtype, rows, cols, rng).reshape(rows, -1)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        specials = {Q.F32: (0x7FC00000, 0x7F800000), Q.F16: (0x7E00, 0x7C00), Q.BF16: (0x7FC0, 0x7F80)}[qtype]
        width = 4 if qtype == Q.F32 else 2
        raw[1, :width] = np.array([specials[0]], f"<u{width}").view(np.uint8)
        raw[4, width : 2 * width] = np.array([specials[1]], f"<u{width}").view(np.uint8)
    else:
        offset = F16_SCALES[qtype][0]
        raw[1, offset : offset + 2] = np.array([0x7E00], "<u2").view(np.uint8)  # NaN scale
        raw[4, offset : offset + 2] = np.array([0x7C00], "<u2").view(np.uint8)  # inf scale
    raw = raw.reshape(-1)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    with np.errstate(all="ignore"):
        want = x.astype(np.float64) @ reference(raw, qtype, (rows, cols)).astype(np.float64).T
    for n in (1, 3):
        got = fused.linear(raw, qtype, (rows, cols), x[:n])
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want[:n]))
        finite = np.isfinite(want[:n])
        assert rel_l2(got[finite], want[:n][finite]) <= FUSED_RTOL


def test_out_parameter_and_read_only_inputs() -> None:
    rng = np.random.default_rng(5)
    raw = sane_blocks(Q.Q4_K, 8, 512, rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x.flags.writeable = False
    out = np.full((3, 8), np.nan, np.float32)
    assert fused.linear(memoryview(raw).toreadonly(), Q.Q4_K, (8, 512), x, out=out) is out
    assert np.isfinite(out).all()
    empty = fused.linear(raw, Q.Q4_K, (8, 512), np.empty((0, 512), np.float32))
    assert empty.shape == (0, 8)


def test_unaligned_float_bytes_are_copied_not_misread() -> None:
    values = np.random.default_rng(6).standard_normal((4, 32)).astype(np.float32)
    buffer = np.zeros(values.nbytes + 1, np.uint8)
    buffer[1:] = values.view(np.uint8).reshape(-1)
    x = np.ones((1, 32), np.float32)
    got = fused.linear(buffer[1:], Q.F32, (4, 32), x)
    np.testing.assert_allclose(got[0], values.sum(axis=1), rtol=1e-5)


def test_errors() -> None:
    raw = random_blocks(Q.Q8_0, 4, seed=1)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(FormatError, match="needs 136 bytes, got 135"):
        fused.linear(raw[:-1], Q.Q8_0, (2, 64), x)
    with pytest.raises(FormatError, match="not a multiple of 32"):
        fused.linear(raw, Q.Q8_0, (4, 34), np.zeros((1, 34), np.float32))
    with pytest.raises(ConfigError, match=r"x must be a float32 array of shape \(n_tokens, 64\)"):
        fused.linear(raw, Q.Q8_0, (2, 64), np.zeros((1, 64), np.float64))
    with pytest.raises(ConfigError, match="out must be"):
        fused.linear(raw, Q.Q8_0, (2, 64), x, out=np.zeros((1, 3), np.float32))
    with pytest.raises(ConfigError, match="backend"):
        fused.set_backend("cuda")  # type: ignore[arg-type]


def test_forced_numpy_backend_gives_the_same_products() -> None:
    rng = np.random.default_rng(7)
    raw = sane_blocks(Q.Q6_K, 16, 512, rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    compiled = fused.linear(raw, Q.Q6_K, (16, 512), x)
    fused.set_backend("numpy")
    assert fused.backend().name == "numpy"
    numpy_path = fused.linear(raw, Q.Q6_K, (16, 512), x)
    assert rel_l2(compiled, numpy_path.astype(np.float64)) <= FUSED_RTOL
    assert fused.warmup([Q.Q6_K]).kernels == ()


def test_warmup_reports_the_kernels() -> None:
    report = fused.warmup([Q.Q4_K, Q.F32, Q.TQ2_0])
    assert report.backend.name == "numba"
    assert report.types == ("F32", "Q4_K", "TQ2_0")
    assert set(report.kernels) == {f"{k}_q4_k" for k in ("matvec", "matmat", "dequant", "matrows")}
    assert report.loaded + report.compiled <= len(report.kernels)
    again = fused.warmup([Q.Q4_K])
    assert again.loaded == again.compiled == 0  # ready in this process: nothing to do


# ----------------------------------------------------------------------------------------------
# the int8 precision (x quantized like llama.cpp)

#: relative L2 error allowed for the int8 one-token kernels: the rounding of x to 8 bits (llama.cpp's
#: own kernels differ from a float64 product by about as much; the goldens allow 4e-2)
INT8_RTOL = 2e-2
INT8_TYPES = sorted(fused.int8_types(), key=lambda t: t.name)


@pytest.fixture
def int8_precision() -> Iterator[None]:
    fused.set_precision("int8")
    yield
    fused.set_precision(None)


def test_int8_covers_every_quantized_type() -> None:
    assert set(INT8_TYPES) == set(TYPES) - {Q.F16, Q.BF16}
    fused.set_precision(None)
    assert fused.precision() == "int8"  # the default


@pytest.mark.usefixtures("int8_precision")
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_int8_products_are_close_for_every_batch_size(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(qtype.value + 1000)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 24, 2 * max(block_size, 256)
    raw = sane_blocks(qtype, rows, cols, rng)
    weights = reference(raw, qtype, (rows, cols)).astype(np.float64)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    want = x.astype(np.float64) @ weights.T
    for n in (1, 2):
        error = rel_l2(fused.linear(raw, qtype, (rows, cols), x[:n]), want[:n])
        assert 1e-5 < error <= INT8_RTOL, (qtype.name, n, error)  # really the int8 kernel, and close
    error = rel_l2(fused.linear(raw, qtype, (rows, cols), x), want)
    assert 1e-5 < error <= INT8_RTOL, (qtype.name, 3, error)  # batches too (llama.cpp's rounding)


def q8_k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row_q8_K_ref`` of llama.cpp, in numpy: int8 codes, scales, sums of 16."""
    blocks = x.reshape(-1, 256)
    q = np.zeros(blocks.shape, np.int8)
    d = np.zeros(len(blocks), np.float32)
    for b, values in enumerate(blocks):
        index = int(np.argmax(np.abs(values)))
        if values[index] == 0:
            continue
        iscale = np.float32(-127.0) / values[index]
        q[b] = np.minimum(127, np.rint(iscale * values)).astype(np.int8)
        d[b] = np.float32(1.0) / iscale
    return q.reshape(-1), d, q.reshape(-1, 16).astype(np.int32).sum(axis=1)


def q8_0_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x86 (AVX2) ``quantize_row_q8_0`` of llama.cpp, in numpy: int8 codes and float16-rounded scales."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = amax / np.float32(127.0)
    inverse = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse[:, None]).astype(np.int8)  # _mm256_round_ps: half to even
    return q.reshape(-1), d.astype(np.float16).astype(np.float32)


def test_int8_quantizers_follow_llama_cpp() -> None:
    from aioexperts._compute.kernels import int8

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(1024) * rng.uniform(0.01, 10, 1024)).astype(np.float32)
    x[256:512] = 0.0  # an all-zero block
    x[7] = -40.0  # the value of largest magnitude is negative in block 0
    q = np.empty(1024, np.int8)
    d = np.empty(4, np.float32)
    bsums = np.empty(64, np.int32)
    int8.quantize_q8_k(x, q, d, bsums)
    want_q, want_d, want_sums = q8_k_reference(x)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(bsums, want_sums)
    q0 = np.empty(1024, np.int8)
    d0 = np.empty(32, np.float32)
    s0 = np.empty(32, np.float32)
    int8.quantize_q8_0(x, q0, d0, s0)
    want_q0, want_d0 = q8_0_reference(x)
    np.testing.assert_array_equal(q0, want_q0)
    np.testing.assert_array_equal(d0, want_d0)
    sums = (want_q0.reshape(-1, 32).astype(np.int32).sum(axis=1) * want_d0).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(s0, sums, rtol=2e-3)  # ggml rounds d * sum(q) from the unrounded d


def test_precision_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="precision"):
        fused.set_precision("int4")  # type: ignore[arg-type]
    monkeypatch.setenv("AIOEXPERTS_PRECISION", "int8")
    fused.set_precision(None)
    try:
        assert fused.precision() == "int8"
        monkeypatch.setenv("AIOEXPERTS_PRECISION", "half")
        fused.set_precision(None)
        with pytest.raises(ConfigError, match="AIOEXPERTS_PRECISION"):
            fused.precision()
    finally:
        monkeypatch.delenv("AIOEXPERTS_PRECISION")
        fused.set_precision(None)
    assert fused.precision() == "int8"


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_with_columns_off_the_vector_width(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(21)
    for rows, cols in ((3, 1), (5, 40), (7, 100)):
        raw = sane_blocks(qtype, rows, cols, rng)
        check_exact(raw, qtype, (rows, cols))
        weights = reference(raw, qtype, (rows, cols)).astype(np.float64)
        for n in (1, 3, 70):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            assert rel_l2(fused.linear(raw, qtype, (rows, cols), x), x.astype(np.float64) @ weights.T) <= FUSED_RTOL


@pytest.mark.parametrize(
    "n_tokens", [1, 2, fused.MATVEC_MAX_TOKENS + 1, fused.SMALL_BATCH_MAX, fused.SMALL_BATCH_MAX + 1]
)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_out_may_be_x_itself(n_tokens: int, backend: str) -> None:
    """``out=x`` for a square matrix: the kernels must not read rows of ``x`` they already wrote."""
    rng = np.random.default_rng(n_tokens)
    raw = sane_blocks(Q.Q4_K, 256, 256, rng)
    x = rng.standard_normal((n_tokens, 256)).astype(np.float32)
    fused.set_backend(backend)  # type: ignore[arg-type]
    want = fused.linear(raw, Q.Q4_K, (256, 256), x.copy())
    got = fused.linear(raw, Q.Q4_K, (256, 256), x, out=x)
    assert got is x
    np.testing.assert_array_equal(got, want)
    buffer = rng.standard_normal(n_tokens * 256 + 128).astype(np.float32)
    x, out = buffer[: n_tokens * 256].reshape(n_tokens, 256), buffer[128:].reshape(n_tokens, 256)
    want = fused.linear(raw, Q.Q4_K, (256, 256), x.copy())
    np.testing.assert_array_equal(fused.linear(raw, Q.Q4_K, (256, 256), x, out=out), want)  # overlapping by half a row


@pytest.mark.parametrize("precision", ["float", "int8"])
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_out_may_overlap_the_weights(n_tokens: int, precision: str) -> None:
    """``out`` over the last weight rows: the kernels must not read rows they already overwrote."""
    rng = np.random.default_rng(7 + n_tokens)
    raw = sane_blocks(Q.Q4_K, 256, 256, rng).reshape(-1)
    x = rng.standard_normal((n_tokens, 256)).astype(np.float32)
    fused.set_precision(precision)  # type: ignore[arg-type]
    try:
        want = fused.linear(raw, Q.Q4_K, (256, 256), x)
        buffer = raw.copy()
        out = buffer[buffer.size - n_tokens * 256 * 4 :].view(np.float32).reshape(n_tokens, 256)
        got = fused.linear(buffer, Q.Q4_K, (256, 256), x, out=out)
    finally:
        fused.set_precision(None)
    assert got is out
    np.testing.assert_array_equal(got, want)
