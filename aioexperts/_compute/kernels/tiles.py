"""Q4_K products of many tokens at once: the weight codes broadcast over a vector of tokens.

:mod:`.rowdots` follows ggml's one-token loop (``ggml_vec_dot_q4_K_q8_K``) for a few tokens, so that
each token's result is bit for bit its one-token result: per 32 values and token it spends a
``pmaddubsw``, a ``pmaddwd`` and an add on 32 products. For a prefill that bit-equality is not
needed, and the products can be laid out the other way round, as ggml's tiled matmul does
(``ggml-cpu/tiled``): ``x``'s Q8_K quants are packed so that one vector holds 4 consecutive values
of :data:`TILE` tokens (``xpack[g, j] = q_j[4 g : 4 g + 4]`` as an int32), and 4 codes of one weight
row are broadcast to every lane. Then one ``pmaddubsw`` and one ``pmaddwd`` (with the sub-block's
scale) give ``scale * sum(code * q)`` over 4 values for every token of the tile: 4 products per
lane and instruction instead of 1, the scale included.

Per block, ``y_j += d_w d_j sum_s sc_s dot_sj - dmin_w d_j sum_s m_s bsum_sj`` for all tokens of the
tile in float32 lanes: llama.cpp's arithmetic (its Q8_K rounding of ``x``, the same integer sums
per block) to float rounding (the blocks are added in another order than ggml's 8-lane
accumulator, about 1e-7 relative). ``TILE`` is 16 tokens on x86 with AVX-512BW, else 8.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel
from . import rowdot
from .common import F32
from .int8 import QK_K, bsum_pairs, quantize_rows_q8_k
from .rowdot import I16, I32, I64, Q4_K_BYTES, _call, _const, _half, _i64, _lanes, _pair_sums, _Ptr, _scales_mins_k4

# ruff: noqa: N803, N806

I8 = ir.IntType(8)
#: tokens per tile: the int32 lanes of one vector
TILE = 16 if rowdot._avx512bw() else 8
#: int32 groups of 4 quants per Q8_K block
GROUPS = QK_K // 4


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
    quants signed; no int16 saturation: codes <= 15, ``|q| <= 128``)."""
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


