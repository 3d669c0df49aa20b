"""One weight row against several quantized tokens at once: :mod:`.rowdot`'s loops with the row decoded once.

``rowdots_<type>(row, q, d, bsums, n_blocks, t0)`` returns the float32 results of tokens
``t0 .. t0 + TOKENS - 1`` as a tuple: for every block the weight codes and scales are unpacked once
(nibbles, the 6-bit scales and mins) and then multiplied with each token's quants, each token with
its own 8-lane accumulator. Per token the operations are those of :func:`.rowdot.rowdot_q4_k`
(:func:`.rowdot.rowdot_q5_k`), in the same order: the same integer sums, the same
``fmuladd(d_w * d_x, float(sumi), acc)`` per block, the same mins' term (:func:`.rowdot._mins_step`)
and ggml's ``hsum_float_8`` at the end, so each result is bit for bit that token's one-token result
(``tests/compute/test_int8_rows.py``).

Arguments: ``row`` one weight row (uint8, 1-D); ``q`` ``(n, cols)`` int8, ``d`` ``(n, n_blocks)``
float32: every token's Q8_K quants; ``bsums`` ``(n, 8 n_blocks)`` int16: the sums of the Q8_K
block sums in pairs (``bsums[2j] + bsums[2j+1]``: the 32 values of one scale and min, at most
``32 * 128`` in magnitude), ggml's ``q8s``, so that the mins' term is one 128-bit ``pmaddwd`` as
in :mod:`.rowdot` (which pairs them per block); all C-contiguous, sized by the callers, ``t0 + TOKENS <= n`` (no
bounds checks).
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import rowdot
from .rowdot import (
    F32,
    I16,
    I64,
    Q4_K_BYTES,
    Q5_K_BYTES,
    V8F32,
    V8I16,
    V16I16,
    V32I8,
    _const,
    _fmuladd,
    _half,
    _hsum8,
    _i64,
    _lanes,
    _madd4,
    _mins_k,
    _mins_step,
    _offset,
    _Ptr,
    _scales_mins_k4,
    _splat,
    _vsplat,
)

#: tokens one call computes
TOKENS = 4


def _ok(row: Any, q: Any, d: Any, bsums: Any, n_blocks: Any, t0: Any) -> bool:
    def array(t: Any, ndim: int, dtype: Any) -> bool:
        return isinstance(t, types.Array) and t.ndim == ndim and t.dtype == dtype and t.layout == "C"

    return (
        isinstance(row, types.Array)
        and row.ndim == 1
        and row.dtype == types.uint8
        and array(q, 2, types.int8)
        and array(d, 2, types.float32)
        and array(bsums, 2, types.int16)
        and isinstance(n_blocks, types.Integer)
        and isinstance(t0, types.Integer)
    )


def _k4_tokens_codegen(block_bytes: int, qs: int, qh: int | None) -> Any:
    """Code generator of one Q4_K (``qh`` None) or Q5_K row against :data:`TOKENS` tokens."""

    def codegen(context, builder, signature, args):
        avx2 = rowdot._avx2()  # through the module: the tests turn it off
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        bs = _Ptr(context, builder, signature.args[3], args[3])
        n_blocks = _i64(builder, args[4])
        t0 = _i64(builder, args[5])
        low_mask = _vsplat(V32I8, 15)
        four = _vsplat(V32I8, 4)
        accs_zero, finish = _mins_k(builder, qh is None)
        slots = [
            (
                cgutils.alloca_once_value(builder, ir.Constant(V8F32, [0.0] * 8)),
                cgutils.alloca_once_value(builder, accs_zero),
            )
            for _ in range(TOKENS)
        ]
        with cgutils.for_range(builder, n_blocks) as loop:
            b = loop.index
            o = builder.mul(b, _const(I64, block_bytes))
            d_w = _half(builder, w.load(o, I16))
            dmin_w = _half(builder, w.load(_offset(builder, o, 2), I16))
            scales, mins = _scales_mins_k4(builder, w, o)
            mins8 = builder.zext(mins, V8I16)
            scales16 = builder.zext(builder.shuffle_vector(scales, scales, _lanes(list(range(8)) * 2)), V16I16)
            high = None if qh is None else w.load(_offset(builder, o, qh), V32I8)
            codes: list[Any] = []
            sub_scales: list[Any] = []
            for c in range(4):
                bits = w.load(_offset(builder, o, qs + 32 * c), V32I8)
                for half, code in enumerate((builder.and_(bits, low_mask), builder.lshr(bits, four))):
                    if high is not None:  # bit 2c + half of qh[i]: bit 4 of the code
                        fifth = builder.and_(builder.lshr(high, _vsplat(V32I8, 2 * c + half)), _vsplat(V32I8, 1))
                        code = builder.or_(code, builder.shl(fifth, four))
                    codes.append(code)
                    sub_scales.append(
                        builder.shuffle_vector(scales16, scales16, _lanes([2 * c + half] * 8 + [8 + 2 * c + half] * 8))
                    )
            for i, (acc_slot, scalar_slot) in enumerate(slots):
                tb = builder.add(builder.mul(_offset(builder, t0, i), n_blocks), b)  # token's block index
                x_scale = dx.load(tb, F32, align=4)
                pairs = bs.load(builder.mul(tb, _const(I64, 8)), V8I16, 2)  # bsum_2j + bsum_2j+1
                prod = _madd4(builder, mins8, pairs, avx2)
                xo = builder.mul(tb, _const(I64, 256))
                pieces = [
                    (code, qx.load(_offset(builder, xo, 32 * k), V32I8), scale)
                    for k, (code, scale) in enumerate(zip(codes, sub_scales, strict=True))
                ]
                # 256-bit: the 512-bit pairs (rowdot.scaled_sums' wide) ran 8% slower for 4 tokens on an AVX-512 Xeon
                sumi = rowdot.scaled_sums(builder, pieces, avx2, False)
                scale = builder.fmul(x_scale, d_w)
                acc = _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), builder.load(acc_slot))
                builder.store(acc, acc_slot)
                accs = _mins_step(builder, x_scale, dmin_w, prod, builder.load(scalar_slot), qh is None)
                builder.store(accs, scalar_slot)
        values = [
            finish(_hsum8(builder, builder.load(acc_slot)), builder.load(scalar_slot))
            for acc_slot, scalar_slot in slots
        ]
        return context.make_tuple(builder, signature.return_type, values)

    return codegen


@intrinsic
def rowdots_q4_k(typingctx, row, q, d, bsums, n_blocks, t0):
    """:func:`.rowdot.rowdot_q4_k` of one Q4_K row for the :data:`TOKENS` tokens from ``t0``."""
    if not _ok(row, q, d, bsums, n_blocks, t0):
        return None
    sig = types.UniTuple(types.float32, TOKENS)(row, q, d, bsums, n_blocks, t0)
    return sig, _k4_tokens_codegen(Q4_K_BYTES, 16, None)


@intrinsic
def rowdots_q5_k(typingctx, row, q, d, bsums, n_blocks, t0):
    """:func:`.rowdot.rowdot_q5_k` of one Q5_K row for the :data:`TOKENS` tokens from ``t0``."""
    if not _ok(row, q, d, bsums, n_blocks, t0):
        return None
    sig = types.UniTuple(types.float32, TOKENS)(row, q, d, bsums, n_blocks, t0)
    return sig, _k4_tokens_codegen(Q5_K_BYTES, 48, 16)
