"""Dequantize raw ggml blocks to float32 with vectorized numpy kernels.

:func:`dequantize` turns the bytes of one tensor (usually one expert projection, viewed zero-copy from
an mmap slab) into a float32 array. Every type in :func:`supported_types` has a dedicated kernel,
picked from a registry keyed by ggml type (the gguf-py layout: one kernel per type, mapping
``(n_blocks, type_size)`` uint8 blocks to ``(n_blocks, block_size)`` float32 values). Any other type
that ``gguf.quants`` can dequantize falls back to it; the rest raise :class:`UnsupportedTypeError`.

It is the one dequantize entry of the package, for the store (row views) and the compute layer
alike. The compute layer plugs its compiled kernels in from above (:func:`set_accelerator`, done by
:mod:`aioexperts._compute.fused` when it is imported); then the types they cover run compiled, bit for
bit the same, and everything else (and every type while numba cannot serve) runs the numpy kernels
here. The arguments are checked here, once, before either runs.

The kernels are bit-exact with ``gguf.quants.dequantize`` (gguf-py ``quants.py``, itself a port of
llama.cpp ``ggml-quants.c`` ``dequantize_row_*``): every float32 result comes out of the same float32
operations on the same operands, or out of a product that is exact in float32 whatever the order
(for instance ``d * sc * q`` when the three factors have few enough significant bits), so values,
signed zeros, infinities and NaN positions all match, even for inf/NaN/subnormal scale bytes.

How they are fast, in numpy alone:

* Bit fields are unpacked SWAR-style on uint64 words (eight 4-bit or 2-bit codes per operation) into
  a code buffer that is already in output order; whole 16- to 64-byte groups are moved with ``V``
  dtype views, so no numpy call has an inner loop of a few elements (numpy pays a few ns per inner
  loop call, which is what makes naive per-block code slow).
* 4-bit codebook types (IQ4_NL, IQ4_XS, MXFP4) gather float32 *pairs* with ``np.take``, indexed by a
  uint16 lane of two codes; MXFP4 (power-of-two scales) and IQ4_XS (6-bit sub-block scales) put the
  scale code in the lane's free bits, so the gather yields scaled values.
* Scales are applied in place in ``out``, broadcast over their block by reshape
  (``out.reshape(-1, 32) *= d[:, None]``) or, for small groups, through ``np.repeat``; f16 scales
  are decoded with a 65536-entry lookup table, whole f16 tensors with integer bit operations.
* Work proceeds in chunks of about 2**19 values: big enough that the fixed cost of the ~20-50
  numpy calls per chunk stays small, small enough that the scratch arrays are served from the
  malloc heap instead of fresh (page-faulting) mmaps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as _gguf_dequantize

from .._errors import ConfigError, FormatError, UnsupportedTypeError

__all__ = ("Accelerator", "check_out", "dequantize", "set_accelerator", "supported_types", "tensor_bytes")

_T = GGMLQuantizationType
_Kernel = Callable[[np.ndarray, np.ndarray], None]

Accelerator = Callable[[np.ndarray, GGMLQuantizationType, int, int, np.ndarray], bool]
"""``(raw, ggml_type, rows, cols, out) -> served``: a faster exact kernel for one checked tensor.

``raw`` is the tensor's bytes (uint8, C-contiguous, the size checked), ``out`` a C-contiguous
writeable ``(rows, cols)`` float32 array to fill; False (no kernel for the type, or the kernels
cannot serve) lets the numpy kernels run.
"""


class _Plugged:
    accelerator: Accelerator | None = None


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Plug in (or, with None, take out) the compiled kernels :func:`dequantize` tries first."""
    _Plugged.accelerator = accelerator


_KERNELS: dict[GGMLQuantizationType, _Kernel] = {}

_U8 = np.uint8
_U16 = np.uint16
_U32 = np.uint32
_U64 = np.uint64
_F32 = np.float32

# SWAR masks over uint64 words.
_NIB = _U64(0x0F0F_0F0F_0F0F_0F0F)  # low nibble of each byte
_B2 = _U64(0x0303_0303_0303_0303)  # low 2 bits of each byte
_B1 = _U64(0x0101_0101_0101_0101)  # low bit of each byte
_BIT_OF_BYTE = _U64(0x8040_2010_0804_0201)  # byte j keeps bit j
_B7F = _U64(0x7F7F_7F7F_7F7F_7F7F)
_B80 = _U64(0x8080_8080_8080_8080)

# Chunking: about this many output values per kernel call.
_CHUNK_VALUES = 1 << 19

