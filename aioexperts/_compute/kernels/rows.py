"""Batch-invariant float products: several tokens per weight row, each token's sum in a fixed order.

``matrows_<type>(raw, xt, out)`` computes ``out = xt @ W.T`` (float32 ``x``, as the ``matvec``
kernels) so that each token's row of ``out`` is bit for bit what that token gets alone, however
many tokens are in the call and in which order: cross-request batching then gives every sequence
its lone-stream numbers (issue 22) while each weight block is decoded once for up to
:data:`ROW_TOKENS` tokens (4 with AVX-512, else 3).

How: the row loop is LLVM IR (as :mod:`.rowdot`), with no fast-math flag anywhere (the kernels
are compiled ``exact``). Per 32 weights of a Q4_K block the codes are decoded once to
``w = (d * sc_j) * q`` (float32, ``<32 x float>``); every token of the group adds
``fmuladd(w, x, acc)`` into its own 32-lane accumulator; the mins term ``sum_j (dmin * m_j) *
sum(x over sub-block j)`` goes into an 8-lane accumulator per token (lane j: sub-block j of every
block); the row's result is a fixed shuffle tree over the 32 lanes minus the one over the 8. Each
token's operations are the same sequence whichever group (1 to 4 tokens) it is computed in, so
its result is too.

Q8_0 is the same with ``w = d * q`` per 32 weights and no mins term.

The Q4_K formula is llama.cpp's Q4_K dot product (``ggml_vec_dot_q4_K_q8_K``: ``d sum_j sc_j dot_j -
dmin sum_j m_j bsum_j``) on float32 ``x``; it differs from :func:`.kquants.matvec_q4_k` (which
sums each 32 codes first, then scales) by float32 rounding only (about 1e-7 relative); Q8_0
differs from :func:`.legacy.matvec_q8_0` likewise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel
from .common import PREFETCH_ROWS, prefetch_row, sub_sums
from .rowdot import (
    F32,
    I16,
    I64,
    Q4_K_BYTES,
    Q8_0_BYTES,
    V32I8,
    _call,
    _const,
    _half,
    _hsum8,
    _i64,
    _lanes,
    _offset,
    _Ptr,
    _scales_mins_k4,
    _splat,
    _vsplat,
)
from .simd import _target_features

# ruff: noqa: N803, N806

V32F = ir.VectorType(F32, 32)
V8F = ir.VectorType(F32, 8)
QK_K = 256
#: 4 tokens per group where the target has 32 512-bit registers (AVX-512: 4 x 2 zmm accumulators
#: + 2 of ``w``), else 3 (AVX2: 3 x 4 ymm accumulators + the 4 of ``w``, no spill). Either way each
#: token's operations are the same, so its result does not depend on the group.
GROUP_OF_4 = "+avx512f" in _target_features()[1]
#: tokens decoded together per weight row at most
ROW_TOKENS = 4 if GROUP_OF_4 else 3


def _hsum32(builder: ir.IRBuilder, v: Any) -> Any:
    """Sum of 32 lanes by a fixed tree: halves to 16, halves to 8, then ggml's ``hsum_float_8``."""
    a = builder.fadd(
        builder.shuffle_vector(v, v, _lanes(list(range(16)))), builder.shuffle_vector(v, v, _lanes(list(range(16, 32))))
    )
    b = builder.fadd(
        builder.shuffle_vector(a, a, _lanes(list(range(8)))), builder.shuffle_vector(a, a, _lanes(list(range(8, 16))))
    )
    return _hsum8(builder, b)


def _args_ok(row: Any, x: Any, xs: Any, out: Any, ints: tuple[Any, ...]) -> bool:
    def one_d(t: Any, dtype: Any) -> bool:
        return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype

    return (
        one_d(row, types.uint8)
        and one_d(x, types.float32)
        and one_d(xs, types.float32)
        and one_d(out, types.float32)
        and all(isinstance(t, types.Integer) for t in ints)
    )


