"""Float kernels: F16 and BF16 (``raw`` as uint16 bit patterns, ``(rows, cols)``); F32 goes to BLAS,
except the one-token F32 product a fan-out runs (:func:`matvec_f32_row`: the decode row's router).

F16 values are converted with integer operations (:func:`half_bits`), exactly as numpy's
``float16.astype(float32)``; BF16 (gguf-py ``BF16``) puts its 16 bits in the high half of a float32.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .common import (
    BATCH_ROWS,
    FLOAT_EXP_MASK,
    HALF_EXP_MASK,
    HALF_MANT_MASK,
    HALF_REBIAS,
    HALF_SIGN,
    HALF_SUBNORMAL_UNIT,
    PREFETCH_ROWS,
    block_product,
    prefetch_row,
)
from .halfvec import dot_f16_q
from .simd import dot32_f16, f16_to_f32_32

# ruff: noqa: N803, N806

F32 = np.float32
U32 = np.uint32

#: bits of a float16 without its sign
HALF_MAGNITUDE = U32(0x7FFF)
#: left shift from float16 to float32 mantissa position
HALF_TO_FLOAT_SHIFT = U32(13)
BF16_SHIFT = U32(16)


@kernel(exact=True, inline=True)
def half_bits(h16):
    """float32 of a float16 bit pattern (uint16), branch-free so that loops over it vectorise.

    The three cases of :func:`aioexperts._compute.kernels.common.half_to_float` (normal,
    subnormal, inf/NaN) are all computed and one is selected.
    """
    h = U32(h16)
    sign = U32((h & HALF_SIGN) << BF16_SHIFT)
    exp = h & HALF_EXP_MASK
    mant = h & HALF_MANT_MASK
    normal = U32(sign | (((h & HALF_MAGNITUDE) << HALF_TO_FLOAT_SHIFT) + HALF_REBIAS))
    special = U32(sign | FLOAT_EXP_MASK | (mant << HALF_TO_FLOAT_SHIFT))
    sub = U32(F32(F32(mant) * HALF_SUBNORMAL_UNIT).view(U32) | sign)
    bits = special if exp == HALF_EXP_MASK else (sub if exp == 0 else normal)
    return U32(bits).view(F32)


@kernel(exact=True, inline=True)
def bf16_bits(h16):
    """float32 of a bfloat16 bit pattern (uint16): the high half of the float32."""
    return U32(U32(h16) << BF16_SHIFT).view(F32)


# ----------------------------------------------------------------------------------------------
# F16


#: values per vector dot of the F16 kernel
F16_LANES = 32


@kernel()
def matvec_f16(raw, x, out):
    """``out = W @ x``: ``raw`` ``(rows, cols)`` uint16 float16 bit patterns."""
    cols = x.size
    vector_cols = cols - cols % F16_LANES
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        w = raw[r]
        s = F32(0.0)
        for k in range(0, vector_cols, F16_LANES):
            s += dot32_f16(w, k, x, k)
        for k in range(vector_cols, cols):
            s += half_bits(w[k]) * x[k]
        out[r] = s


@kernel(exact=True, inline=True)
def decode_f16(w, out):
    """One F16 row to float32, exactly (32 values per vector conversion, then the tail)."""
    cols = out.size
    vector_cols = cols - cols % F16_LANES
    for k in range(0, vector_cols, F16_LANES):
        f16_to_f32_32(w, k, out, k)
    for k in range(vector_cols, cols):
        out[k] = half_bits(w[k])


@kernel()
def matmat_f16(raw, xt, out):
    """``out = xt @ W.T``; each F16 row converted once per call."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_f16(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_f16(raw, out):
    """Exact F16 to float32 (numpy's ``astype``), NaN payloads kept."""
    for r in range(raw.shape[0]):
        decode_f16(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# BF16


@kernel()
def matvec_bf16(raw, x, out):
    """``out = W @ x``: ``raw`` ``(rows, cols)`` uint16 bfloat16 bit patterns."""
    cols = x.size
    for r in range(raw.shape[0]):
        prefetch_row(raw, r + PREFETCH_ROWS)
        w = raw[r]
        s = F32(0.0)
        for k in range(cols):
            s += bf16_bits(w[k]) * x[k]
        out[r] = s


@kernel(exact=True, inline=True)
def decode_bf16(w, out):
    """One BF16 row to float32 (gguf-py ``BF16``)."""
    for k in range(out.size):
        out[k] = bf16_bits(w[k])


@kernel()
def matmat_bf16(raw, xt, out):
    """``out = xt @ W.T``; each BF16 row converted once per call."""
    rows = raw.shape[0]
    buf = np.empty((BATCH_ROWS, xt.shape[1]), dtype=F32)
    for r0 in range(0, rows, BATCH_ROWS):
        g = min(BATCH_ROWS, rows - r0)
        for i in range(g):
            decode_bf16(raw[r0 + i], buf[i])
        block_product(buf, g, xt, out, r0)


@kernel(exact=True)
def dequant_bf16(raw, out):
    """Exact BF16 to float32."""
    for r in range(raw.shape[0]):
        decode_bf16(raw[r], out[r])


# ----------------------------------------------------------------------------------------------
# F32

#: values per vector step of :func:`matvec_f32_row` (``GGML_F32_STEP`` of the AVX2 build)
F32_STEP = 32


@kernel(exact=True)
def matvec_f32_row(raw, x, out):
    """``out = W @ x`` for F32 weights, each row summed as ggml-cpu/vec.cpp ``ggml_vec_dot_f32`` of
    the AVX2 build (four 8-lane FMA accumulators over steps of 32, ``GGML_F32_VEC_REDUCE``, then the
    tail in order, a product then an add as the C source writes it; a compiler may contract or
    vectorise ggml's tail, so widths that are not a multiple of 32 can differ from a given build in
    the last bits): the same bits on every x86 CPU, whatever LLVM's vector width.

    ``raw`` ``(rows, 4 * cols)`` uint8 (the float32 rows' bytes, C-contiguous), ``x`` ``(cols,)`` and
    ``out`` ``(rows,)`` float32. Returns False (nothing written) when ``x`` is not finite, the
    contract of a fan-out product (:func:`aioexperts._compute.kernels.group.make_group_task`).
    """
    cols = x.size
    for k in range(cols):
        if not np.isfinite(x[k]):
            return False
    w = raw.view(F32)
    vector_cols = cols - cols % F32_STEP
    for r in range(raw.shape[0]):
        row = w[r]
        s = dot_f16_q(x, row, vector_cols)
        for k in range(vector_cols, cols):
            s += row[k] * x[k]
        out[r] = s
    return True


@kernel(exact=True)
def matmat_f32_rows(raw, xs, out):
    """``out = xs @ W.T`` for F32 weights, each ``out[i, r]`` the bits :func:`matvec_f32_row` gives
    for ``xs[i]`` alone (a weight row is read once for every row of ``xs``, from L1).

    ``raw`` ``(rows, 4 * cols)`` uint8, ``xs`` ``(n, cols)`` and ``out`` ``(n, rows)`` float32,
    C-contiguous. Returns False (nothing meaningful written) when ``xs`` is not finite.
    """
    n, cols = xs.shape
    for i in range(n):
        for k in range(cols):
            if not np.isfinite(xs[i, k]):
                return False
    w = raw.view(F32)
    vector_cols = cols - cols % F32_STEP
    for r in range(raw.shape[0]):
        row = w[r]
        for i in range(n):
            x = xs[i]
            s = dot_f16_q(x, row, vector_cols)
            for k in range(vector_cols, cols):
                s += row[k] * x[k]
            out[i, r] = s
    return True