@intrinsic
def tile_q4_k(typingctx, row, xpack, mpack, dx, n_blocks, out):
    """One Q4_K row against one tile of tokens: ``out[j]`` (float32, :data:`TILE` of them).

    ``row``: the row's bytes (uint8, 1-D); ``xpack``: int32 ``(n_blocks * GROUPS * TILE,)``, element
    ``(b GROUPS + g) TILE + j`` = the quants ``4 g .. 4 g + 3`` of block ``b`` of token ``j``;
    ``mpack``: int32 ``(n_blocks * 8 * TILE,)``, the sums of the quants per 32 values
    (``(b 8 + s) TILE + j``); ``dx``: float32 ``(n_blocks * TILE,)``, the Q8_K scales. No bounds
    checks: the caller sizes every array.
    """

    def one_d(t: Any, dtype: Any) -> bool:
        return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype and t.layout == "C"

    ok = (
        one_d(row, types.uint8)
        and one_d(xpack, types.int32)
        and one_d(mpack, types.int32)
        and one_d(dx, types.float32)
        and isinstance(n_blocks, types.Integer)
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
    )
    if not ok:
        return None
    sig = types.int64(row, xpack, mpack, dx, n_blocks, out)
    tile = TILE

    def codegen(context, builder, signature, args):
        x86 = rowdot._avx2()
        vnni = x86 and tile == 16 and _vnni()
        vb, vh, vi, vf = _vectors(tile)
        v32i8 = ir.VectorType(I8, 32)
        v8i32 = ir.VectorType(I32, 8)
        w = _Ptr(context, builder, signature.args[0], args[0])
        xp = _Ptr(context, builder, signature.args[1], args[1])
        mp = _Ptr(context, builder, signature.args[2], args[2])
        dp = _Ptr(context, builder, signature.args[3], args[3])
        acc_slot = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * tile))
        low_mask = ir.Constant(v32i8, [15] * 32)
        four = ir.Constant(v32i8, [4] * 32)
        with cgutils.for_range(builder, _i64(builder, args[4])) as loop:
            b = loop.index
            o = builder.mul(b, _const(I64, Q4_K_BYTES))
            d_w = _half(builder, w.load(o, I16))
            dmin_w = _half(builder, w.load(builder.add(o, _const(I64, 2)), I16))
            scales, mins = _scales_mins_k4(builder, w, o)
            sumi = ir.Constant(vi, [0] * tile)
            xb = builder.mul(b, _const(I64, GROUPS * tile))
            for c in range(4):
                bits = w.load(builder.add(o, _const(I64, 16 + 32 * c)), v32i8)
                for half, codes in enumerate((builder.and_(bits, low_mask), builder.lshr(bits, four))):
                    s = 2 * c + half
                    words = builder.bitcast(codes, v8i32)
                    scale = builder.extract_element(scales, _const(I32, s))
                    if vnni:  # one vpdpbusd per 4 values of every token, the scale once per 32 values
                        dots = ir.Constant(vi, [0] * tile)
                        for g in range(8):
                            wb = _splat_lane(builder, words, g, tile)
                            xq = xp.load(builder.add(xb, _const(I64, (8 * s + g) * tile)), vi, align=4)
                            dots = _call(builder, "llvm.x86.avx512.vpdpbusd.512", vi, [dots, wb, xq])
                        scale_v = _splat_scalar(builder, builder.zext(scale, I32), tile)
                        sumi = builder.add(sumi, builder.mul(dots, scale_v))
                        continue
                    scale_v = _splat_scalar(builder, builder.zext(scale, I16), 2 * tile)
                    for g in range(8):
                        wb = builder.bitcast(_splat_lane(builder, words, g, tile), vb)
                        xq = xp.load(builder.add(xb, _const(I64, (8 * s + g) * tile)), vb, align=4)
                        sumi = builder.add(sumi, _pair_products(builder, wb, xq, scale_v, tile, x86))
            msum = ir.Constant(vi, [0] * tile)
            mb = builder.mul(b, _const(I64, 8 * tile))
            for s in range(8):
                m = _splat_scalar(builder, builder.zext(builder.extract_element(mins, _const(I32, s)), I32), tile)
                msum = builder.add(msum, builder.mul(m, mp.load(builder.add(mb, _const(I64, s * tile)), vi, align=4)))
            dxv = dp.load(builder.mul(b, _const(I64, tile)), vf, align=4)
            main = builder.fmul(builder.sitofp(sumi, vf), builder.fmul(dxv, _splat_scalar(builder, d_w, tile)))
            mins_term = builder.fmul(builder.sitofp(msum, vf), builder.fmul(dxv, _splat_scalar(builder, dmin_w, tile)))
            builder.store(builder.fadd(builder.load(acc_slot), builder.fsub(main, mins_term)), acc_slot)
        o_ptr = _Ptr(context, builder, signature.args[5], args[5])
        target = builder.bitcast(builder.gep(o_ptr.data, [_const(I64, 0)]), vf.as_pointer())
        builder.store(builder.load(acc_slot), target, align=4)
        return _const(I64, 0)

    return sig, codegen


@kernel(exact=True)  # the float operations as written: the same bits on every path
def matmat_tiled_q4_k(raw, xt, out):
    """``out[t] = W @ xt[t]`` for every token (``xt``: ``(n, cols)`` float32, ``out``: ``(n, rows)``)
    in tiles of :data:`TILE` tokens (module docstring). Returns False, leaving ``out`` unwritten,
    when ``xt`` holds NaN or inf (they do not quantize)."""
    n, cols = xt.shape
    rows = raw.shape[0]
    n_blocks = cols // QK_K
    tiles = (n + TILE - 1) // TILE
    q, d, bsums, finite = quantize_rows_q8_k(xt, tiles * TILE)
    if not finite:
        return False
    pairs = bsum_pairs(bsums)  # sums per 32 quants
    q32 = q.view(np.int32)  # (tiles * TILE, cols // 4)
    xpack = np.empty((tiles, (cols // 4) * TILE), dtype=np.int32)
    mpack = np.empty((tiles, n_blocks * 8 * TILE), dtype=np.int32)
    dpack = np.empty((tiles, n_blocks * TILE), dtype=F32)
    for k in range(tiles):
        for j in range(TILE):
            t = k * TILE + j
            for g in range(cols // 4):
                xpack[k, g * TILE + j] = q32[t, g]
            for s in range(n_blocks * 8):
                mpack[k, s * TILE + j] = pairs[t, s]
            for b in range(n_blocks):
                dpack[k, b * TILE + j] = d[t, b]
    part = np.empty(TILE, dtype=F32)
    for k in range(tiles):
        width = min(TILE, n - k * TILE)
        for r in range(rows):
            tile_q4_k(raw[r], xpack[k], mpack[k], dpack[k], n_blocks, part)
            for j in range(width):
                out[k * TILE + j, r] = part[j]
    return True
