"""K-quant products of many tokens at once: the weight codes broadcast over a vector of tokens.

:mod:`.rowdots` follows ggml's one-token loop (``ggml_vec_dot_q4_K_q8_K``) for a few tokens, so that
each token's result is bit for bit its one-token result: per 32 values and token it spends a
``pmaddubsw``, a ``pmaddwd`` and an add on 32 products. For a prefill that bit-equality is not
needed, and the products can be laid out the other way round, as ggml's tiled matmul does
(``ggml-cpu/tiled``): ``x``'s Q8_K quants are packed so that one vector holds 4 consecutive values
of :data:`TILE` tokens (``xpack[g, j] = q_j[4 g : 4 g + 4]`` as an int32), and 4 codes of one weight
row are broadcast to every lane. With AVX-512 VNNI one ``vpdpbusd`` adds ``sum(code * q)`` over 4
values to every token's lane, and the sub-block's scale is applied once per sub-block (32 values
for Q4_K and Q5_K, 16 for Q6_K); without it one ``pmaddubsw`` and one ``pmaddwd`` (with the scale)
per 4 values. Either way 4 products per lane and instruction instead of 1.

A row's codes (and scales) are first decoded into a scratch array (``decode_<type>``), then
multiplied (``tile_<type>``): the 4 codes of a word are broadcast by a load (``vpbroadcastd`` from
memory, a load port), where a broadcast from the register that held them took a shuffle
(``vpermd``) on the port that also runs ``vpdpbusd``. With the packed tiles starting at a cache
line (:func:`aligned_rows`), one 768x2048 expert matrix at 16 tokens ran 1.15-1.2x (Q6_K) and 1.3x
(Q4_K) faster (Intel Xeon). With several tiles, a chunk of rows is decoded once for all of them
(:func:`tiled_products`).

Per block and token of the tile, in int32 lanes, the integer sums of ggml's ``vec_dot`` loops:

* Q4_K, Q5_K (``ggml_vec_dot_q4_K_q8_K``, ``..._q5_K_...``): ``sumi = sum_s sc_s dot_s`` and
  ``summ = sum_s m_s bsum_s`` over the 8 sub-blocks of 32 values (codes 0..15, Q5_K's fifth bit from
  ``qh``), then ``y += d_w d_x sumi - dmin_w d_x summ`` in float32;
* Q6_K (``ggml_vec_dot_q6_K_q8_K``): the codes 0..63 unsigned, as ggml's loops multiply them, and
  their offset of 32 through the Q8_K block sums: ``sumi = sum_s sc_s (dot_s - 32 bsum_s)`` over the
  16 sub-blocks of 16 values (ggml's tiled kernel: ``(raw - BIAS * bsums) * scale``; its AVX2 loop
  subtracts ``32 sum_s sc_s bsum_s`` from the same sum), then ``y += d_w d_x sumi``.

That is llama.cpp's arithmetic (its Q8_K rounding of ``x``, the same integer sums per block) to
float rounding (the blocks are added in another order than ggml's 8-lane accumulator, about 1e-7
relative). ``TILE`` is 16 tokens on x86 with AVX-512BW, else 8.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel
from . import rowdot
from .common import F32
from .int8 import QK_K, SUM16, bsum_pairs, quantize_rows_q8_k
from .rowdot import (
    I16,
    I32,
    I64,
    Q4_K_BYTES,
    Q5_K_BYTES,
    Q6_K_BYTES,
    _call,
    _const,
    _half,
    _i64,
    _lanes,
    _pair_sums,
    _Ptr,
    _scales_mins_k4,
    q6_k_block,
)

# ruff: noqa: N803, N806

I8 = ir.IntType(8)
#: tokens per tile: the int32 lanes of one vector
TILE = 16 if rowdot._avx512bw() else 8
#: int32 groups of 4 quants per Q8_K block
GROUPS = QK_K // 4
#: Q6_K's code offset: ggml's codes are ``q - 32``
Q6_K_OFFSET = 32
#: int32 code words (4 codes each) and scales per block of a decoded row (``decode_<type>``)
WORDS = QK_K // 4
SCALES = 16
#: decoded codes and scales of the rows that go through all tiles at a time (:func:`tiled_products`)
CHUNK_BYTES = 256 * 1024
#: bytes and 4-byte words of a cache line: the packed tiles start at one (:func:`aligned_rows`)
LINE = 64
LINE_WORDS = LINE // 4


def _vnni() -> bool:
    """AVX-512 VNNI: ``vpdpbusd`` (unsigned bytes times signed bytes, 4 summed into each int32 lane)."""
    return "+avx512vnni" in rowdot._target_features()[1]


@functools.cache
def fast() -> bool:
    """Whether the tiles beat the 4-token loops here: x86 with AVX-512BW and VNNI (:data:`TILE` 16)."""
    return TILE == 16 and rowdot._avx2() and _vnni()


def _vectors(tile: int) -> tuple[ir.VectorType, ir.VectorType, ir.VectorType, ir.VectorType]:
    return (
        ir.VectorType(I8, 4 * tile),
        ir.VectorType(I16, 2 * tile),
        ir.VectorType(I32, tile),
        ir.VectorType(ir.FloatType(), tile),
    )


def _pair_products(builder: ir.IRBuilder, codes: Any, quants: Any, scale: Any, tile: int, x86: bool) -> Any:
    """``<tile x i32>``: ``scale * sum(codes[4 j + t] * quants[4 j + t], t < 4)`` (codes unsigned,
    quants signed; no int16 saturation: codes <= 63, ``|q| <= 128``)."""
    _, vh, vi, _ = _vectors(tile)
    if x86 and tile == 16:
        pairs = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", vh, [codes, quants])
        return _call(builder, "llvm.x86.avx512.pmaddw.d.512", vi, [pairs, scale])
    if x86 and tile == 8:
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", vh, [codes, quants])
        return _call(builder, "llvm.x86.avx2.pmadd.wd", vi, [pairs, scale])
    wide16 = ir.VectorType(I16, 4 * tile)
    pairs = _pair_sums(builder, builder.mul(builder.zext(codes, wide16), builder.sext(quants, wide16)), 4 * tile)
    wide32 = ir.VectorType(I32, 2 * tile)
    return _pair_sums(builder, builder.mul(builder.sext(pairs, wide32), builder.sext(scale, wide32)), 2 * tile)


def _splat_lane(builder: ir.IRBuilder, vector: Any, lane: int, lanes: int) -> Any:
    return builder.shuffle_vector(vector, vector, _lanes([lane] * lanes))


def _splat_scalar(builder: ir.IRBuilder, value: Any, lanes: int) -> Any:
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, _const(I32, 0))
    return _splat_lane(builder, one, 0, lanes)


class _Row:
    """A row's bytes and its decoded codes and scales (:data:`WORDS`, :data:`SCALES` int32 per
    block): the pointers of the arrays at arguments ``row``, ``codes``, ``scales``."""

    def __init__(
        self, context: Any, builder: ir.IRBuilder, signature: Any, args: Any, at: tuple[int, int, int]
    ) -> None:
        self.builder = builder
        self.w, self.cw, self.sc = (_Ptr(context, builder, signature.args[k], args[k]) for k in at)

    def store_codes(self, b: Any, part: int, codes: Any) -> None:
        """Codes ``32 part .. 32 part + 31`` (``<32 x i8>``) of block ``b`` to the row's code words."""
        at = self.builder.add(self.builder.mul(b, _const(I64, WORDS)), _const(I64, 8 * part))
        ptr = self.builder.bitcast(self.builder.gep(self.cw.data, [at]), codes.type.as_pointer())
        self.builder.store(codes, ptr, align=4)

    def store_scales(self, b: Any, values: Any) -> None:
        """``<16 x i32>`` of block ``b`` to the row's scales."""
        ptr = self.builder.gep(self.sc.data, [self.builder.mul(b, _const(I64, SCALES))])
        self.builder.store(values, self.builder.bitcast(ptr, values.type.as_pointer()), align=4)

    def scale(self, b: Any, index: int) -> Any:
        """Scale ``index`` of block ``b`` (i32)."""
        return self.sc.load(self.builder.add(self.builder.mul(b, _const(I64, SCALES)), _const(I64, index)), I32, 4)