_KVALUES_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def supported_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types that have a dedicated vectorized kernel here.

    Returns:
        A frozenset of :class:`gguf.GGMLQuantizationType`. Other types that ``gguf.quants`` can
        dequantize still work through :func:`dequantize`, only slower.
    """
    return frozenset(_KERNELS)


def dequantize(
    data: memoryview | np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    out: np.ndarray | None = None,
    *,
    compiled: bool = True,
) -> np.ndarray:
    """Dequantize the raw ggml bytes of one tensor to float32.

    Bit-exact with ``gguf.quants.dequantize`` (gguf-py ``quants.py``; llama.cpp ``ggml-quants.c``
    ``dequantize_row_*``) for every type, NaN positions and signed zeros included. The compiled
    kernels plugged in with :func:`set_accelerator` run where they serve the type, else the numpy
    kernels of this module.

    Args:
        data: the tensor bytes in ggml block layout, e.g. a read-only ``memoryview`` of format
            ``'B'`` into an mmap slab, or a C-contiguous numpy array (any dtype; its bytes are
            used). Never copied: it is read through ``np.frombuffer``.
        ggml_type: the ggml type of the bytes (a :class:`gguf.GGMLQuantizationType` or its int).
        shape: the tensor shape in numpy order (row-major, last dim fastest); the last dim must
            be a multiple of the type's block size.
        out: optional float32 C-contiguous writeable array of ``shape`` to write into.
        compiled: False runs the numpy kernels even where compiled ones serve (benchmarks, oracles).

    Returns:
        A float32 array of ``shape``: ``out`` if given, else a new array; for F32 without
        ``out`` a zero-copy (read-only if ``data`` is) view of ``data``.

    Raises:
        FormatError: ``shape`` is invalid, its last dim is not a multiple of the block size, the
            byte length of ``data`` does not match ``shape`` for the type, or ``data`` is a
            non-contiguous array.
        UnsupportedTypeError: ``ggml_type`` is unknown or can be dequantized neither here nor by
            ``gguf.quants``.
        ConfigError: ``out`` is not a float32 C-contiguous writeable array of ``shape``.
    """
    qtype = _as_qtype(ggml_type)
    kernel = _KERNELS.get(qtype)
    if kernel is None and not _gguf_supports(qtype):
        raise UnsupportedTypeError(f"cannot dequantize ggml type {qtype.name}")
    dims = _as_shape(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if dims[-1] % block_size:
        raise FormatError(
            f"{qtype.name} tensor of shape {dims}: last dim {dims[-1]} is not a multiple of the block size {block_size}"
        )
    n_blocks = math.prod(dims) // block_size
    raw = tensor_bytes(data)
    if raw.size != n_blocks * type_size:
        raise FormatError(
            f"{qtype.name} tensor of shape {dims} needs {n_blocks} blocks of {type_size} bytes = "
            f"{n_blocks * type_size} bytes, got {raw.size}"
        )
    if out is not None:
        check_out(out, dims)

    if kernel is None:
        return _fallback(raw, qtype, dims, out)
    if qtype == _T.F32 and out is None:
        return raw.view(_F32).reshape(dims)
    result = np.empty(dims, dtype=_F32) if out is None else out
    if n_blocks == 0:
        return result
    accelerator, cols = _Plugged.accelerator, dims[-1]
    if (
        compiled
        and accelerator is not None
        and accelerator(raw, qtype, math.prod(dims[:-1]), cols, result.reshape(-1, cols))
    ):
        return result
    blocks = raw.reshape(n_blocks, type_size)
    values = result.reshape(n_blocks, block_size)
    step = max(1, _CHUNK_VALUES // block_size)
    with np.errstate(all="ignore"):  # inf * 0 and friends are expected, as in the reference
        for start in range(0, n_blocks, step):
            kernel(blocks[start : start + step], values[start : start + step])
    return result


# ----------------------------------------------------------------------------------------------
# argument handling


def _as_qtype(ggml_type: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UnsupportedTypeError(f"unknown ggml type {ggml_type!r}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise UnsupportedTypeError(f"ggml type {qtype.name} has no known block layout")
    return qtype


def _as_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    try:
        dims = tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        raise FormatError(f"tensor shape {shape!r} is not a tuple of ints") from None
    if not dims or any(n < 0 for n in dims):
        raise FormatError(f"tensor shape {dims} must have at least one dim and no negative dim")
    return dims


def tensor_bytes(data: memoryview | np.ndarray) -> np.ndarray:
    """The bytes of ``data`` as a flat uint8 array, never copied.

    Raises:
        FormatError: ``data`` is a non-contiguous array or not a contiguous byte buffer.
    """
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise FormatError("tensor data array is not C-contiguous")
        return data.reshape(-1).view(_U8)
    try:
        return np.frombuffer(data, dtype=_U8)
    except (TypeError, ValueError, BufferError) as exc:
        raise FormatError(f"tensor data is not a contiguous byte buffer: {exc}") from exc


def check_out(out: np.ndarray, dims: tuple[int, ...]) -> None:
    """Check that ``out`` is a C-contiguous writeable float32 array of shape ``dims``.

    Raises:
        ConfigError: it is not.
    """
    if not isinstance(out, np.ndarray) or out.dtype != _F32 or out.shape != dims:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ConfigError(f"out must be a float32 array of shape {dims}, got {got}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ConfigError("out must be C-contiguous and writeable")


@functools.cache
def _gguf_supports(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` can do ``qtype`` (probed once with one zero block)."""
    try:
        with np.errstate(all="ignore"):
            _gguf_dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=_U8), qtype)
    except NotImplementedError:
        return False
    return True