def _make_rows_q4_k(k: int) -> Any:
    @intrinsic
    def rows_q4_k(typingctx, row, x, x_off, x_stride, xs, xs_off, xs_stride, n_blocks, out, out_off, out_stride):
        """One Q4_K row dotted with ``k`` tokens: ``out[out_off + i * out_stride]`` for ``i < k``.

        ``x``: the tokens' float32 values, token ``i`` at ``x_off + i * x_stride``; ``xs``: their sums
        per 32 values, token ``i`` at ``xs_off + i * xs_stride``. No bounds checks (the caller sizes
        everything from the row's column count).
        """
        if not _args_ok(row, x, xs, out, (x_off, x_stride, xs_off, xs_stride, n_blocks, out_off, out_stride)):
            return None
        sig = types.void(row, x, x_off, x_stride, xs, xs_off, xs_stride, n_blocks, out, out_off, out_stride)

        def codegen(context, builder, signature, args):
            a = signature.args
            w = _Ptr(context, builder, a[0], args[0])
            xp = _Ptr(context, builder, a[1], args[1])
            sp = _Ptr(context, builder, a[4], args[4])
            op = _Ptr(context, builder, a[8], args[8])
            x_off, x_stride, xs_off, xs_stride, out_off, out_stride = (
                _i64(builder, args[i]) for i in (2, 3, 5, 6, 9, 10)
            )
            x_at = [builder.add(x_off, builder.mul(x_stride, _const(I64, i))) for i in range(k)]
            s_at = [builder.add(xs_off, builder.mul(xs_stride, _const(I64, i))) for i in range(k)]
            acc_slots = [cgutils.alloca_once_value(builder, ir.Constant(V32F, [0.0] * 32)) for _ in range(k)]
            min_slots = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(k)]
            low_mask, four = _vsplat(V32I8, 15), _vsplat(V32I8, 4)
            with cgutils.for_range(builder, _i64(builder, args[7])) as loop:
                b = loop.index
                o = builder.mul(b, _const(I64, Q4_K_BYTES))
                d = _half(builder, w.load(o, I16))
                dmin = _half(builder, w.load(_offset(builder, o, 2), I16))
                scales, mins = _scales_mins_k4(builder, w, o)
                scale_f = builder.fmul(builder.uitofp(scales, V8F), _splat(builder, d, 8))  # d * sc_j
                min_f = builder.fmul(builder.uitofp(mins, V8F), _splat(builder, dmin, 8))  # dmin * m_j
                xb = builder.mul(b, _const(I64, QK_K))
                acc = [builder.load(s) for s in acc_slots]
                for c in range(4):
                    bits = w.load(_offset(builder, o, 16 + 32 * c), V32I8)
                    for half, codes in enumerate((builder.and_(bits, low_mask), builder.lshr(bits, four))):
                        lane = builder.shuffle_vector(scale_f, scale_f, _lanes([2 * c + half] * 32))
                        wv = builder.fmul(builder.uitofp(codes, V32F), lane)
                        xo = _offset(builder, xb, 64 * c + 32 * half)
                        for i in range(k):
                            xv = xp.load(builder.add(x_at[i], xo), V32F, align=4)
                            acc[i] = _call(builder, "llvm.fmuladd.v32f32", V32F, [wv, xv, acc[i]])
                for i in range(k):
                    builder.store(acc[i], acc_slots[i])
                sb = builder.mul(b, _const(I64, 8))
                for i in range(k):
                    sums = sp.load(builder.add(s_at[i], sb), V8F, align=4)
                    m = _call(builder, "llvm.fmuladd.v8f32", V8F, [min_f, sums, builder.load(min_slots[i])])
                    builder.store(m, min_slots[i])
            for i in range(k):
                dots = _hsum32(builder, builder.load(acc_slots[i]))
                total = builder.fsub(dots, _hsum8(builder, builder.load(min_slots[i])))
                at = builder.add(out_off, builder.mul(out_stride, _const(I64, i)))
                builder.store(total, builder.gep(op.data, [at]))
            return context.get_dummy_value()

        return sig, codegen

    return rows_q4_k


def _make_rows_q8_0(k: int) -> Any:
    @intrinsic
    def rows_q8_0(typingctx, row, x, x_off, x_stride, n_blocks, out, out_off, out_stride):
        """One Q8_0 row dotted with ``k`` tokens: ``out[out_off + i * out_stride]`` for ``i < k``
        (``x`` as for Q4_K; no sums of ``x`` are needed)."""
        if not _args_ok(row, x, x, out, (x_off, x_stride, n_blocks, out_off, out_stride)):
            return None
        sig = types.void(row, x, x_off, x_stride, n_blocks, out, out_off, out_stride)

        def codegen(context, builder, signature, args):
            a = signature.args
            w = _Ptr(context, builder, a[0], args[0])
            xp = _Ptr(context, builder, a[1], args[1])
            op = _Ptr(context, builder, a[5], args[5])
            x_off, x_stride, out_off, out_stride = (_i64(builder, args[i]) for i in (2, 3, 6, 7))
            x_at = [builder.add(x_off, builder.mul(x_stride, _const(I64, i))) for i in range(k)]
            acc_slots = [cgutils.alloca_once_value(builder, ir.Constant(V32F, [0.0] * 32)) for _ in range(k)]
            with cgutils.for_range(builder, _i64(builder, args[4])) as loop:
                b = loop.index
                o = builder.mul(b, _const(I64, Q8_0_BYTES))
                d = _half(builder, w.load(o, I16))
                wv = builder.fmul(builder.sitofp(w.load(_offset(builder, o, 2), V32I8), V32F), _splat(builder, d, 32))
                xo = builder.mul(b, _const(I64, 32))
                for i in range(k):
                    xv = xp.load(builder.add(x_at[i], xo), V32F, align=4)
                    acc = _call(builder, "llvm.fmuladd.v32f32", V32F, [wv, xv, builder.load(acc_slots[i])])
                    builder.store(acc, acc_slots[i])
            for i in range(k):
                at = builder.add(out_off, builder.mul(out_stride, _const(I64, i)))
                builder.store(_hsum32(builder, builder.load(acc_slots[i])), builder.gep(op.data, [at]))
            return context.get_dummy_value()

        return sig, codegen

    return rows_q8_0