class _Tile(_Row):
    """The state one tile kernel's code generator shares: the pointers of its arrays and the form
    of its products (``vpdpbusd``, x86 ``pmaddubsw``/``pmaddwd``, or plain vector IR)."""

    def __init__(self, context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> None:
        super().__init__(context, builder, signature, args, (0, 6, 7))
        self.tile = TILE
        self.x86 = rowdot._avx2()
        self.vnni = self.x86 and self.tile == 16 and _vnni()
        self.xp, self.mp, self.dp = (_Ptr(context, builder, signature.args[k], args[k]) for k in range(1, 4))

    def zeros(self) -> Any:
        return ir.Constant(_vectors(self.tile)[2], [0] * self.tile)

    def packed(self, index: Any) -> Any:
        """The ``<tile x i32>`` of ``mpack`` at element ``index`` (an i64)."""
        return self.mp.load(index, _vectors(self.tile)[2], align=4)

    def scaled_dots(self, b: Any, first: int, count: int, scale: Any, bias: Any = None) -> Any:
        """``<tile x i32>``: ``scale * (bias + sum_k dot_k)`` for every token of the tile, where
        ``dot_k`` is code word ``first + k`` of block ``b`` (4 codes) times the token's quants of
        the same group; ``scale`` an i32, ``bias`` a ``<tile x i32>`` or None (0).

        VNNI: ``bias`` is the first ``vpdpbusd``'s accumulator and ``scale`` one multiply;
        else the scale goes into each ``pmaddwd`` and ``bias`` is multiplied apart: the same
        integers."""
        builder, tile = self.builder, self.tile
        vb, vh, vi, _ = _vectors(tile)
        word_at = builder.mul(b, _const(I64, WORDS))
        x_at = builder.mul(b, _const(I64, GROUPS * tile))
        words = [self.cw.load(builder.add(word_at, _const(I64, first + k)), I32, 4) for k in range(count)]
        xs = [builder.add(x_at, _const(I64, (first + k) * tile)) for k in range(count)]
        if self.vnni:
            dots = self.zeros() if bias is None else bias
            for word, at in zip(words, xs, strict=True):
                wb = _splat_scalar(builder, word, tile)
                dots = _call(builder, "llvm.x86.avx512.vpdpbusd.512", vi, [dots, wb, self.xp.load(at, vi, align=4)])
            return builder.mul(dots, _splat_scalar(builder, scale, tile))
        scale_v = _splat_scalar(builder, builder.trunc(scale, I16), 2 * tile)
        total = self.zeros() if bias is None else builder.mul(bias, _splat_scalar(builder, scale, tile))
        for word, at in zip(words, xs, strict=True):
            wb = builder.bitcast(_splat_scalar(builder, word, tile), vb)
            total = builder.add(
                total, _pair_products(builder, wb, self.xp.load(at, vb, align=4), scale_v, tile, self.x86)
            )
        return total

    def pair_products(self, acc: Any, word: Any, packed: Any) -> Any:
        """``acc + lo(word) lo(packed) + hi(word) hi(packed)`` in every lane (``word``: two int16 as an
        i32, broadcast; ``packed``: ``<tile x i32>`` of int16 pairs): ``vpdpwssd``, else ``pmaddwd``."""
        builder, tile = self.builder, self.tile
        _, vh, vi, _ = _vectors(tile)
        words = _splat_scalar(builder, word, tile)
        if self.vnni:
            return _call(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [acc, words, packed])
        a, b = builder.bitcast(words, vh), builder.bitcast(packed, vh)
        if self.x86 and tile == 16:
            return builder.add(acc, _call(builder, "llvm.x86.avx512.pmaddw.d.512", vi, [a, b]))
        if self.x86 and tile == 8:
            return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", vi, [a, b]))
        wide = ir.VectorType(I32, 2 * tile)
        return builder.add(
            acc, _pair_sums(builder, builder.mul(builder.sext(a, wide), builder.sext(b, wide)), 2 * tile)
        )

    def scaled(self, sums: Any, x_scale: Any, w_scale: Any) -> Any:
        """``float(sums) * (d_x * w_scale)`` as ``<tile x float>`` (``x_scale``: the tokens' ``d_x``)."""
        vf = _vectors(self.tile)[3]
        builder = self.builder
        return builder.fmul(builder.sitofp(sums, vf), builder.fmul(x_scale, _splat_scalar(builder, w_scale, self.tile)))


_Decode = Callable[[_Row, Any], None]
_Block = Callable[[_Tile, Any, Any], Any]


def _decode_codegen(decode: _Decode) -> Any:
    """The code generator of a decoder: ``decode(state, b)`` of every block of the row into its code
    words and scales (memory: the tile kernel then broadcasts each word by a load, not a shuffle)."""

    def codegen(context, builder, signature, args):
        state = _Row(context, builder, signature, args, (0, 2, 3))
        with cgutils.for_range(builder, _i64(builder, args[1])) as loop:
            decode(state, loop.index)
        return _const(I64, 0)

    return codegen


def _c_1d(t: Any, dtype: Any) -> bool:
    """``t`` is a one-dimensional C-contiguous array of ``dtype`` (a numba type)."""
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype and t.layout == "C"


def _decode_signature(row: Any, n_blocks: Any, codes: Any, scales: Any) -> Any:
    """The decoders' signature, or None for other argument types."""

    ok = (
        _c_1d(row, types.uint8)
        and isinstance(n_blocks, types.Integer)
        and _c_1d(codes, types.int32)
        and _c_1d(scales, types.int32)
    )
    return types.int64(row, n_blocks, codes, scales) if ok else None


def _tile_codegen(block: _Block) -> Any:
    """The code generator of a tile kernel: ``acc += block(state, b, d_x)`` (``<tile x float>``,
    ``d_x`` the tokens' Q8_K scales of block ``b``) over the row's blocks, then ``acc`` stored to
    ``out``."""

    def codegen(context, builder, signature, args):
        state = _Tile(context, builder, signature, args)
        vf = _vectors(state.tile)[3]
        n_blocks = _i64(builder, args[4])
        acc_slot = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * state.tile))
        with cgutils.for_range(builder, n_blocks) as loop:
            b = loop.index
            x_scale = state.dp.load(builder.mul(b, _const(I64, state.tile)), vf, align=4)
            builder.store(builder.fadd(builder.load(acc_slot), block(state, b, x_scale)), acc_slot)
        o_ptr = _Ptr(context, builder, signature.args[5], args[5])
        target = builder.bitcast(builder.gep(o_ptr.data, [_const(I64, 0)]), vf.as_pointer())
        builder.store(builder.load(acc_slot), target, align=4)
        return _const(I64, 0)

    return codegen