def _fallback(
    raw: np.ndarray, qtype: GGMLQuantizationType, dims: tuple[int, ...], out: np.ndarray | None
) -> np.ndarray:
    """``gguf.quants.dequantize`` on the tensor's rows, for types without a kernel here."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.size == 0:  # gguf-py cannot split an empty tensor into rows
        return np.empty(dims, dtype=_F32) if out is None else out
    with np.errstate(all="ignore"):
        values = _gguf_dequantize(raw.reshape(-1, dims[-1] // block_size * type_size), qtype)
    values = np.asarray(values, dtype=_F32).reshape(dims)
    if out is None:
        return values
    np.copyto(out, values)
    return out


# ----------------------------------------------------------------------------------------------
# helpers


def _kernel(qtype: GGMLQuantizationType) -> Callable[[_Kernel], _Kernel]:
    def register(fn: _Kernel) -> _Kernel:
        _KERNELS[qtype] = fn
        return fn

    return register


def _field(blocks: np.ndarray, offset: int, dtype: type[np.generic], count: int = 1) -> np.ndarray:
    """Zero-copy ``(n, count)`` view of ``count`` items of ``dtype`` at ``offset`` in each block."""
    size = np.dtype(dtype).itemsize * count
    return blocks[:, offset : offset + size].view(dtype)


@functools.cache
def _f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (numpy's own conversion, as the reference)."""
    return np.arange(1 << 16, dtype=_U16).view(np.float16).astype(_F32)


def _half(bits: np.ndarray) -> np.ndarray:
    """float32 values of float16 bit patterns ``bits`` (uint16, any shape and strides)."""
    return np.take(_f16_table(), bits, mode="wrap")


_TWO_POW_112 = _F32(2.0**112)
_TINY = np.array([2.0**-140], dtype=_F32)  # a float32 subnormal


def _half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """Convert float16 bit patterns ``bits`` (1-D uint16) into ``out`` (1-D float32, contiguous).

    Sign-extend to int32, shift the exponent and mantissa into float32 position and multiply by
    2**112 to rebias the exponent: exact for zeros, subnormals and normals. Inf/NaN patterns (rare)
    are patched from the lookup table; if denormals-are-zero is on (the multiply would flush the
    subnormals) the whole conversion goes through the table.
    """
    if _TINY[0] * _TWO_POW_112 == 0:
        np.take(_f16_table(), bits, out=out, mode="wrap")
        return
    as_int = out.view(np.int32)
    np.copyto(as_int, bits.view(np.int16))
    np.left_shift(as_int, 13, out=as_int)
    np.bitwise_and(as_int, np.int32(-0x7000_0001), out=as_int)  # keep sign, exponent, mantissa
    np.multiply(out, _TWO_POW_112, out=out)
    if bits.size and (bits.max() >= 0xFC00 or bits.view(np.int16).max() >= 0x7C00):
        special = np.flatnonzero((bits & _U16(0x7C00)) == 0x7C00)
        out[special] = _f16_table()[bits[special]]


def _expand_bits(bits: np.ndarray) -> np.ndarray:
    """Spread the bits of each byte of ``bits`` (uint64) into bytes: bit j of byte k -> 0x10 or 0.

    The input holds one byte per word (values 0..255); byte j of each result word is 0x10 if bit j
    of that byte is set, else 0.
    """
    x = bits * _B1  # the byte in all 8 bytes
    np.bitwise_and(x, _BIT_OF_BYTE, out=x)  # byte j keeps bit j
    np.add(x, _B7F, out=x)  # non-zero bytes get bit 7, no carry between bytes
    np.bitwise_and(x, _B80, out=x)
    np.right_shift(x, _U64(3), out=x)
    return x


