"""Whole-row integer dot products of the 32-value legacy types (Q4_0, Q5_0) against Q8_0 ``x``.

:mod:`.rowdot`'s scheme for ``ggml_vec_dot_q4_0_q8_0`` and ``ggml_vec_dot_q5_0_q8_0``
(``ggml-cpu/arch/x86/quants.c``, the ``__AVX2__`` branch), with ggml's integers and float order:
per block ggml computes 8 int32 lanes, each the dot of 4 signed codes (``nibble - 8``; for Q5_0
``nibble - 16`` where the ``qh`` bit is clear) with 4 quants (``mul_sum_i8_pairs_float``), then
``acc = fmuladd(d_w * d_x, float(lanes), acc)`` on 8 lanes and ``hsum_float_8`` at the end. Here the
codes stay unsigned (``nibble``, ``nibble | 16 bit``: ``pmaddubsw`` takes them as they are, no
sign trick) and each lane then subtracts ``8`` (``16``) times the sum of its 4 quants, precomputed
once per ``x`` (``offsets``: :func:`.int8.lane_offsets`): the same int32 per lane, so the result
is ggml's bit for bit, and depends only on the row and ``x``.

Arguments: ``row`` one weight row (uint8 bytes, 1-D), ``q`` the int8 Q8_0 quants of ``x``, ``d``
their float32 scales (one per 32 values, already rounded to float16), ``offsets`` int32, 8 per
block (lane ``i`` of block ``b``: the code offset times ``sum(q[32 b + 4 i : 32 b + 4 i + 4])``),
``n_blocks`` the blocks of the row. Returns float32. No bounds checks: the callers size every
array from the row's column count.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import rowdot
from .rowdot import (
    F32,
    I8,
    I16,
    I32,
    I64,
    V8F32,
    V8I32,
    V16I16,
    V32I8,
    _const,
    _fmuladd,
    _half,
    _lanes,
    _madd,
    _maddubs,
    _offset,
    _ok,
    _Ptr,
    _row_loop,
    _splat,
    _vsplat,
)

Q4_0_BYTES = 18
Q5_0_BYTES = 22
V16I8 = ir.VectorType(I8, 16)


def _nibbles32(builder: ir.IRBuilder, w: _Ptr, off: Any) -> Any:
    """ggml's ``bytes_from_nibbles_32``: ``<32 x i8>`` of the low nibbles of the 16 bytes at ``off``
    (values 0..15) then their high nibbles (values 16..31)."""
    raw = w.load(off, V16I8)
    both = builder.shuffle_vector(raw, builder.lshr(raw, _vsplat(V16I8, 4)), _lanes(list(range(32))))
    return builder.and_(both, _vsplat(V32I8, 15))


def _fifth_bits(builder: ir.IRBuilder, w: _Ptr, off: Any) -> Any:
    """``<32 x i8>``: 16 where bit ``j`` of the little-endian uint32 at ``off`` is set, else 0 (the
    fifth bit of a Q5_0 code; ggml's ``bytes_from_bits_32`` of ``qh``)."""
    qh = w.load(off, I32)
    words = builder.insert_element(ir.Constant(ir.VectorType(I32, 4), ir.Undefined), qh, _const(I32, 0))
    data = builder.bitcast(words, V16I8)
    spread = builder.shuffle_vector(data, data, _lanes([j // 8 for j in range(32)]))
    bit = builder.and_(spread, ir.Constant(V32I8, [1 << (j % 8) for j in range(32)]))
    clear = builder.icmp_unsigned("==", bit, _vsplat(V32I8, 0))
    return builder.select(clear, _vsplat(V32I8, 0), _vsplat(V32I8, 16))


def _codegen(block_bytes: int, fifth_bit: bool) -> Any:
    """Code generator of one Q4_0 row (``fifth_bit`` False) or Q5_0 row with Q8_0 ``x``."""
    qs = 6 if fifth_bit else 2

    def codegen(context, builder, signature, args):
        avx2 = rowdot._avx2()  # through the module: the tests turn it off
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        offsets = _Ptr(context, builder, signature.args[3], args[3])

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, block_bytes))
            codes = _nibbles32(builder, w, _offset(builder, o, qs))
            if fifth_bit:
                codes = builder.or_(codes, _fifth_bits(builder, w, _offset(builder, o, 2)))
            quants = qx.load(builder.mul(b, _const(I64, 32)), V32I8)
            sums = _madd(builder, _maddubs(builder, codes, quants, avx2), _vsplat(V16I16, 1), avx2)
            sums = builder.sub(sums, offsets.load(builder.mul(b, _const(I64, 8)), V8I32, 4))
            scale = builder.fmul(_half(builder, w.load(o, I16)), dx.load(b, F32, align=4))
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sums, V8F32), acc), accs

        return _row_loop(context, builder, args[4], body, with_scalar=False, prefetch=(w, block_bytes))

    return codegen


def _ok_offsets(row: Any, q: Any, d: Any, offsets: Any, n_blocks: Any) -> bool:
    return (
        _ok(row, q, d, n_blocks)
        and isinstance(offsets, types.Array)
        and offsets.ndim == 1
        and offsets.dtype == types.int32
    )


@intrinsic
def rowdot_q4_0(typingctx, row, q, d, offsets, n_blocks):
    """``ggml_vec_dot_q4_0_q8_0`` of one Q4_0 row with Q8_0 ``x`` (``q``, ``d``; ``offsets``:
    :func:`.int8.lane_offsets` by 8): float32."""
    if not _ok_offsets(row, q, d, offsets, n_blocks):
        return None
    return types.float32(row, q, d, offsets, n_blocks), _codegen(Q4_0_BYTES, fifth_bit=False)


@intrinsic
def rowdot_q5_0(typingctx, row, q, d, offsets, n_blocks):
    """``ggml_vec_dot_q5_0_q8_0`` of one Q5_0 row with Q8_0 ``x`` (``q``, ``d``; ``offsets``:
    :func:`.int8.lane_offsets` by 16): float32."""
    if not _ok_offsets(row, q, d, offsets, n_blocks):
        return None
    return types.float32(row, q, d, offsets, n_blocks), _codegen(Q5_0_BYTES, fifth_bit=True)