def _tile_signature(row: Any, xpack: Any, mpack: Any, dx: Any, n_blocks: Any, out: Any, codes: Any, scales: Any) -> Any:
    """The tile kernels' signature, or None for other argument types."""

    ok = (
        _c_1d(row, types.uint8)
        and _c_1d(xpack, types.int32)
        and _c_1d(mpack, types.int32)
        and _c_1d(dx, types.float32)
        and isinstance(n_blocks, types.Integer)
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
        and _c_1d(codes, types.int32)
        and _c_1d(scales, types.int32)
    )
    return types.int64(row, xpack, mpack, dx, n_blocks, out, codes, scales) if ok else None


def _k4_decode(block_bytes: int, qs: int, qh: int | None) -> _Decode:
    """The codes, scales (words 0..7) and mins (8..11: two int16 each) of a Q4_K block (``qh`` None)
    or Q5_K block (the codes' fifth bits at byte ``qh``)."""

    def decode(state: _Row, b: Any) -> None:
        builder, w = state.builder, state.w
        v32i8 = ir.VectorType(I8, 32)
        o = builder.mul(b, _const(I64, block_bytes))
        scales, mins = _scales_mins_k4(builder, w, o)
        # words 0..7 the scales, 8..11 the mins in int16 pairs (vpdpwssd's), 12..15 unused
        pairs = builder.bitcast(builder.zext(mins, ir.VectorType(I16, 8)), ir.VectorType(I32, 4))
        words = builder.shuffle_vector(pairs, ir.Constant(ir.VectorType(I32, 4), [0] * 4), _lanes(list(range(8))))
        both = builder.shuffle_vector(builder.zext(scales, ir.VectorType(I32, 8)), words, _lanes(list(range(16))))
        state.store_scales(b, both)
        high = None if qh is None else w.load(builder.add(o, _const(I64, qh)), v32i8)
        four = ir.Constant(v32i8, [4] * 32)
        for c in range(4):
            bits = w.load(builder.add(o, _const(I64, qs + 32 * c)), v32i8)
            for half, codes in enumerate((builder.and_(bits, ir.Constant(v32i8, [15] * 32)), builder.lshr(bits, four))):
                s = 2 * c + half
                if high is not None:  # bit 2c + half of qh[i]: bit 4 of the code
                    fifth = builder.and_(builder.lshr(high, ir.Constant(v32i8, [s] * 32)), ir.Constant(v32i8, [1] * 32))
                    codes = builder.or_(codes, builder.shl(fifth, four))
                state.store_codes(b, s, codes)

    return decode