rows1_q8_0 = _make_rows_q8_0(1)
rows2_q8_0 = _make_rows_q8_0(2)
rows3_q8_0 = _make_rows_q8_0(3)
rows4_q8_0 = _make_rows_q8_0(4)
rows1_q4_k = _make_rows_q4_k(1)
rows2_q4_k = _make_rows_q4_k(2)
rows3_q4_k = _make_rows_q4_k(3)
rows4_q4_k = _make_rows_q4_k(4)


@kernel(exact=True)
def matrows_q4_k(raw, xt, out):
    """``out = xt @ W.T`` for a Q4_K matrix: ``raw`` ``(rows, row_bytes)`` uint8, ``xt`` ``(n, cols)``
    float32, ``out`` ``(n, rows)`` float32; each token's row bit for bit its result alone.

    Tokens go in groups of 4 (with AVX-512, :data:`GROUP_OF_4`), then of 3 (4 as 2 + 2, so that no
    group of 1 follows a group of 3), each group decoding every weight block once.
    """
    n = xt.shape[0]
    cols = xt.shape[1]
    rows = raw.shape[0]
    n_sub = cols // 32
    n_blocks = cols // QK_K
    xs = np.empty(n * n_sub, dtype=np.float32)
    for t in range(n):
        sub_sums(xt[t], 32, xs[t * n_sub : (t + 1) * n_sub])
    xf = xt.reshape(n * cols)
    of = out.reshape(n * rows)
    for r in range(rows):
        prefetch_row(raw, r + PREFETCH_ROWS)
        row = raw[r]
        t = 0
        if GROUP_OF_4:
            while n - t >= 4:
                rows4_q4_k(row, xf, t * cols, cols, xs, t * n_sub, n_sub, n_blocks, of, t * rows + r, rows)
                t += 4
        while n - t == 3 or n - t > 4:
            rows3_q4_k(row, xf, t * cols, cols, xs, t * n_sub, n_sub, n_blocks, of, t * rows + r, rows)
            t += 3
        while n - t >= 2:
            rows2_q4_k(row, xf, t * cols, cols, xs, t * n_sub, n_sub, n_blocks, of, t * rows + r, rows)
            t += 2
        if n - t == 1:
            rows1_q4_k(row, xf, t * cols, cols, xs, t * n_sub, n_sub, n_blocks, of, t * rows + r, rows)


@kernel(exact=True)
def matrows_q8_0(raw, xt, out):
    """``out = xt @ W.T`` for a Q8_0 matrix (see :func:`matrows_q4_k`): ``w = d * q`` per 32 weights,
    each token's row bit for bit its result alone."""
    n = xt.shape[0]
    cols = xt.shape[1]
    rows = raw.shape[0]
    n_blocks = cols // 32
    xf = xt.reshape(n * cols)
    of = out.reshape(n * rows)
    for r in range(rows):
        prefetch_row(raw, r + PREFETCH_ROWS)
        row = raw[r]
        t = 0
        if GROUP_OF_4:
            while n - t >= 4:
                rows4_q8_0(row, xf, t * cols, cols, n_blocks, of, t * rows + r, rows)
                t += 4
        while n - t == 3 or n - t > 4:
            rows3_q8_0(row, xf, t * cols, cols, n_blocks, of, t * rows + r, rows)
            t += 3
        while n - t >= 2:
            rows2_q8_0(row, xf, t * cols, cols, n_blocks, of, t * rows + r, rows)
            t += 2
        if n - t == 1:
            rows1_q8_0(row, xf, t * cols, cols, n_blocks, of, t * rows + r, rows)