def _words(blocks: np.ndarray, offset: int, count: int) -> np.ndarray:
    """``count`` little-endian uint64 words at ``offset`` of each block, copied to ``(n, count)``.

    One strided copy of ``count * 8``-byte items (a ``V`` dtype), aligned whatever the block size.
    """
    words = np.empty((len(blocks), count), dtype=_U64)
    void = np.dtype(f"V{8 * count}")
    np.copyto(words.view(void)[:, 0], blocks[:, offset : offset + 8 * count].view(void)[:, 0])
    return words


def _nibble_codes(words: np.ndarray) -> np.ndarray:
    """4-bit codes of 16-byte groups in ggml order: low nibbles of the 16 bytes, then high ones.

    Args:
        words: ``(m, 2)`` uint64, the 16 bytes of each group.

    Returns:
        ``(m, 4)`` uint64 = ``(m, 32)`` uint8 codes 0..15.
    """
    m = len(words)
    low = words & _NIB
    high = words >> _U64(4)
    np.bitwise_and(high, _NIB, out=high)
    codes = np.empty((m, 4), dtype=_U64)
    halves = codes.view("V16")  # (m, 2): bytes 0-15, bytes 16-31
    np.copyto(halves[:, 0], low.view("V16")[:, 0])
    np.copyto(halves[:, 1], high.view("V16")[:, 0])
    return codes


def _interleave(parts: list[np.ndarray]) -> np.ndarray:
    """Interleave equal-shape ``(m, a, w)`` uint64 arrays into ``(m, a, len(parts), w)``.

    ``result[:, :, s] = parts[s]``, done as one 1-D strided copy of ``w * 8``-byte items per part,
    so no copy has a short inner loop.
    """
    m, a, w = parts[0].shape
    result = np.empty((m, a, len(parts), w), dtype=_U64)
    void = np.dtype(f"V{8 * w}")
    dst = result.view(void)[..., 0]  # (m, a, s)
    for s, part in enumerate(parts):
        np.copyto(dst[:, :, s], part.view(void)[..., 0])
    return result


def _scale_blocks(values: np.ndarray, scale: np.ndarray, size: int) -> None:
    """``values`` (flat groups of ``size``) *= ``scale`` (one per group), in place."""
    np.multiply(values.reshape(-1, size), scale.reshape(-1, 1), out=values.reshape(-1, size))


def _scale_repeat(values: np.ndarray, scale: np.ndarray, size: int) -> None:
    """Same as :func:`_scale_blocks` through a flat ``np.repeat`` of the scales (for groups <= 32)."""
    flat = values.reshape(-1)
    np.multiply(flat, np.repeat(scale.reshape(-1), size), out=flat)


def _sub_repeat(values: np.ndarray, offset: np.ndarray, size: int) -> None:
    """``values`` (flat groups of ``size``) -= ``offset`` (one per group), in place."""
    flat = values.reshape(-1)
    np.subtract(flat, np.repeat(offset.reshape(-1), size), out=flat)


# ----------------------------------------------------------------------------------------------
# float types


@_kernel(_T.F32)
def _dequantize_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    """F32: plain copy (the zero-copy view path is in :func:`dequantize`)."""
    np.copyto(out, blocks.view(_F32))


@_kernel(_T.F16)
def _dequantize_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    """F16 (reference: ``astype(float32)``): integer rebias, see :func:`_half_to_float`."""
    _half_to_float(blocks.view(_U16).reshape(-1), out.reshape(-1))


@_kernel(_T.BF16)
def _dequantize_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    """BF16 (gguf-py ``BF16``): the 16 bits become the high half of the float32."""
    as_uint = out.view(_U32)
    np.copyto(as_uint, blocks.view(_U16))
    np.left_shift(as_uint, _U32(16), out=as_uint)


# ----------------------------------------------------------------------------------------------
# 32-value blocks with one f16 scale


@_kernel(_T.Q8_0)
def _dequantize_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 (gguf-py ``Q8_0``, ``dequantize_row_q8_0``): ``d * int8``. Block: d f16, 32 int8."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    np.copyto(out, _field(blocks, 2, np.int8, 32))
    _scale_blocks(out, d, 32)


def _q4_codes(blocks: np.ndarray, qs_offset: int) -> np.ndarray:
    return _nibble_codes(_words(blocks, qs_offset, 2)).view(_U8)