def _k4_block(block_bytes: int) -> _Block:
    """One Q4_K or Q5_K block against the tile: ``d_x (d_w sumi - dmin_w summ)`` (module docstring);
    ``mpack`` holds the tokens' sums of 32 quants in int16 pairs (``(b 4 + p) TILE + j``: sub-blocks
    ``2 p`` and ``2 p + 1``), ``summ`` one ``vpdpwssd`` per pair."""

    def block(state: _Tile, b: Any, x_scale: Any) -> Any:
        builder, tile = state.builder, state.tile
        o = builder.mul(b, _const(I64, block_bytes))
        d_w = _half(builder, state.w.load(o, I16))
        dmin_w = _half(builder, state.w.load(builder.add(o, _const(I64, 2)), I16))
        sumi = state.zeros()
        for s in range(8):
            sumi = builder.add(sumi, state.scaled_dots(b, 8 * s, 8, state.scale(b, s)))
        summ = state.zeros()
        mb = builder.mul(b, _const(I64, 4 * tile))
        for p in range(4):
            summ = state.pair_products(
                summ, state.scale(b, 8 + p), state.packed(builder.add(mb, _const(I64, p * tile)))
            )
        return builder.fsub(state.scaled(sumi, x_scale, d_w), state.scaled(summ, x_scale, dmin_w))

    return block


