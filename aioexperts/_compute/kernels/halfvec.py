"""Float16 vector steps of ggml-cpu's F16 flash attention, as LLVM vector IR (x86 AVX2 semantics).

Five intrinsics, each exact operation by operation (``llvm.fma``: one rounding, as
``_mm256_fmadd_ps``; ``fptrunc``/``fpext``: float16 round half to even, as ``vcvtps2ph`` /
``vcvtph2ps``), so that LLVM's choice of vector width cannot change a bit:

* :func:`widen_f16` widens a row of float16 bit patterns (uint16) to float32 (``vcvtph2ps``),
  once for the query heads that share a key or value row;
* :func:`dot_f16_q` is ggml-cpu/vec.cpp ``ggml_vec_dot_f16`` of the AVX2 build: four 8-lane
  float32 FMA accumulators over steps of 32, reduced as ``GGML_F32x8_REDUCE``
  (``x0 += x2, x1 += x3; x0 += x1``; the two 128-bit halves added; two ``hadd``);
* :func:`mad_f16` is ``ggml_vec_mad_f16``: ``y = fp16(fma(x, v, y))`` per element;
* :func:`scale_f16` is ``ggml_vec_scale_f16``: ``y = fp16(y * v)``;
* :func:`narrow_f16` rounds a float32 row to float16 bit patterns (``vcvtps2ph``, round half to
  even: numpy's ``astype(float16)`` for every value but a signaling NaN, which arithmetic never
  makes), a key or value row written to the cache.

The float16 operands of the last three are float32 arrays holding float16 values (widened rows,
the rounded query; exact, so the same numbers as ggml's conversions in its loops); the running
value accumulator is float32 holding float16 values (each step rounds it back to float16).
Lengths are multiples of 32 (the callers run the rest in scalar code, as ggml does). They need
hardware float16 conversion (x86 F16C, AArch64): :func:`hardware_half` says whether the target
has it; without it the callers keep the scalar kernel.
"""

from __future__ import annotations

import functools
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _element_pointer, _target_features

I16 = ir.IntType(16)
I32 = ir.IntType(32)
F32 = ir.FloatType()
HALF = ir.HalfType()
LANES = 32
V32F = ir.VectorType(F32, LANES)
V32H = ir.VectorType(HALF, LANES)
V32I16 = ir.VectorType(I16, LANES)


@functools.cache
def hardware_half() -> bool:
    """Whether the compile target converts float16 in hardware (x86 F16C and FMA, AArch64); asked
    once per process."""
    triple, features = _target_features()
    if triple.startswith(("aarch64", "arm64")):
        return True
    return triple.startswith(("x86_64", "i686", "i386")) and "+f16c" in features and "+fma" in features


def _is_1d(t: Any, dtype: Any) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype


def _is_int(t: Any) -> bool:
    return isinstance(t, types.Integer)


def _load_halves(context: Any, builder: ir.IRBuilder, aryty: Any, ary: Any, index: Any) -> Any:
    bits = builder.load(_element_pointer(context, builder, aryty, ary, index, V32I16), align=2)
    return builder.fpext(builder.bitcast(bits, V32H), V32F)


def _fma(builder: ir.IRBuilder, a: Any, b: Any, c: Any) -> Any:
    fnty = ir.FunctionType(V32F, [V32F, V32F, V32F])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v32f32")
    return builder.call(fn, [a, b, c])


