"""aioexperts._format.dequant: every fast kernel is bit-exact with gguf-py's ``gguf.quants.dequantize``.

Random blocks, blocks whose f16 / e8m0 scale fields hold extreme bit patterns (inf, NaN, subnormal,
max, negative zero), several shapes, the chunk loop, the ``out=`` path, three hand-computed traps,
the fallback to gguf-py and the errors for bad input.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from quantblocks import EXTREME_E8M0, EXTREME_F16, F16_SCALES, assert_bit_exact, random_blocks, reference

from aioexperts._errors import ConfigError, FormatError, UnsupportedTypeError
from aioexperts._format import dequant
from aioexperts._format.dequant import dequantize, supported_types

Q = GGMLQuantizationType

REQUIRED = {
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
    Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
}  # fmt: skip
KERNEL_TYPES = sorted(supported_types(), key=lambda t: t.name)


@pytest.fixture(autouse=True, scope="module")
def numpy_kernels() -> Iterator[None]:
    """These tests are of the numpy kernels: take out the compiled ones ``_compute.fused`` plugs in."""
    plugged = dequant._Plugged.accelerator
    dequant.set_accelerator(None)
    yield
    dequant.set_accelerator(plugged)


def check(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    ours = dequantize(memoryview(raw).toreadonly(), qtype, shape)
    assert_bit_exact(ours, reference(raw, qtype, shape))
    return ours


# ----------------------------------------------------------------------------------------------
# registry


def test_supported_types_cover_the_required_kernels() -> None:
    assert REQUIRED <= supported_types()
    assert isinstance(supported_types(), frozenset)
    assert set(dequant.__all__) == {
        "Accelerator", "check_out", "dequantize", "set_accelerator", "supported_types", "tensor_bytes",
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------
# bit-exactness


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_random_blocks(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    cols = block_size * max(1, 512 // block_size)
    rows = 24
    check(random_blocks(qtype, rows * cols // block_size, seed=qtype.value), qtype, (rows, cols))


@pytest.mark.parametrize("qtype", sorted(F16_SCALES, key=lambda t: t.name), ids=lambda t: t.name)
def test_extreme_f16_scales(qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    offsets = F16_SCALES[qtype]
    combos = list(itertools.product(EXTREME_F16, repeat=len(offsets)))
    blocks = random_blocks(qtype, len(combos) * 2, seed=7).reshape(-1, type_size)
    for i, combo in enumerate(combos):
        for offset, bits in zip(offsets, combo, strict=True):
            blocks[2 * i : 2 * i + 2, offset : offset + 2] = np.array([bits], "<u2").view(np.uint8)
    values = check(blocks.reshape(-1), qtype, (len(blocks), block_size))
    assert np.isnan(values).any()
    assert np.isinf(values).any()


def test_extreme_e8m0_scales() -> None:
    qtype = Q.MXFP4
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, len(EXTREME_E8M0) * 4, seed=8).reshape(-1, type_size)
    blocks[:, 0] = np.repeat(EXTREME_E8M0, 4)
    values = check(blocks.reshape(-1), qtype, (len(blocks), block_size))
    assert np.isinf(values).any()  # 2**127 * 12 overflows, as in the reference


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern(qtype: GGMLQuantizationType) -> None:
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    check(raw, qtype, (256, 256))


def test_f16_without_specials_and_with_daz_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    bits = np.random.default_rng(3).integers(0, 0x7C00, 4096, dtype=np.uint16)
    bits[::2] |= 0x8000
    raw = bits.view(np.uint8)
    check(raw, Q.F16, (64, 64))
    # if denormals-are-zero were on, the multiply trick would flush subnormals: the table is used
    monkeypatch.setattr(dequant, "_TINY", np.zeros(1, dtype=np.float32))
    check(raw, Q.F16, (64, 64))


@given(data=st.data())
@settings(max_examples=40, deadline=None, database=None)
def test_hypothesis_blocks(data: st.DataObject) -> None:
    qtype = data.draw(st.sampled_from(KERNEL_TYPES))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = data.draw(st.integers(1, 4))
    size = n_blocks * type_size
    raw = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
    check(raw, qtype, (n_blocks * block_size,))


# ----------------------------------------------------------------------------------------------
# shapes, chunks, out=


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_shapes(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    for shape in [(block_size,), (1, block_size), (37, 3 * block_size), (2, 3, 2 * block_size)]:
        n_blocks = int(np.prod(shape)) // block_size
        check(random_blocks(qtype, n_blocks, seed=n_blocks), qtype, shape)
    empty = dequantize(b"", qtype, (0, block_size))  # gguf-py cannot do this one
    assert empty.shape == (0, block_size)
    assert empty.dtype == np.float32


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_chunk_loop(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small chunks with a ragged last one give the same bits as one pass."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    monkeypatch.setattr(dequant, "_CHUNK_VALUES", 3 * 256)
    check(random_blocks(qtype, 11 * 256 // block_size, seed=5), qtype, (11, 256))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_out_parameter(qtype: GGMLQuantizationType) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    shape = (5, 2 * block_size)
    raw = random_blocks(qtype, 10, seed=11)
    out = np.full(shape, 1234.5, dtype=np.float32)
    result = dequantize(memoryview(raw), qtype, shape, out=out)
    assert result is out
    assert_bit_exact(out, reference(raw, qtype, shape))


def test_bad_out_arrays() -> None:
    raw = random_blocks(Q.Q8_0, 2, seed=1)
    for out in [
        np.empty((2, 32), np.float64),
        np.empty((64,), np.float32),
        np.empty((2, 64), np.float32)[:, ::2],
        "not an array",
    ]:
        with pytest.raises(ConfigError):
            dequantize(raw, Q.Q8_0, (2, 32), out=out)  # type: ignore[arg-type]
    readonly = np.empty((2, 32), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ConfigError):
        dequantize(raw, Q.Q8_0, (2, 32), out=readonly)


def test_f32_is_a_zero_copy_view() -> None:
    values = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    raw = values.tobytes()
    view = memoryview(raw)
    result = dequantize(view, Q.F32, (4, 8))
    assert np.shares_memory(result, np.frombuffer(raw, np.uint8))
    assert not result.flags.writeable
    np.testing.assert_array_equal(result, values)
    out = np.empty((4, 8), np.float32)
    assert dequantize(view, Q.F32, (4, 8), out=out) is out
    np.testing.assert_array_equal(out, values)


def test_accepts_arrays_bytes_and_ints() -> None:
    raw = random_blocks(Q.Q4_K, 3, seed=4)
    expected = reference(raw, Q.Q4_K, (3, 256))
    for data in (raw, raw.tobytes(), bytearray(raw.tobytes()), raw.view(np.uint32)):
        assert_bit_exact(dequantize(data, int(Q.Q4_K), [3, 256]), expected)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# traps


def _f16(value: float) -> bytes:
    return np.float16(value).tobytes()


def test_trap_q4_k_mixed_scale_bits() -> None:
    """d = dmin = 1, scales C1 00 00 00 02 00 00 00 53 00 00 00, every quant byte 0x11 (q = 1).

    get_scale_min_k4: sc0 = 0xC1 & 63 = 1, m0 = 2; sc4 = (0x53 & 15) | (0xC1 >> 6) << 4 = 51,
    m4 = 0x53 >> 4 = 5; every other scale and min is 0. So sub-block 0 (values 0..31) is
    1 * 1 - 2 = -1, sub-block 4 (values 128..159) is 51 * 1 - 5 = 46, and the other six sub-blocks
    are 0 * 1 - 0 = +0.0 exactly.
    """
    scales = bytes.fromhex("C1 00 00 00 02 00 00 00 53 00 00 00")
    block = _f16(1.0) + _f16(1.0) + scales + b"\x11" * 128
    assert len(block) == GGML_QUANT_SIZES[Q.Q4_K][1]
    raw = np.frombuffer(block, np.uint8)
    for y in (dequantize(memoryview(block), Q.Q4_K, (256,)), reference(raw, Q.Q4_K, (256,))):
        assert y[0] == -1
        assert y[128] == 46
        expected = np.zeros(256, np.float32)
        expected[0:32] = -1
        expected[128:160] = 46
        np.testing.assert_array_equal(y, expected)
        assert not np.signbit(y[expected == 0]).any()


def test_trap_iq4_xs_high_scale_bits() -> None:
    """d = 1, scales_h = 2, scales_l[0] = 0x01, qs[0] = 0xF0: sub-block 0 scale (1 | 2 << 4) - 32 = 1."""
    block = _f16(1.0) + np.uint16(2).tobytes() + bytes([0x01, 0, 0, 0]) + bytes([0xF0]) + bytes(127)
    assert len(block) == GGML_QUANT_SIZES[Q.IQ4_XS][1]
    raw = np.frombuffer(block, np.uint8)
    ours = dequantize(memoryview(block), Q.IQ4_XS, (256,))
    ref = reference(raw, Q.IQ4_XS, (256,))
    for y in (ours, ref):
        assert y[0] == -127  # low nibble 0 -> kvalues[0]
        assert y[16] == 113  # high nibble 15 -> kvalues[15]
        assert y[1] == -127
        assert y[32] == -32 * -127  # sub-block 1: scale code 0 -> -32
    assert_bit_exact(ours, ref)


def test_trap_mxfp4_scale_128() -> None:
    """e8m0 128 -> d = 1.0 (the half scale of 2**1), qs[0] = 0x72: kvalues[2] = 2, kvalues[7] = 12."""
    block = bytes([128, 0x72]) + bytes(15)
    raw = np.frombuffer(block, np.uint8)
    ours = dequantize(memoryview(block), Q.MXFP4, (32,))
    ref = reference(raw, Q.MXFP4, (32,))
    for y in (ours, ref):
        assert y[0] == 2
        assert y[16] == 12
        assert y[1] == 0
    assert_bit_exact(ours, ref)


# ----------------------------------------------------------------------------------------------
# fallback and errors


#: types without a kernel here (Q1_0 only from gguf 0.19: tests/format also runs against 0.18.0)
FALLBACK_TYPES = [getattr(Q, name) for name in ("TQ2_0", "IQ2_XXS", "Q1_0") if hasattr(Q, name)]


@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda t: t.name)
def test_fallback_to_gguf(qtype: GGMLQuantizationType) -> None:
    assert qtype not in supported_types()
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4, seed=9)
    try:
        expected = reference(raw, qtype, (2, 2 * block_size))
    except NotImplementedError:
        with pytest.raises(UnsupportedTypeError):
            dequantize(raw, qtype, (2, 2 * block_size))
        return
    assert_bit_exact(dequantize(raw, qtype, (2, 2 * block_size)), expected)
    out = np.empty((2, 2 * block_size), np.float32)
    assert dequantize(raw, qtype, (2, 2 * block_size), out=out) is out
    assert dequantize(raw[:0], qtype, (0, block_size)).shape == (0, block_size)


def test_wrong_byte_length() -> None:
    raw = random_blocks(Q.Q4_K, 3, seed=1)
    with pytest.raises(FormatError, match=r"3 blocks of 144 bytes = 432 bytes, got 431") as info:
        dequantize(raw[:-1], Q.Q4_K, (3, 256))
    assert isinstance(info.value, ValueError)
    with pytest.raises(FormatError, match="got 432"):
        dequantize(raw, Q.Q4_K, (2, 256))


def test_last_dim_not_a_multiple_of_the_block() -> None:
    raw = random_blocks(Q.Q8_0, 4, seed=1)
    with pytest.raises(FormatError, match=r"last dim 100 is not a multiple of the block size 32"):
        dequantize(raw, Q.Q8_0, (1, 100))
    with pytest.raises(FormatError, match="block size 256"):
        dequantize(raw, Q.Q6_K, (2, 128))


def test_bad_shapes_and_data() -> None:
    raw = random_blocks(Q.Q8_0, 1, seed=1)
    for shape in [(), (-1, 32), ("a",)]:
        with pytest.raises(FormatError):
            dequantize(raw, Q.Q8_0, shape)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="C-contiguous"):
        dequantize(np.zeros((2, 34), np.uint8).T, Q.Q8_0, (2, 32))


@pytest.mark.parametrize("ggml_type", [Q.Q8_K, Q.I32, Q.F64, 9999], ids=str)
def test_unsupported_types(ggml_type: GGMLQuantizationType | int) -> None:
    with pytest.raises(UnsupportedTypeError):
        dequantize(np.zeros(1024, np.uint8), ggml_type, (1,))  # type: ignore[arg-type]