def _q6_k_decode(state: _Row, b: Any) -> None:
    """The codes (0..63) and 16 signed scales of a Q6_K block."""
    builder = state.builder
    parts, scales16, _ = q6_k_block(builder, state.w, builder.mul(b, _const(I64, Q6_K_BYTES)))
    state.store_scales(b, builder.sext(scales16, ir.VectorType(I32, 16)))
    for k, (codes, _) in enumerate(parts):
        state.store_codes(b, k, codes)


def _q6_k_block(state: _Tile, b: Any, x_scale: Any) -> Any:
    """One Q6_K block against the tile: ``d_x d_w sum_s sc_s (dot_s - 32 bsum_s)`` (module docstring);
    ``mpack`` holds the tokens' ``-32 bsum`` per 16 quants (``(b 16 + s) TILE + j``), the first
    accumulator of each sub-block's dots."""
    builder, tile = state.builder, state.tile
    d_w = _half(builder, state.w.load(builder.add(builder.mul(b, _const(I64, Q6_K_BYTES)), _const(I64, 208)), I16))
    sumi = state.zeros()
    mb = builder.mul(b, _const(I64, SUM16 * tile))
    for s in range(16):
        bias = state.packed(builder.add(mb, _const(I64, s * tile)))
        sumi = builder.add(sumi, state.scaled_dots(b, 4 * s, 4, state.scale(b, s), bias))
    return state.scaled(sumi, x_scale, d_w)


@intrinsic
def decode_q4_k(typingctx, row, n_blocks, codes, scales):
    """A Q4_K row's codes and scales for :func:`tile_q4_k`: ``codes`` int32 ``(n_blocks * WORDS,)``,
    word ``b WORDS + g`` = the codes ``4 g .. 4 g + 3`` of block ``b`` (a byte each); ``scales``
    int32 ``(n_blocks * SCALES,)``, the 8 scales then the 8 mins of each block."""
    sig = _decode_signature(row, n_blocks, codes, scales)
    return None if sig is None else (sig, _decode_codegen(_k4_decode(Q4_K_BYTES, 16, None)))