def _add_fifth_bit(blocks: np.ndarray, qh_offset: int, codes: np.ndarray) -> None:
    """OR bit i of the little-endian uint32 at ``qh_offset`` as 0x10 into code i (Q5_0/Q5_1)."""
    m = len(blocks)
    high = np.empty((4, m), dtype=_U64)
    np.copyto(high, _field(blocks, qh_offset, _U8, 4).T)
    high = _expand_bits(high)
    words = codes.view(_U64)
    for k in range(4):
        np.bitwise_or(words[:, k], high[k], out=words[:, k])


@_kernel(_T.Q4_0)
def _dequantize_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 (gguf-py ``Q4_0``, ``dequantize_row_q4_0``): ``d * (q - 8)``. Block: d f16, 16 qs."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    codes = _q4_codes(blocks, 2)
    np.subtract(codes, _U8(8), out=codes)
    np.copyto(out, codes.view(np.int8))
    _scale_blocks(out, d, 32)


@_kernel(_T.Q4_1)
def _dequantize_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1 (gguf-py ``Q4_1``, ``dequantize_row_q4_1``): ``d * q + m``. Block: d, m f16, 16 qs."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    m = _half(_field(blocks, 2, _U16)[:, 0])
    np.copyto(out, _q4_codes(blocks, 4))
    _scale_blocks(out, d, 32)
    np.add(out, m[:, None], out=out)


@_kernel(_T.Q5_0)
def _dequantize_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_0 (gguf-py ``Q5_0``, ``dequantize_row_q5_0``): ``d * (q - 16)``. d f16, qh u32, 16 qs."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    codes = _q4_codes(blocks, 6)
    _add_fifth_bit(blocks, 2, codes)
    np.subtract(codes, _U8(16), out=codes)
    np.copyto(out, codes.view(np.int8))
    _scale_blocks(out, d, 32)


@_kernel(_T.Q5_1)
def _dequantize_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_1 (gguf-py ``Q5_1``, ``dequantize_row_q5_1``): ``d * q + m``. d, m f16, qh u32, 16 qs."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    m = _half(_field(blocks, 2, _U16)[:, 0])
    codes = _q4_codes(blocks, 8)
    _add_fifth_bit(blocks, 4, codes)
    np.copyto(out, codes)
    _scale_blocks(out, d, 32)
    np.add(out, m[:, None], out=out)