def _splat(builder: ir.IRBuilder, value: Any) -> Any:
    one = builder.insert_element(ir.Constant(V32F, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(
        one, ir.Constant(V32F, ir.Undefined), ir.Constant(ir.VectorType(I32, LANES), [0] * LANES)
    )


def _half_round(builder: ir.IRBuilder, value: Any) -> Any:
    return builder.fpext(builder.fptrunc(value, V32H), V32F)


def _lanes(builder: ir.IRBuilder, vector: Any, first: int, count: int) -> Any:
    return builder.shuffle_vector(
        vector,
        ir.Constant(vector.type, ir.Undefined),
        ir.Constant(ir.VectorType(I32, count), list(range(first, first + count))),
    )


def _steps(builder: ir.IRBuilder, n: Any) -> Any:
    """The number of 32-element steps in ``n`` (an int64 value)."""
    return builder.udiv(n, ir.Constant(n.type, LANES))


@intrinsic
def dot_f16_q(typingctx, q, k, n):
    """``ggml_vec_dot_f16(n, k, q)``: ``q`` and ``k`` float32 holding float16 values; ``n`` a
    multiple of 32. Returns float32."""
    if not _is_1d(q, types.float32) or not _is_1d(k, types.float32) or not _is_int(n):
        return None
    sig = types.float32(q, k, n)

    def codegen(context, builder, signature, args):
        qa, ka, count = args
        count = context.cast(builder, count, signature.args[2], types.intp)
        acc = cgutils.alloca_once_value(builder, ir.Constant(V32F, None))
        with cgutils.for_range(builder, _steps(builder, count)) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
            qv = builder.load(_element_pointer(context, builder, signature.args[0], qa, i, V32F), align=4)
            kv = builder.load(_element_pointer(context, builder, signature.args[1], ka, i, V32F), align=4)
            builder.store(_fma(builder, kv, qv, builder.load(acc)), acc)
        x = builder.load(acc)
        # GGML_F32x8_REDUCE: x0 += x2, x1 += x3 (16 lanes); x0 += x1 (8); halves; hadd; hadd
        x16 = builder.fadd(_lanes(builder, x, 0, 16), _lanes(builder, x, 16, 16))
        x8 = builder.fadd(_lanes(builder, x16, 0, 8), _lanes(builder, x16, 8, 8))
        x4 = builder.fadd(_lanes(builder, x8, 0, 4), _lanes(builder, x8, 4, 4))
        e = [builder.extract_element(x4, ir.Constant(I32, j)) for j in range(4)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    return sig, codegen


@intrinsic
def mad_f16(typingctx, y, x, v, n):
    """``ggml_vec_mad_f16``: ``y[i] = fp16(fma(x[i], v, y[i]))`` for ``i < n`` (a multiple of 32);
    ``y`` and ``x`` float32 holding float16 values, ``v`` float32."""
    if not _is_1d(y, types.float32) or not _is_1d(x, types.float32) or not _is_int(n):
        return None
    if v != types.float32:
        return None
    sig = types.void(y, x, v, n)

    def codegen(context, builder, signature, args):
        ya, xa, value, count = args
        count = context.cast(builder, count, signature.args[3], types.intp)
        vv = _splat(builder, value)
        with cgutils.for_range(builder, _steps(builder, count)) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
            ptr = _element_pointer(context, builder, signature.args[0], ya, i, V32F)
            xv = builder.load(_element_pointer(context, builder, signature.args[1], xa, i, V32F), align=4)
            builder.store(_half_round(builder, _fma(builder, xv, vv, builder.load(ptr, align=4))), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def scale_f16(typingctx, y, v, n):
    """``ggml_vec_scale_f16``: ``y[i] = fp16(y[i] * v)`` for ``i < n`` (a multiple of 32); ``y``
    float32 holding float16 values."""
    if not _is_1d(y, types.float32) or v != types.float32 or not _is_int(n):
        return None
    sig = types.void(y, v, n)

    def codegen(context, builder, signature, args):
        ya, value, count = args
        count = context.cast(builder, count, signature.args[2], types.intp)
        vv = _splat(builder, value)
        with cgutils.for_range(builder, _steps(builder, count)) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
            ptr = _element_pointer(context, builder, signature.args[0], ya, i, V32F)
            builder.store(_half_round(builder, builder.fmul(builder.load(ptr, align=4), vv)), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen_f16(typingctx, y, x, x_off, n):
    """``y[i] = float32(x[x_off + i])`` for ``i < n`` (a multiple of 32): float16 bit patterns
    (uint16) widened, exactly (``vcvtph2ps``); for a row that several heads read."""
    if not _is_1d(y, types.float32) or not _is_1d(x, types.uint16) or not _is_int(x_off) or not _is_int(n):
        return None
    sig = types.void(y, x, x_off, n)

    def codegen(context, builder, signature, args):
        ya, xa, off, count = args
        off = context.cast(builder, off, signature.args[2], types.intp)
        count = context.cast(builder, count, signature.args[3], types.intp)
        with cgutils.for_range(builder, _steps(builder, count)) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
            ptr = _element_pointer(context, builder, signature.args[0], ya, i, V32F)
            builder.store(_load_halves(context, builder, signature.args[1], xa, builder.add(off, i)), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def narrow_f16(typingctx, y, x, n):
    """``y[i] = bits(float16(x[i]))`` for ``i < n`` (a multiple of 32): ``x`` float32 rounded half
    to even (``vcvtps2ph``), ``y`` uint16."""
    if not _is_1d(y, types.uint16) or not _is_1d(x, types.float32) or not _is_int(n):
        return None
    sig = types.void(y, x, n)

    def codegen(context, builder, signature, args):
        ya, xa, count = args
        count = context.cast(builder, count, signature.args[2], types.intp)
        with cgutils.for_range(builder, _steps(builder, count)) as loop:
            i = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
            xv = builder.load(_element_pointer(context, builder, signature.args[1], xa, i, V32F), align=4)
            bits = builder.bitcast(builder.fptrunc(xv, V32H), V32I16)
            builder.store(bits, _element_pointer(context, builder, signature.args[0], ya, i, V32I16), align=2)
        return context.get_dummy_value()

    return sig, codegen