@intrinsic
def decode_q5_k(typingctx, row, n_blocks, codes, scales):
    """A Q5_K row's codes (fifth bit included) and scales: as :func:`decode_q4_k`."""
    sig = _decode_signature(row, n_blocks, codes, scales)
    return None if sig is None else (sig, _decode_codegen(_k4_decode(Q5_K_BYTES, 48, 16)))


@intrinsic
def decode_q6_k(typingctx, row, n_blocks, codes, scales):
    """A Q6_K row's codes (0..63) and its 16 signed scales per block: as :func:`decode_q4_k`."""
    sig = _decode_signature(row, n_blocks, codes, scales)
    return None if sig is None else (sig, _decode_codegen(_q6_k_decode))


@intrinsic
def tile_q4_k(typingctx, row, xpack, mpack, dx, n_blocks, out, codes, scales):
    """One Q4_K row against one tile of tokens: ``out[j]`` (float32, :data:`TILE` of them).

    ``row``: the row's bytes (uint8, 1-D: its float16 scales are read here); ``xpack``: int32
    ``(n_blocks * GROUPS * TILE,)``, element ``(b GROUPS + g) TILE + j`` = the quants ``4 g .. 4 g +
    3`` of block ``b`` of token ``j``; ``mpack``: int32 ``(n_blocks * 4 * TILE,)``, the sums of the
    quants per 32 values in int16 pairs (``(b 4 + p) TILE + j``: sums ``2 p`` (low half) and ``2 p
    + 1``); ``dx``: float32 ``(n_blocks * TILE,)``, the Q8_K
    scales; ``codes``, ``scales``: the row decoded by :func:`decode_q4_k`. No bounds checks: the
    caller sizes every array; ``xpack``, ``mpack`` and ``dx`` start at a cache line
    (:func:`aligned_rows`).
    """
    sig = _tile_signature(row, xpack, mpack, dx, n_blocks, out, codes, scales)
    return None if sig is None else (sig, _tile_codegen(_k4_block(Q4_K_BYTES)))


@intrinsic
def tile_q5_k(typingctx, row, xpack, mpack, dx, n_blocks, out, codes, scales):
    """One Q5_K row (decoded by :func:`decode_q5_k`) against one tile of tokens: as :func:`tile_q4_k`."""
    sig = _tile_signature(row, xpack, mpack, dx, n_blocks, out, codes, scales)
    return None if sig is None else (sig, _tile_codegen(_k4_block(Q5_K_BYTES)))


@intrinsic
def tile_q6_k(typingctx, row, xpack, mpack, dx, n_blocks, out, codes, scales):
    """One Q6_K row (decoded by :func:`decode_q6_k`) against one tile of tokens: as :func:`tile_q4_k`
    but ``mpack``, int32 ``(n_blocks * 16 * TILE,)``: ``-32`` times the sums of the quants per 16
    values (``(b 16 + s) TILE + j``)."""
    sig = _tile_signature(row, xpack, mpack, dx, n_blocks, out, codes, scales)
    return None if sig is None else (sig, _tile_codegen(_q6_k_block))