def _pair_table(kvalues: tuple[int, ...], scales: np.ndarray | None) -> np.ndarray:
    """float32 pairs for two 4-bit codes plus an optional 8-bit scale code, as uint64.

    Entry ``c0 | x_lo << 4 | c1 << 8 | x_hi << 12`` (the layout of a uint16 lane of nibble codes,
    see :func:`_nibble_codes`, with the scale code ``x`` in the unused nibbles) holds
    ``(scales[x] * k[c0], scales[x] * k[c1])`` computed in float32, or ``(k[c0], k[c1])`` when
    ``scales`` is None; 4096 entries per 16 scale codes.
    """
    k = np.array(kvalues, dtype=np.int8).astype(_F32)
    i = np.arange(4096 * (1 if scales is None else -(-len(scales) // 16)))
    pairs = np.stack([k[i & 15], k[(i >> 8) & 15]], axis=1)
    if scales is not None:
        x = ((i >> 4) & 15) | ((i >> 12) << 4)
        pairs = scales[x][:, None] * pairs
    return np.ascontiguousarray(pairs, dtype=_F32).view(_U64)[:, 0].copy()


def _add_lane_code(codes: np.ndarray, x: np.ndarray) -> None:
    """OR scale code ``x`` (one per group of 32 codes) into the free nibbles of each uint16 lane.

    Args:
        codes: ``(g, 4)`` uint64 nibble codes (``(g, 32)`` uint8).
        x: ``(g,)`` uint8 codes (``x < 256``).
    """
    lanes = x.astype(_U64)
    high = lanes >> _U64(4)
    np.bitwise_and(lanes, _U64(15), out=lanes)
    np.left_shift(lanes, _U64(4), out=lanes)
    np.left_shift(high, _U64(12), out=high)
    np.bitwise_or(lanes, high, out=lanes)
    np.multiply(lanes, _U64(0x0001_0001_0001_0001), out=lanes)
    flat = codes.reshape(-1)
    np.bitwise_or(flat, np.repeat(lanes, 4), out=flat)


@functools.cache
def _iq4_nl_table() -> np.ndarray:
    return _pair_table(_KVALUES_IQ4, None)


@_kernel(_T.IQ4_NL)
def _dequantize_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_NL (gguf-py ``IQ4_NL``, ``dequantize_row_iq4_nl``): ``d * kvalues[q]``. d f16, 16 qs."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    codes = _nibble_codes(_words(blocks, 2, 2))
    np.take(_iq4_nl_table(), codes.view(_U16), out=out.view(_U64), mode="wrap")
    _scale_blocks(out, d, 32)


@functools.cache
def _mxfp4_table() -> np.ndarray:
    # ggml_e8m0_to_fp32_half, as gguf-py MXFP4.e8m0_to_fp32_half
    e = np.arange(256, dtype=_U32)
    bits = np.where(e < 2, _U32(0x0020_0000) << np.minimum(e, 1), (e - _U32(1)) << _U32(23))
    return _pair_table(_KVALUES_MXFP4, bits.astype(_U32).view(_F32))


@_kernel(_T.MXFP4)
def _dequantize_mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 (gguf-py ``MXFP4``, ``dequantize_row_mxfp4``): ``e8m0_half(e) * kvalues[q]``.

    Block: e (uint8 e8m0 exponent), 16 qs. The scale is folded into the table index, so the
    gather yields the finished values.
    """
    codes = _nibble_codes(_words(blocks, 1, 2))
    _add_lane_code(codes, _field(blocks, 0, _U8)[:, 0])
    np.take(_mxfp4_table(), codes.view(_U16), out=out.view(_U64), mode="wrap")


# ----------------------------------------------------------------------------------------------
# 256-value k-quant blocks


def _planes(words: np.ndarray, shifts: tuple[int, ...], mask: np.uint64) -> list[np.ndarray]:
    """``[(words >> s) & mask for s in shifts]`` as fresh contiguous arrays."""
    result = []
    for s in shifts:
        plane = words >> _U64(s) if s else words.copy()
        np.bitwise_and(plane, mask, out=plane)
        result.append(plane)
    return result


@_kernel(_T.Q2_K)
def _dequantize_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q2_K (gguf-py ``Q2_K``, ``dequantize_row_q2_K``): ``d * (sc & 15) * q - dmin * (sc >> 4)``.

    Block: 16 scale bytes, 64 qs (2-bit codes), d, dmin f16. 16 sub-blocks of 16.
    """
    m = len(blocks)
    d = _half(_field(blocks, 80, _U16)[:, 0])
    dmin = _half(_field(blocks, 82, _U16)[:, 0])
    sc = _field(blocks, 0, _U8, 16)
    dl = (sc & _U8(0x0F)).astype(_F32)
    np.multiply(d[:, None], dl, out=dl)
    ml = (sc >> _U8(4)).astype(_F32)
    np.multiply(dmin[:, None], ml, out=ml)
    qs = _words(blocks, 16, 8).reshape(m, 2, 4)  # two halves of 32 bytes
    codes = _interleave(_planes(qs, (0, 2, 4, 6), _B2))  # (m, 2, 4, 4)
    np.copyto(out, codes.view(_U8).reshape(m, 256))
    _scale_repeat(out, dl, 16)
    _sub_repeat(out, ml, 16)


def _q3_k_scales(blocks: np.ndarray) -> np.ndarray:
    """The 16 6-bit scales of Q3_K blocks minus 32, as float32 ``(m, 16)``."""
    m = len(blocks)
    low = _field(blocks, 96, _U64)[:, 0]  # bytes 0-7: low nibbles
    high = _field(blocks, 104, _U32)[:, 0].astype(_U64)  # bytes 8-11: 2-bit high parts
    codes = np.empty((m, 2), dtype=_U64)
    np.bitwise_and(low, _NIB, out=codes[:, 0])
    np.right_shift(low, _U64(4), out=codes[:, 1])
    np.bitwise_and(codes[:, 1], _NIB, out=codes[:, 1])
    b2 = _U64(0x0303_0303)
    for half, (s_lo, s_hi) in enumerate(((0, 2), (4, 6))):
        part = (high >> _U64(s_lo)) & b2
        np.bitwise_or(part, ((high >> _U64(s_hi)) & b2) << _U64(32), out=part)
        np.left_shift(part, _U64(4), out=part)
        np.bitwise_or(codes[:, half], part, out=codes[:, half])
    scales = codes.view(_U8).astype(_F32)
    np.subtract(scales, _F32(32), out=scales)
    return scales


@_kernel(_T.Q3_K)
def _dequantize_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q3_K (gguf-py ``Q3_K``, ``dequantize_row_q3_K``): ``d * (sc - 32) * (q - 4 * !hbit)``.

    Block: 32 hmask, 64 qs (2-bit codes), 12 packed 6-bit scales, d f16. 16 sub-blocks of 16.
    """
    m = len(blocks)
    d = _half(_field(blocks, 108, _U16)[:, 0])
    dl = _q3_k_scales(blocks)
    np.multiply(d[:, None], dl, out=dl)
    qs = _words(blocks, 32, 8).reshape(m, 2, 4)
    hm = _words(blocks, 0, 4)
    hmx = np.empty((m, 2, 4), dtype=_U64)
    np.copyto(hmx[:, 0], hm)
    np.right_shift(hm, _U64(4), out=hmx[:, 1])
    parts = []
    for g, plane in enumerate(_planes(qs, (0, 2, 4, 6), _B2)):
        hbit = hmx >> _U64(g) if g else hmx.copy()
        np.bitwise_and(hbit, _B1, out=hbit)
        np.left_shift(hbit, _U64(2), out=hbit)
        np.bitwise_or(plane, hbit, out=plane)
        parts.append(plane)
    codes = _interleave(parts).view(_U8)
    np.subtract(codes, _U8(4), out=codes)
    np.copyto(out, codes.view(np.int8).reshape(m, 256))
    _scale_repeat(out, dl, 16)


def _k_scale_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of Q4_K/Q5_K blocks (``get_scale_min_k4``), uint8 ``(m, 8)``."""
    m = len(blocks)
    s = _field(blocks, 4, _U32, 3)
    s0, s1, s2 = s[:, 0], s[:, 1], s[:, 2]
    sc = np.empty((m, 2), dtype=_U32)
    mn = np.empty((m, 2), dtype=_U32)
    b6 = _U32(0x3F3F_3F3F)
    b4 = _U32(0x0F0F_0F0F)
    b30 = _U32(0x3030_3030)
    np.bitwise_and(s0, b6, out=sc[:, 0])
    np.bitwise_and(s1, b6, out=mn[:, 0])
    tmp = np.empty(m, dtype=_U32)
    np.right_shift(s0, _U32(2), out=tmp)
    np.bitwise_and(tmp, b30, out=tmp)
    np.bitwise_and(s2, b4, out=sc[:, 1])
    np.bitwise_or(sc[:, 1], tmp, out=sc[:, 1])
    np.right_shift(s1, _U32(2), out=tmp)
    np.bitwise_and(tmp, b30, out=tmp)
    np.right_shift(s2, _U32(4), out=mn[:, 1])
    np.bitwise_and(mn[:, 1], b4, out=mn[:, 1])
    np.bitwise_or(mn[:, 1], tmp, out=mn[:, 1])
    return sc.view(_U8), mn.view(_U8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``d * sc`` and ``dmin * m`` of Q4_K/Q5_K blocks, float32 ``(m, 8)``."""
    d = _half(_field(blocks, 0, _U16)[:, 0])
    dmin = _half(_field(blocks, 2, _U16)[:, 0])
    sc, mn = _k_scale_min(blocks)
    dl = sc.astype(_F32)
    np.multiply(d[:, None], dl, out=dl)
    ml = mn.astype(_F32)
    np.multiply(dmin[:, None], ml, out=ml)
    return dl, ml


def _q4_k_codes(blocks: np.ndarray, qs_offset: int) -> np.ndarray:
    m = len(blocks)
    qs = _words(blocks, qs_offset, 16).reshape(m, 4, 4)  # four chunks of 32 bytes
    low, high = _planes(qs, (0, 4), _NIB)
    return _interleave([low, high])  # (m, 4, 2, 4): sub-block 2c = low, 2c + 1 = high


@_kernel(_T.Q4_K)
def _dequantize_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K (gguf-py ``Q4_K``, ``dequantize_row_q4_K``): ``d * sc * q - dmin * m``.

    Block: d, dmin f16, 12 bytes of packed 6-bit scales/mins, 128 qs. 8 sub-blocks of 32.
    """
    m = len(blocks)
    dl, ml = _k_scales(blocks)
    np.copyto(out, _q4_k_codes(blocks, 16).view(_U8).reshape(m, 256))
    _scale_repeat(out, dl, 32)
    _sub_repeat(out, ml, 32)


@_kernel(_T.Q5_K)
def _dequantize_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_K (gguf-py ``Q5_K``, ``dequantize_row_q5_K``): ``d * sc * q - dmin * m``, 5-bit q.

    Block: d, dmin f16, 12 bytes of scales/mins, 32 qh (bit j of byte l: value l of sub-block j),
    128 qs. 8 sub-blocks of 32.
    """
    m = len(blocks)
    dl, ml = _k_scales(blocks)
    codes = _q4_k_codes(blocks, 48).reshape(m, 8, 4)
    qh = _words(blocks, 16, 4)
    bit4 = _U64(0x1010_1010_1010_1010)
    high = [((qh << _U64(4 - j)) if j < 4 else (qh >> _U64(j - 4))) & bit4 for j in range(8)]
    np.bitwise_or(codes, _interleave([h[:, None, :] for h in high]).reshape(m, 8, 4), out=codes)
    np.copyto(out, codes.view(_U8).reshape(m, 256))
    _scale_repeat(out, dl, 32)
    _sub_repeat(out, ml, 32)


@_kernel(_T.Q6_K)
def _dequantize_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K (gguf-py ``Q6_K``, ``dequantize_row_q6_K``): ``d * sc * (q - 32)``.

    Block: 128 ql (low 4 bits), 64 qh (high 2 bits), 16 int8 scales, d f16. 16 sub-blocks of 16.
    """
    m = len(blocks)
    d = _half(_field(blocks, 208, _U16)[:, 0])
    dl = _field(blocks, 192, np.int8, 16).astype(_F32)
    np.multiply(d[:, None], dl, out=dl)
    ql = _words(blocks, 0, 16).reshape(m, 2, 8)  # two halves of 64 bytes
    low, high = _planes(ql, (0, 4), _NIB)
    codes = _interleave([low, high]).reshape(m, 2, 4, 4)  # (half, group of 32, word)
    qh = _words(blocks, 128, 8).reshape(m, 2, 4)
    top = _U64(0x3030_3030_3030_3030)
    parts = [((qh << _U64(4 - 2 * g)) if g < 2 else (qh >> _U64(2 * g - 4))) & top for g in range(4)]
    np.bitwise_or(codes, _interleave(parts), out=codes)
    c8 = codes.view(_U8)
    np.subtract(c8, _U8(32), out=c8)
    np.copyto(out, c8.view(np.int8).reshape(m, 256))
    _scale_repeat(out, dl, 16)


@functools.cache
def _iq4_xs_table() -> np.ndarray:
    # (sc - 32) * k is an exact float32 product of small integers (signs of zero kept).
    return _pair_table(_KVALUES_IQ4, np.arange(-32, 32, dtype=_F32))


def _spread_nibbles(x: np.ndarray) -> np.ndarray:
    """uint64 holding 8 nibbles in bits 0-31 -> nibble j in byte j."""
    x = (x | (x << _U64(16))) & _U64(0x0000_FFFF_0000_FFFF)
    x = (x | (x << _U64(8))) & _U64(0x00FF_00FF_00FF_00FF)
    out: np.ndarray = (x | (x << _U64(4))) & _NIB
    return out


def _spread_pairs(x: np.ndarray) -> np.ndarray:
    """uint64 holding 8 2-bit fields in bits 0-15 -> field j in byte j."""
    x = (x | (x << _U64(24))) & _U64(0x0000_00FF_0000_00FF)
    x = (x | (x << _U64(12))) & _U64(0x000F_000F_000F_000F)
    out: np.ndarray = (x | (x << _U64(6))) & _B2
    return out


@_kernel(_T.IQ4_XS)
def _dequantize_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_XS (gguf-py ``IQ4_XS``, ``dequantize_row_iq4_xs``): ``d * (sc - 32) * kvalues[q]``.

    Block: d f16, scales_h u16, scales_l 4 bytes, 128 qs; 8 sub-blocks of 32 laid out like IQ4_NL.
    ``d * (sc - 32) * k`` is exact in float32, so ``(sc - 32) * k`` comes from the table and only
    ``d`` is applied per block.
    """
    m = len(blocks)
    d = _half(_field(blocks, 0, _U16)[:, 0])
    sc = _spread_nibbles(_field(blocks, 4, _U32)[:, 0].astype(_U64))
    np.bitwise_or(sc, _spread_pairs(_field(blocks, 2, _U16)[:, 0].astype(_U64)) << _U64(4), out=sc)
    codes = _nibble_codes(_words(blocks, 8, 16).reshape(m * 8, 2))  # (m * 8, 4)
    _add_lane_code(codes, sc.view(_U8))
    np.take(_iq4_xs_table(), codes.view(_U16), out=out.view(_U64).reshape(m * 8, 16), mode="wrap")
    _scale_blocks(out, d, 256)
