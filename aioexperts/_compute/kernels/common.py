"""Helpers shared by the kernels: scale decoding, software prefetch, sums of ``x``, blocked products.

Integer widths are kept explicit (``np.uint32(...)`` around bit operations): numba types integer
arithmetic as int64, and LLVM then vectorises on 64-bit lanes (docs/notes/KERNELS.md, pitfall 1).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import kernel

# ruff: noqa: N803, N806  (numba kernels keep ggml's short names)

F32 = np.float32
U8 = np.uint8
U32 = np.uint32

#: float16 exponent field all ones: inf or NaN
HALF_EXP_MASK = U32(0x7C00)
HALF_SIGN = U32(0x8000)
HALF_MANT_MASK = U32(0x03FF)
#: float32 exponent bias minus float16 exponent bias, in float32 exponent position
HALF_REBIAS = U32((127 - 15) << 23)
FLOAT_EXP_MASK = U32(0x7F80_0000)
#: float16 subnormal unit, 2**-24 (a float32 normal)
HALF_SUBNORMAL_UNIT = F32(2.0**-24)

#: bytes per cache line, the step of software prefetches
CACHE_LINE = 64
#: rows ahead that the matrix-vector kernels prefetch (docs/notes/KERNELS.md: row r+2)
PREFETCH_ROWS = 2

#: rows decoded per group by the small-batch kernels; 4 rows x 2048 float32 = 32 KiB
BATCH_ROWS = 4
#: tokens per register block of the small-batch product
BATCH_TOKENS = 4


@kernel(exact=True, inline=True)
def half_to_float(h):
    """float32 value of the float16 bit pattern ``h`` (uint32 holding 16 bits), exactly.

    Integer rebias for normals, ``m * 2**-24`` for subnormals (no float32 subnormal is ever an
    operand, so denormals-are-zero modes cannot change the result), the exponent field set to all
    ones for inf and NaN (payload kept). Same values as numpy's ``float16.astype(float32)``.
    """
    sign = U32((h & HALF_SIGN) << U32(16))
    exp = h & HALF_EXP_MASK
    mant = h & HALF_MANT_MASK
    if exp == HALF_EXP_MASK:
        return U32(sign | FLOAT_EXP_MASK | (mant << U32(13))).view(F32)
    if exp == 0:
        value = F32(mant) * HALF_SUBNORMAL_UNIT
        return U32(F32(value).view(U32) | sign).view(F32)
    return U32(sign | (((h & U32(0x7FFF)) << U32(13)) + HALF_REBIAS)).view(F32)


@kernel(exact=True, inline=True)
def f16_at(row, o):
    """The little-endian float16 at byte ``o`` of ``row`` (uint8), as float32 (exact)."""
    return half_to_float(U32(row[o]) | (U32(row[o + 1]) << U32(8)))


@kernel(exact=True, inline=True)
def e8m0_half(e):
    """``ggml_e8m0_to_fp32_half``: the e8m0 exponent byte ``e`` as float32 ``2**(e - 128)``.

    Bits ``0x00200000 << e`` for ``e < 2`` (float32 subnormals), else ``(e - 1) << 23``.
    """
    ee = U32(e)
    if ee < U32(2):
        return U32(U32(0x0020_0000) << ee).view(F32)
    return U32((ee - U32(1)) << U32(23)).view(F32)


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to load the cache line of ``arr[index]`` (1-D array) for reading.

    ``llvm.prefetch`` (read, high locality, data): a hint only, never a fault, on every target.
    """
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(index, types.Integer):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        byte_ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [byte_ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def address_pointer(typingctx, address):
    """The integer ``address`` (int64) as a ``void*``, for ``numba.carray`` over memory the caller
    keeps alive and whose size it has checked (slot memory of pinned experts)."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.voidptr(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def lshr(typingctx, value, amount):
    """``value >> amount`` in the width of ``value`` (an unsigned integer), ``0 <= amount < width``.

    numba types every shift of small unsigned integers as uint64; with a variable ``amount`` LLVM
    cannot prove the narrower shift equal and vectorises on 64-bit lanes (docs/notes/KERNELS.md, pitfall 1).
    """
    if not isinstance(value, types.Integer) or value.signed or not isinstance(amount, types.Integer):
        return None
    sig = value(value, amount)

    def codegen(context, builder, signature, args):
        width = signature.args[0].bitwidth
        count = args[1]
        if count.type.width > width:
            count = builder.trunc(count, ir.IntType(width))
        elif count.type.width < width:
            count = builder.zext(count, ir.IntType(width))
        return builder.lshr(args[0], count)

    return sig, codegen


@kernel(inline=True)
def prefetch_row(raw, r):
    """Prefetch every cache line of row ``r`` of the 2-D array ``raw`` (no-op past the end)."""
    if r < raw.shape[0]:
        row = raw[r].view(np.uint8)
        for o in range(0, row.size, CACHE_LINE):
            prefetch(row, o)


@kernel(inline=True)
def sub_sums(x, size, out):
    """``out[j] = sum(x[j * size : (j + 1) * size])`` for every ``j < out.size`` (float32)."""
    for j in range(out.size):
        s = F32(0.0)
        base = j * size
        for i in range(size):
            s += x[base + i]
        out[j] = s


@kernel(inline=True)
def block_product(buf, n_rows, xt, out, r0):
    """``out[t, r0 + i] = buf[i] . xt[t]`` for ``i < n_rows`` and every token ``t``.

    ``buf``: ``(BATCH_ROWS, cols)`` float32 decoded rows; ``xt``: ``(n, cols)`` float32;
    ``out``: ``(n, rows)`` float32. Register blocks of 4 rows x 4 tokens (16 accumulators: each
    loaded weight and ``x`` value is used four times), then single dot products for the edges.
    """
    n = xt.shape[0]
    cols = xt.shape[1]
    t_full = n - n % BATCH_TOKENS
    if n_rows == BATCH_ROWS:
        for t in range(0, t_full, BATCH_TOKENS):
            x0 = xt[t]
            x1 = xt[t + 1]
            x2 = xt[t + 2]
            x3 = xt[t + 3]
            w0 = buf[0]
            w1 = buf[1]
            w2 = buf[2]
            w3 = buf[3]
            a00 = a01 = a02 = a03 = F32(0.0)
            a10 = a11 = a12 = a13 = F32(0.0)
            a20 = a21 = a22 = a23 = F32(0.0)
            a30 = a31 = a32 = a33 = F32(0.0)
            for k in range(cols):
                v0 = x0[k]
                v1 = x1[k]
                v2 = x2[k]
                v3 = x3[k]
                a00 += w0[k] * v0
                a01 += w0[k] * v1
                a02 += w0[k] * v2
                a03 += w0[k] * v3
                a10 += w1[k] * v0
                a11 += w1[k] * v1
                a12 += w1[k] * v2
                a13 += w1[k] * v3
                a20 += w2[k] * v0
                a21 += w2[k] * v1
                a22 += w2[k] * v2
                a23 += w2[k] * v3
                a30 += w3[k] * v0
                a31 += w3[k] * v1
                a32 += w3[k] * v2
                a33 += w3[k] * v3
            out[t, r0] = a00
            out[t + 1, r0] = a01
            out[t + 2, r0] = a02
            out[t + 3, r0] = a03
            out[t, r0 + 1] = a10
            out[t + 1, r0 + 1] = a11
            out[t + 2, r0 + 1] = a12
            out[t + 3, r0 + 1] = a13
            out[t, r0 + 2] = a20
            out[t + 1, r0 + 2] = a21
            out[t + 2, r0 + 2] = a22
            out[t + 3, r0 + 2] = a23
            out[t, r0 + 3] = a30
            out[t + 1, r0 + 3] = a31
            out[t + 2, r0 + 3] = a32
            out[t + 3, r0 + 3] = a33
    else:
        t_full = 0
    for t in range(t_full, n):
        xr = xt[t]
        for i in range(n_rows):
            w = buf[i]
            s = F32(0.0)
            for k in range(cols):
                s += w[k] * xr[k]
            out[t, r0 + i] = s