@kernel(inline=True)
def aligned_rows(flat, rows):
    """``(rows, m)`` view of ``flat`` (4-byte elements, ``rows * m + LINE_WORDS`` of them, ``m`` a
    multiple of :data:`LINE_WORDS`) starting at a cache line: numba aligns arrays to 32 bytes, and a
    64-byte load across two lines costs two (the tiles ran up to 1.3x slower on some allocations)."""
    skip = ((LINE - flat.ctypes.data % LINE) % LINE) // 4
    size = flat.size - LINE_WORDS
    return flat[skip : skip + size].reshape((rows, size // rows))


@kernel(inline=True)
def pack_tiles(q, d, sums, factor, tiles):
    """The tile kernels' ``(xpack, mpack, dpack)`` of every tile (one row each) from the Q8_K
    quants ``q`` (int8 ``(tiles * TILE, cols)``), scales ``d`` and per-token sums ``sums``
    (``(tiles * TILE, m)``): ``mpack[k, s TILE + j] = factor * sums[k TILE + j, s]``."""
    rows, cols = q.shape
    n_blocks = cols // QK_K
    m = sums.shape[1]
    q32 = q.view(np.int32)  # (tiles * TILE, cols // 4)
    xpack = aligned_rows(np.empty(tiles * (cols // 4) * TILE + LINE_WORDS, dtype=np.int32), tiles)
    mpack = aligned_rows(np.empty(tiles * m * TILE + LINE_WORDS, dtype=np.int32), tiles)
    dpack = aligned_rows(np.empty(tiles * n_blocks * TILE + LINE_WORDS, dtype=F32), tiles)
    for k in range(tiles):
        for j in range(TILE):
            t = k * TILE + j
            for g in range(cols // 4):
                xpack[k, g * TILE + j] = q32[t, g]
            for s in range(m):
                mpack[k, s * TILE + j] = factor * np.int32(sums[t, s])
            for b in range(n_blocks):
                dpack[k, b * TILE + j] = d[t, b]
    return xpack, mpack, dpack


@kernel(inline=True)
def store_tile(out, part, first, r):
    """``out[first + j, r] = part[j]`` for the tile's tokens that exist (``first + j < n``)."""
    for j in range(min(TILE, out.shape[0] - first)):
        out[first + j, r] = part[j]


@kernel(inline=True)
def tiled_products(raw, xt, out, kind):
    """``out[t] = W @ xt[t]`` (module docstring) for ``kind`` 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K), a
    constant of each caller (LLVM drops the other kinds' branches).

    Rows go in chunks of :data:`CHUNK_BYTES` of decoded codes: a chunk's rows are decoded once, then
    multiplied with every tile (one tile: one row at a time, its codes in the first-level cache)."""
    n, cols = xt.shape
    rows = raw.shape[0]
    n_blocks = cols // QK_K
    tiles = (n + TILE - 1) // TILE
    q, d, bsums, finite = quantize_rows_q8_k(xt, tiles * TILE)
    if not finite:
        return False
    if kind == 6:
        xpack, mpack, dpack = pack_tiles(q, d, bsums, np.int32(-Q6_K_OFFSET), tiles)
    else:
        xpack, mpack, dpack = pack_tiles(q, d, bsum_pairs(bsums).view(np.int32), np.int32(1), tiles)
    chunk = 1 if tiles == 1 else max(1, CHUNK_BYTES // (4 * n_blocks * (WORDS + SCALES)))
    codes = np.empty((min(chunk, rows), n_blocks * WORDS), dtype=np.int32)
    scales = np.empty((min(chunk, rows), n_blocks * SCALES), dtype=np.int32)
    part = np.empty(TILE, dtype=F32)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        for r in range(r0, r1):
            if kind == 4:
                decode_q4_k(raw[r], n_blocks, codes[r - r0], scales[r - r0])
            elif kind == 5:
                decode_q5_k(raw[r], n_blocks, codes[r - r0], scales[r - r0])
            else:
                decode_q6_k(raw[r], n_blocks, codes[r - r0], scales[r - r0])
        for k in range(tiles):
            for r in range(r0, r1):
                c, s = codes[r - r0], scales[r - r0]
                if kind == 4:
                    tile_q4_k(raw[r], xpack[k], mpack[k], dpack[k], n_blocks, part, c, s)
                elif kind == 5:
                    tile_q5_k(raw[r], xpack[k], mpack[k], dpack[k], n_blocks, part, c, s)
                else:
                    tile_q6_k(raw[r], xpack[k], mpack[k], dpack[k], n_blocks, part, c, s)
                store_tile(out, part, k * TILE, r)
    return True


@kernel(exact=True)  # the float operations as written: the same bits on every path
def matmat_tiled_q4_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token of a Q4_K matrix (``xt``: ``(n, cols)`` float32,
    ``out``: ``(n, rows)``) in tiles of :data:`TILE` tokens (module docstring). Returns False,
    leaving ``out`` unwritten, when ``xt`` holds NaN or inf (they do not quantize)."""
    return tiled_products(raw, xt, out, 4)


@kernel(exact=True)
def matmat_tiled_q5_k(raw, xt, out):
    """:func:`matmat_tiled_q4_k` for a Q5_K matrix."""
    return tiled_products(raw, xt, out, 5)


@kernel(exact=True)
def matmat_tiled_q6_k(raw, xt, out):
    """:func:`matmat_tiled_q4_k` for a Q6_K matrix (its ``mpack``: ``-32`` times the Q8_K block sums)."""
    return tiled_products(raw, xt, out, 6)
