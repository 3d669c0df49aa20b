"""Whole-row integer dot products against quantized ``x``: llama.cpp's AVX2 loops as LLVM IR.

Each intrinsic here is one row of ``ggml_vec_dot_<type>_q8_<0|K>`` (``ggml-cpu/arch/x86/quants.c``,
the ``__AVX2__`` branch): the block loop is emitted as IR, its accumulators stay in vector registers
across blocks (one horizontal sum per row, not one per block), and the products are the pair-summing
integer multiplies ggml uses:

* ``pmaddubsw`` (unsigned codes times int8 ``x``, adjacent pairs summed to int16) and ``pmaddwd``
  (int16 pairs times int16 scales, summed to int32), called by name on x86 with AVX2; elsewhere the
  same sums in plain vector IR (sign/zero extensions, multiplies, even/odd shuffles), which give the
  same integers: no sum here reaches the int16 saturation of ``pmaddubsw`` (codes <= 63 or
  ``|w| <= 128``, ``|q8| <= 127``: at most ``2 * 128 * 127 = 32512``); where the CPU has
  AVX-512BW the Q4_K, Q5_K and Q6_K rows take two 32-value pieces per 512-bit instruction and add
  the two 8-lane halves at the end of the block (:func:`scaled_sums`): the same integer per lane,
  so the same bits (one Q6_K mat-vec 1.3x faster, Q4_K 1.1x on an Intel Xeon; the four-token
  :mod:`.rowdots` loops stay 256-bit, where 512-bit ran 8% slower);
* the float accumulation ``acc = fmuladd(d_w * d_x, float(sumi), acc)`` per block on 8 lanes, the
  row's sum by the fixed shuffle tree of ggml's ``hsum_float_8``: no reassociation flag anywhere
  (the kernels that call these are compiled ``exact``, so numba's fastmath adds none either), so a
  row's result depends only on that row and ``x`` (bit-equal however many rows or tokens a caller
  batches).

Arguments: ``row`` one weight row (uint8 bytes, 1-D), ``q`` the int8 quantized ``x``, ``d`` its
float32 scales (one per 32 values for Q8_0, per 256 for Q8_K), ``bsums`` (Q8_K) its int32 sums per
16 values, ``n_blocks`` the blocks of the row. Returns float32. No bounds checks: the callers size
every array from the row's column count.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .codebook import IQ4_XS_BYTES, KVALUES_IQ4, KVALUES_MXFP4, MXFP4_BYTES
from .simd import _lookup, _target_features

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
V32I8 = ir.VectorType(I8, 32)
V16I16 = ir.VectorType(I16, 16)
V32I16 = ir.VectorType(I16, 32)
V8I32 = ir.VectorType(I32, 8)
V16I32 = ir.VectorType(I32, 16)
V8F32 = ir.VectorType(F32, 8)

Q8_0_BYTES = 34
#: bytes ahead of the block being multiplied that a row loop prefetches: the weights stream from
#: memory once per product, and the hardware prefetcher of an x86 core stops at each 4 KiB page;
#: one page ahead, the one-token Q8_0 product from DRAM ran at 14.7 GB/s instead of 10.3 (AMD EPYC
#: Zen 2, one thread, 48 x 11 MB matrices; 8 and 16 KiB ahead within noise of 4)
PREFETCH_AHEAD = 4096
CACHE_LINE = 64
Q4_K_BYTES = 144
Q5_K_BYTES = 176
Q6_K_BYTES = 210


def _avx2() -> bool:
    triple, features = _target_features()
    return triple.startswith(("x86_64", "i686", "i386")) and "+avx2" in features


def _avx512bw() -> bool:
    """512-bit byte and word products (AVX-512BW): :func:`scaled_sums` takes two pieces per instruction."""
    return _avx2() and "+avx512bw" in _target_features()[1]


def _const(t: ir.Type, value: int) -> Any:
    return ir.Constant(t, value)


def _splat(builder: ir.IRBuilder, value: Any, lanes: int) -> Any:
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, _const(I32, 0))
    return builder.shuffle_vector(
        one, ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    )


def _vsplat(t: ir.VectorType, value: int) -> Any:
    return ir.Constant(t, [value] * t.count)


def _lanes(indices: list[int]) -> Any:
    return ir.Constant(ir.VectorType(I32, len(indices)), indices)


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[Any]) -> Any:
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _pair_sums(builder: ir.IRBuilder, wide: Any, lanes: int) -> Any:
    """``out[i] = wide[2 i] + wide[2 i + 1]`` (``lanes`` inputs)."""
    even = builder.shuffle_vector(wide, wide, _lanes(list(range(0, lanes, 2))))
    odd = builder.shuffle_vector(wide, wide, _lanes(list(range(1, lanes, 2))))
    return builder.add(even, odd)


def _maddubs(builder: ir.IRBuilder, codes: Any, quants: Any, avx2: bool) -> Any:
    """``<16 x i16>``: ``codes[2i] * quants[2i] + codes[2i+1] * quants[2i+1]`` (codes unsigned)."""
    if avx2:
        return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [codes, quants])
    products = builder.mul(builder.zext(codes, V32I16), builder.sext(quants, V32I16))
    return _pair_sums(builder, products, 32)


def _madd(builder: ir.IRBuilder, a: Any, b: Any, avx2: bool) -> Any:
    """``<8 x i32>``: ``a[2i] * b[2i] + a[2i+1] * b[2i+1]`` (int16 lanes)."""
    if avx2:
        return _call(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [a, b])
    products = builder.mul(builder.sext(a, V16I32), builder.sext(b, V16I32))
    return _pair_sums(builder, products, 16)


V64I8 = ir.VectorType(I8, 64)


def scaled_sums(builder: ir.IRBuilder, pieces: list[tuple[Any, Any, Any]], avx2: bool, wide: bool) -> Any:
    """ggml's ``sumi``: ``sum_k madd(maddubs(codes_k, quants_k), scale_k)`` as ``<8 x i32>``.

    ``pieces``: ``(codes <32 x i8>, quants <32 x i8>, scale <16 x i16>)`` per 32 values. With
    ``wide`` (AVX-512BW, an even number of pieces) two pieces go through one 512-bit ``pmaddubsw``
    and ``pmaddwd`` and the two 8-lane halves are added at the end: each lane is the same integer
    sum in another order, so the result is bit for bit the 256-bit loop's (and ggml's).
    """
    if wide and avx2 and len(pieces) % 2 == 0:
        total = ir.Constant(V16I32, [0] * 16)
        both = _lanes(list(range(64)))
        for (c0, q0, s0), (c1, q1, s1) in zip(pieces[0::2], pieces[1::2], strict=True):
            codes = builder.shuffle_vector(c0, c1, both)
            quants = builder.shuffle_vector(q0, q1, both)
            scales = builder.shuffle_vector(s0, s1, _lanes(list(range(32))))
            pairs = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", V32I16, [codes, quants])
            total = builder.add(total, _call(builder, "llvm.x86.avx512.pmaddw.d.512", V16I32, [pairs, scales]))
        low = builder.shuffle_vector(total, total, _lanes(list(range(8))))
        high = builder.shuffle_vector(total, total, _lanes(list(range(8, 16))))
        return builder.add(low, high)
    sumi = ir.Constant(V8I32, [0] * 8)
    for codes, quants, scale in pieces:
        sumi = builder.add(sumi, _madd(builder, _maddubs(builder, codes, quants, avx2), scale, avx2))
    return sumi


def _hsum8(builder: ir.IRBuilder, v: Any) -> Any:
    """ggml's ``hsum_float_8``: halves added, then the high pair, then the odd lane (fixed order)."""
    lo = builder.shuffle_vector(v, v, _lanes([0, 1, 2, 3]))
    hi = builder.shuffle_vector(v, v, _lanes([4, 5, 6, 7]))
    s4 = builder.fadd(lo, hi)
    s2 = builder.fadd(builder.shuffle_vector(s4, s4, _lanes([0, 1])), builder.shuffle_vector(s4, s4, _lanes([2, 3])))
    return builder.fadd(builder.extract_element(s2, _const(I32, 0)), builder.extract_element(s2, _const(I32, 1)))


class _Ptr:
    """Byte-offset loads from the data pointer of a 1-D array."""

    def __init__(self, context: Any, builder: ir.IRBuilder, aryty: Any, ary: Any) -> None:
        self.builder = builder
        data = context.make_array(aryty)(context, builder, ary).data
        self.elem = data.type.pointee
        self.data = data

    def load(self, index: Any, t: ir.Type, align: int = 1) -> Any:
        """Load a ``t`` at element ``index`` (an i64 count of the array's elements)."""
        ptr = self.builder.gep(self.data, [index])
        return self.builder.load(self.builder.bitcast(ptr, t.as_pointer()), align=align)


def _half(builder: ir.IRBuilder, bits: Any) -> Any:
    """float32 of a float16 bit pattern (i16): ``fpext`` (``vcvtph2ps`` with F16C)."""
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


def _i64(builder: ir.IRBuilder, value: Any) -> Any:
    width = value.type.width
    if width < 64:
        return builder.sext(value, I64)
    return value


def _offset(builder: ir.IRBuilder, base: Any, extra: int) -> Any:
    return builder.add(base, _const(I64, extra))


def _prefetch_ahead(builder: ir.IRBuilder, w: _Ptr, o: Any, block_bytes: int) -> None:
    """Hint the cache lines :data:`PREFETCH_AHEAD` bytes past the block at byte ``o`` of ``w``
    (``llvm.prefetch``: read, high locality; never faults, so past the end of the matrix too)."""
    i8p = I8.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    for line in range(0, block_bytes, CACHE_LINE):
        ptr = builder.bitcast(builder.gep(w.data, [_offset(builder, o, PREFETCH_AHEAD + line)]), i8p)
        builder.call(fn, [ptr, _const(I32, 0), _const(I32, 3), _const(I32, 1)])


def _row_loop(
    context: Any,
    builder: ir.IRBuilder,
    n_blocks: Any,
    body: Any,
    with_scalar: bool,
    prefetch: tuple[_Ptr, int] | None = None,
    mins: Any = None,
) -> Any:
    """Run ``body(b, acc, accs) -> (acc, accs)`` for every block, return ``hsum(acc) - accs``.

    ``prefetch`` ``(w, block_bytes)``: each block first hints the bytes :data:`PREFETCH_AHEAD`
    past it (:func:`_prefetch_ahead`). ``mins`` ``(accs_zero, finish)``: ``accs`` starts at
    ``accs_zero`` (any type) and the result is ``finish(hsum(acc), accs)`` instead.
    """
    acc_slot = cgutils.alloca_once_value(builder, ir.Constant(V8F32, [0.0] * 8))
    scalar_slot = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0) if mins is None else mins[0])
    with cgutils.for_range(builder, _i64(builder, n_blocks)) as loop:
        if prefetch is not None:
            w, block_bytes = prefetch
            _prefetch_ahead(builder, w, builder.mul(loop.index, _const(I64, block_bytes)), block_bytes)
        acc, accs = body(loop.index, builder.load(acc_slot), builder.load(scalar_slot))
        builder.store(acc, acc_slot)
        builder.store(accs, scalar_slot)
    total = _hsum8(builder, builder.load(acc_slot))
    if mins is not None:
        return mins[1](total, builder.load(scalar_slot))
    if with_scalar:
        total = builder.fsub(total, builder.load(scalar_slot))
    return total


def _fmuladd(builder: ir.IRBuilder, a: Any, b: Any, c: Any) -> Any:
    return _call(builder, "llvm.fmuladd.v8f32", V8F32, [a, b, c])


def _ok(row: Any, q: Any, d: Any, n_blocks: Any) -> bool:
    def one_d(t: Any, dtype: Any) -> bool:
        return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype

    return (
        one_d(row, types.uint8)
        and one_d(q, types.int8)
        and one_d(d, types.float32)
        and isinstance(n_blocks, types.Integer)
    )


@intrinsic
def rowdot_q8_0(typingctx, row, q, d, n_blocks):
    """``ggml_vec_dot_q8_0_q8_0`` of one Q8_0 row with Q8_0 ``x`` (``q``, ``d``): float32."""
    if not _ok(row, q, d, n_blocks):
        return None
    sig = types.float32(row, q, d, n_blocks)

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, Q8_0_BYTES))
            dw = _half(builder, w.load(o, I16))
            weights = w.load(_offset(builder, o, 2), V32I8)
            quants = qx.load(builder.mul(b, _const(I64, 32)), V32I8)
            # ggml's sign trick: |w| (unsigned) times q8 with the sign of w
            negative = builder.icmp_signed("<", weights, _vsplat(V32I8, 0))
            magnitude = builder.select(negative, builder.sub(_vsplat(V32I8, 0), weights), weights)
            signed = builder.select(negative, builder.sub(_vsplat(V32I8, 0), quants), quants)
            sums = _madd(builder, _maddubs(builder, magnitude, signed, avx2), _vsplat(V16I16, 1), avx2)
            scale = builder.fmul(dx.load(b, F32, align=4), dw)
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sums, V8F32), acc), accs

        return _row_loop(context, builder, args[3], body, with_scalar=False, prefetch=(w, Q8_0_BYTES))

    return sig, codegen


def _scales_mins_k4(builder: ir.IRBuilder, w: _Ptr, o: Any) -> tuple[Any, Any]:
    """The 8 scales and 8 mins (``<8 x i8>`` each, 6 bits) of the Q4_K block at byte ``o``.

    ``get_scale_min_k4`` for all eight at once, as ggml's AVX2 kernel unpacks them (``utmp``,
    ``kmask1..3``): three little-endian words of the 12 scale bytes rearranged so that bytes 0..7
    are the scales and bytes 8..15 the mins.
    """
    u0, u1, u2 = (w.load(_offset(builder, o, 4 + 4 * k), I32) for k in range(3))
    kmask1, kmask2, kmask3 = _const(I32, 0x3F3F3F3F), _const(I32, 0x0F0F0F0F), _const(I32, 0x03030303)

    def lshr(v: Any, n: int) -> Any:
        return builder.lshr(v, _const(I32, n))

    def shl(v: Any, n: int) -> Any:
        return builder.shl(v, _const(I32, n))

    t3 = builder.or_(builder.and_(lshr(u2, 4), kmask2), shl(builder.and_(lshr(u1, 6), kmask3), 4))
    t2 = builder.and_(u1, kmask1)
    t1 = builder.or_(builder.and_(u2, kmask2), shl(builder.and_(lshr(u0, 6), kmask3), 4))
    t0 = builder.and_(u0, kmask1)
    words = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for k, t in enumerate((t0, t1, t2, t3)):
        words = builder.insert_element(words, t, _const(I32, k))
    data = builder.bitcast(words, ir.VectorType(I8, 16))
    return (
        builder.shuffle_vector(data, data, _lanes(list(range(8)))),
        builder.shuffle_vector(data, data, _lanes(list(range(8, 16)))),
    )


def _ok_k(row: Any, q: Any, d: Any, bsums: Any, n_blocks: Any) -> bool:
    return (
        _ok(row, q, d, n_blocks) and isinstance(bsums, types.Array) and bsums.ndim == 1 and bsums.dtype == types.int32
    )


V8I16 = ir.VectorType(I16, 8)
V4I32 = ir.VectorType(I32, 4)
V4F32 = ir.VectorType(F32, 4)


def _madd4(builder: ir.IRBuilder, a: Any, b: Any, avx2: bool) -> Any:
    """``<4 x i32>``: ``a[2i] * b[2i] + a[2i+1] * b[2i+1]`` (``<8 x i16>`` each; ``pmaddwd`` xmm)."""
    if avx2:
        return _call(builder, "llvm.x86.sse2.pmadd.wd", V4I32, [a, b])
    return _pair_sums(builder, builder.mul(builder.sext(a, V8I32), builder.sext(b, V8I32)), 8)


def _mins_step(builder: ir.IRBuilder, x_scale: Any, dmin_w: Any, prod: Any, accs: Any, lanes: bool) -> Any:
    """One block's mins term in ggml's order, ``dmin = -d_x * dmin_w`` times ``prod`` (``<4 x i32>``):
    Q4_K (``lanes``) ``acc_m = fma(dmin, float(prod), acc_m)`` on 4 lanes; Q5_K
    ``summs += dmin * float(sum(prod))`` (one scalar fused multiply-add, as GCC contracts it)."""
    dmin = builder.fmul(builder.fneg(x_scale), dmin_w)
    if lanes:
        return _call(
            builder, "llvm.fmuladd.v4f32", V4F32, [_splat(builder, dmin, 4), builder.sitofp(prod, V4F32), accs]
        )
    summ = _call(builder, "llvm.vector.reduce.add.v4i32", I32, [prod])
    return _call(builder, "llvm.fmuladd.f32", F32, [dmin, builder.sitofp(summ, F32), accs])


def _mins_k(builder: ir.IRBuilder, lanes: bool) -> tuple[Any, Any]:
    """:func:`_row_loop`'s ``mins`` for :func:`_mins_step`: the row's ``hsum(acc) + acc_m`` (Q4_K: the
    4 lanes summed as ggml does, ``(m0 + m2) + (m1 + m3)``) or ``hsum(acc) + summs`` (Q5_K)."""
    if not lanes:
        return ir.Constant(F32, 0.0), builder.fadd

    def finish(total: Any, m: Any) -> Any:
        high = builder.fadd(m, builder.shuffle_vector(m, m, _lanes([2, 3, 2, 3])))  # movehl
        lane0 = builder.fadd(
            builder.extract_element(high, _const(I32, 0)), builder.extract_element(high, _const(I32, 1))
        )
        return builder.fadd(total, lane0)

    return ir.Constant(V4F32, [0.0] * 4), finish


def _k4_codegen(block_bytes: int, qs: int, qh: int | None) -> Any:
    """Code generator of one Q4_K row (``qh`` None) or Q5_K row (the fifth bits at byte ``qh``) with
    Q8_K ``x``: ggml's AVX2 loops of both types are the same but for the codes' fifth bit."""

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        wide = _avx512bw()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        bs = _Ptr(context, builder, signature.args[3], args[3])
        low_mask = _vsplat(V32I8, 15)
        four = _vsplat(V32I8, 4)

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, block_bytes))
            xo = builder.mul(b, _const(I64, 256))
            ko = builder.mul(b, _const(I64, 16))
            x_scale = dx.load(b, F32, align=4)
            d_w = _half(builder, w.load(o, I16))
            dmin_w = _half(builder, w.load(_offset(builder, o, 2), I16))
            scales, mins = _scales_mins_k4(builder, w, o)
            # ggml's prod: 4 lanes of m_j (bsum_2j + bsum_2j+1) pairs (pmaddwd of the int16 pair sums)
            pairs = _pair_sums(builder, _bsums16(builder, bs, ko), 16)
            prod = _madd4(builder, builder.zext(mins, V8I16), pairs, avx2)
            # the scales in both 128-bit halves: each broadcast below is one in-lane byte shuffle
            scales16 = builder.zext(builder.shuffle_vector(scales, scales, _lanes(list(range(8)) * 2)), V16I16)
            high = None if qh is None else w.load(_offset(builder, o, qh), V32I8)
            pieces = []
            for c in range(4):
                bits = w.load(_offset(builder, o, qs + 32 * c), V32I8)
                for half, codes in enumerate((builder.and_(bits, low_mask), builder.lshr(bits, four))):
                    if high is not None:  # bit 2c + half of qh[i]: bit 4 of the code
                        fifth = builder.and_(builder.lshr(high, _vsplat(V32I8, 2 * c + half)), _vsplat(V32I8, 1))
                        codes = builder.or_(codes, builder.shl(fifth, four))
                    quants = qx.load(_offset(builder, xo, 64 * c + 32 * half), V32I8)
                    scale = builder.shuffle_vector(
                        scales16, scales16, _lanes([2 * c + half] * 8 + [8 + 2 * c + half] * 8)
                    )
                    pieces.append((codes, quants, scale))
            sumi = scaled_sums(builder, pieces, avx2, wide)
            scale = builder.fmul(x_scale, d_w)
            acc = _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), acc)
            return acc, _mins_step(builder, x_scale, dmin_w, prod, accs, qh is None)

        return _row_loop(
            context,
            builder,
            args[4],
            body,
            with_scalar=True,
            prefetch=(w, block_bytes),
            mins=_mins_k(builder, qh is None),
        )

    return codegen


@intrinsic
def rowdot_q4_k(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_q4_K_q8_K`` of one Q4_K row with Q8_K ``x``: ``sum_b d_x (d_w sum_j sc_j dot_j
    - dmin_w sum_j m_j bsum_j)``, float32, in ggml's order (the mins' term in its own 4-lane
    accumulator ``acc_m``, added after the horizontal sum: :func:`_mins_step`)."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    return types.float32(row, q, d, bsums, n_blocks), _k4_codegen(Q4_K_BYTES, 16, None)


@intrinsic
def rowdot_q5_k(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_q5_K_q8_K`` of one Q5_K row with Q8_K ``x``: as :func:`rowdot_q4_k`, the codes'
    fifth bit from ``qh``; the mins' term is ggml's scalar ``summs`` (:func:`_mins_step`)."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    return types.float32(row, q, d, bsums, n_blocks), _k4_codegen(Q5_K_BYTES, 48, 16)


def _bsums16(builder: ir.IRBuilder, bs: _Ptr, ko: Any) -> Any:
    """The 16 int32 Q8_K block sums at element ``ko`` of ``bs`` as ``<16 x i16>``, ggml's
    ``int16_t bsums`` (``|bsum| <= 16 * 128``). Kept int32 in memory: truncating them here ran 5%
    faster than loading int16 sums (a Q6_K row loop spilled its accumulator with those)."""
    return builder.trunc(bs.load(ko, V16I32, 4), V16I16)


def q6_k_block(builder: ir.IRBuilder, w: _Ptr, o: Any) -> tuple[list[tuple[Any, Any]], Any, Any]:
    """The 256 codes of the Q6_K block at byte ``o`` as ggml's AVX2 loop unpacks them.

    Returns ``(parts, scales16, scale_w)``: eight ``(codes, scale)`` pairs (``<32 x i8>`` codes
    0..63 of values ``32 k .. 32 k + 31``; ``<16 x i16>`` their two sub-blocks' scales, 8 lanes
    each), the 16 signed scales as ``<16 x i16>``, and ``d_w`` (float32).
    """
    scales8 = w.load(_offset(builder, o, 192), ir.VectorType(I8, 16))
    scales16 = builder.sext(scales8, V16I16)
    m15 = _vsplat(V32I8, 15)
    parts = []
    for n in range(2):
        bits1 = w.load(_offset(builder, o, 64 * n), V32I8)
        bits2 = w.load(_offset(builder, o, 64 * n + 32), V32I8)
        high = w.load(_offset(builder, o, 128 + 32 * n), V32I8)
        # ggml's q4h_0..3: bits 2j, 2j+1 of qh moved to bits 4, 5 of the code
        tops = (
            builder.shl(builder.and_(high, _vsplat(V32I8, 3)), _vsplat(V32I8, 4)),
            builder.shl(builder.and_(high, _vsplat(V32I8, 12)), _vsplat(V32I8, 2)),
            builder.and_(high, _vsplat(V32I8, 48)),
            builder.lshr(builder.and_(high, _vsplat(V32I8, -64)), _vsplat(V32I8, 2)),
        )
        lows = (
            builder.and_(bits1, m15),
            builder.and_(bits2, m15),
            builder.lshr(bits1, _vsplat(V32I8, 4)),
            builder.lshr(bits2, _vsplat(V32I8, 4)),
        )
        for j in range(4):
            sb = 8 * n + 2 * j
            scale = builder.shuffle_vector(scales16, scales16, _lanes([sb] * 8 + [sb + 1] * 8))
            parts.append((builder.or_(lows[j], tops[j]), scale))
    return parts, scales16, _half(builder, w.load(_offset(builder, o, 208), I16))


def q6_k_sums(
    builder: ir.IRBuilder,
    parts: list[tuple[Any, Any]],
    scales16: Any,
    qx: _Ptr,
    xo: Any,
    sums16: Any,
    avx2: bool,
    wide: bool = False,
) -> Any:
    """ggml's ``sumi`` of one Q6_K block with one token's Q8_K block (quants at element ``xo`` of
    ``qx``, block sums ``sums16``): ``<8 x i32>`` of ``sum sc (code q8)`` minus, lane by lane,
    ``32 (bsum_2i sc_2i + bsum_2i+1 sc_2i+1)`` (``q8sclsub``: the codes' offset of 32); ``wide``:
    :func:`scaled_sums` in 512-bit pairs (the same integers)."""
    pieces = [(codes, qx.load(_offset(builder, xo, 32 * k), V32I8), scale) for k, (codes, scale) in enumerate(parts)]
    sumi = scaled_sums(builder, pieces, avx2, wide)
    offset = builder.shl(_madd(builder, sums16, scales16, avx2), _vsplat(V8I32, 5))
    return builder.sub(sumi, offset)


@intrinsic
def rowdot_q6_k(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_q6_K_q8_K`` of one Q6_K row with Q8_K ``x``: ``sum_b d_w d_x sum_j sc_j (dot_j -
    32 bsum_j)`` over 16-value sub-blocks, float32, in ggml's order: the ``- 32 bsum`` in integers,
    subtracted lane by lane as ggml's AVX2 loop does (so the result is ggml's bit for bit)."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    sig = types.float32(row, q, d, bsums, n_blocks)

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        wide = _avx512bw()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        bs = _Ptr(context, builder, signature.args[3], args[3])

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, Q6_K_BYTES))
            parts, scales16, d_w = q6_k_block(builder, w, o)
            sums16 = _bsums16(builder, bs, builder.mul(b, _const(I64, 16)))
            sumi = q6_k_sums(builder, parts, scales16, qx, builder.mul(b, _const(I64, 256)), sums16, avx2, wide)
            scale = builder.fmul(dx.load(b, F32, align=4), d_w)
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), acc), accs

        return _row_loop(context, builder, args[4], body, with_scalar=False, prefetch=(w, Q6_K_BYTES))

    return sig, codegen


# ----------------------------------------------------------------------------------------------
# codebook types: 16-entry tables of signed int8 values, ggml's sign trick as for Q8_0

MXFP4_TABLE = tuple(int(v) for v in KVALUES_MXFP4)
IQ4_TABLE = tuple(int(v) for v in KVALUES_IQ4)


def _table_codes(builder: ir.IRBuilder, w: _Ptr, off: Any, table: tuple[int, ...]) -> Any:
    """``<32 x i8>`` of ``table[nibble]`` for the 16 bytes at ``off``: low nibbles are values 0..15,
    high nibbles 16..31 (ggml's ``MM256_SET_M128I(lookup(high), lookup(low))``)."""
    v16i8 = ir.VectorType(I8, 16)
    raw = w.load(off, v16i8)
    low = _lookup(builder, table, builder.and_(raw, _vsplat(v16i8, 15)))
    high = _lookup(builder, table, builder.lshr(raw, _vsplat(v16i8, 4)))
    return builder.shuffle_vector(low, high, _lanes(list(range(32))))


def _signed_dot(builder: ir.IRBuilder, values: Any, quants: Any, avx2: bool) -> Any:
    """``<16 x i16>`` pair sums of ``values * quants`` (both int8) by ggml's ``mul_add_epi8``:
    ``|values|`` times ``quants`` with the sign of ``values``."""
    negative = builder.icmp_signed("<", values, _vsplat(V32I8, 0))
    magnitude = builder.select(negative, builder.sub(_vsplat(V32I8, 0), values), values)
    signed = builder.select(negative, builder.sub(_vsplat(V32I8, 0), quants), quants)
    return _maddubs(builder, magnitude, signed, avx2)


def _e8m0_half(builder: ir.IRBuilder, e: Any) -> Any:
    """``GGML_E8M0_TO_FP32_HALF(e)``: float32 bits ``0x00200000 << e`` for ``e < 2``, else ``(e - 1) << 23``."""
    wide = builder.zext(e, I32)
    small = builder.shl(_const(I32, 0x0020_0000), wide)
    large = builder.shl(builder.sub(wide, _const(I32, 1)), _const(I32, 23))
    bits = builder.select(builder.icmp_unsigned("<", wide, _const(I32, 2)), small, large)
    return builder.bitcast(bits, F32)


@intrinsic
def rowdot_mxfp4(typingctx, row, q, d, n_blocks):
    """``ggml_vec_dot_mxfp4_q8_0`` of one MXFP4 row with Q8_0 ``x``: float32.

    ggml's AVX2 loop: blocks in pairs, even blocks into one accumulator and odd into another,
    ``hsum(acc_even + acc_odd)``; an odd last block is added after (ggml's scalar tail).
    """
    if not _ok(row, q, d, n_blocks):
        return None
    sig = types.float32(row, q, d, n_blocks)
    table = MXFP4_TABLE

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        n = _i64(builder, args[3])

        def block(b: Any) -> tuple[Any, Any]:
            """``(scale, <8 x i32> sums)`` of block ``b``."""
            o = builder.mul(b, _const(I64, MXFP4_BYTES))
            values = _table_codes(builder, w, _offset(builder, o, 1), table)
            quants = qx.load(builder.mul(b, _const(I64, 32)), V32I8)
            sums = _madd(builder, _signed_dot(builder, values, quants, avx2), _vsplat(V16I16, 1), avx2)
            scale = builder.fmul(dx.load(b, F32, align=4), _e8m0_half(builder, w.load(o, I8)))
            return scale, sums

        zero = ir.Constant(V8F32, [0.0] * 8)
        even_slot = cgutils.alloca_once_value(builder, zero)
        odd_slot = cgutils.alloca_once_value(builder, zero)
        with cgutils.for_range(builder, builder.sdiv(n, _const(I64, 2))) as loop:
            b = builder.mul(loop.index, _const(I64, 2))
            _prefetch_ahead(builder, w, builder.mul(b, _const(I64, MXFP4_BYTES)), 2 * MXFP4_BYTES)
            for slot, blk in ((even_slot, b), (odd_slot, _offset(builder, b, 1))):
                scale, sums = block(blk)
                acc = _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sums, V8F32), builder.load(slot))
                builder.store(acc, slot)
        total_slot = cgutils.alloca_once_value(
            builder, _hsum8(builder, builder.fadd(builder.load(even_slot), builder.load(odd_slot)))
        )
        is_odd = builder.icmp_signed("!=", builder.srem(n, _const(I64, 2)), _const(I64, 0))
        with builder.if_then(is_odd):
            scale, sums = block(builder.sub(n, _const(I64, 1)))
            sumi = _call(builder, "llvm.vector.reduce.add.v8i32", I32, [sums])
            tail = builder.fmul(scale, builder.sitofp(sumi, F32))
            builder.store(builder.fadd(builder.load(total_slot), tail), total_slot)
        return builder.load(total_slot)

    return sig, codegen


@intrinsic
def rowdot_iq4_xs(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_iq4_xs_q8_K`` of one IQ4_XS row with Q8_K ``x``: ``sum_b d_w d_x sum_j (sc_j -
    32) dot_j`` (``bsums`` unused, taken for the common signature), float32."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    sig = types.float32(row, q, d, bsums, n_blocks)
    table = IQ4_TABLE

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, IQ4_XS_BYTES))
            xo = builder.mul(b, _const(I64, 256))
            high_bits = builder.zext(w.load(_offset(builder, o, 2), I16), I32)
            low_bits = w.load(_offset(builder, o, 4), I32)
            sumi = ir.Constant(V8I32, [0] * 8)
            for j in range(8):
                values = _table_codes(builder, w, _offset(builder, o, 8 + 16 * j), table)
                quants = qx.load(_offset(builder, xo, 32 * j), V32I8)
                low = builder.and_(builder.lshr(low_bits, _const(I32, 4 * j)), _const(I32, 15))
                high = builder.and_(builder.lshr(high_bits, _const(I32, 2 * j)), _const(I32, 3))
                scale = builder.sub(builder.or_(low, builder.shl(high, _const(I32, 4))), _const(I32, 32))
                scale16 = _splat(builder, builder.trunc(scale, I16), 16)
                sumi = builder.add(sumi, _madd(builder, _signed_dot(builder, values, quants, avx2), scale16, avx2))
            scale = builder.fmul(_half(builder, w.load(o, I16)), dx.load(b, F32, align=4))
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), acc), accs

        return _row_loop(context, builder, args[4], body, with_scalar=False, prefetch=(w, IQ4_XS_BYTES))

    return sig, codegen


Q2_K_BYTES = 84


def _zext_broadcast(builder: ir.IRBuilder, twice: Any, sb: int) -> Any:
    """``<32 x i8>`` holding the int16 lanes ``[scale sb] * 8 + [scale sb+1] * 8``, zero-extended,
    from ``twice``: the 16 unsigned byte scales in both 128-bit halves. Each byte comes from its own
    half or is zero (ggml's ``get_scale_shuffle_q3k``): one in-lane ``vpshufb``, where a zext then
    a shuffle of int16 lanes took two instructions."""
    zero = 32  # an index into the zero vector
    index = []
    for lane in range(16):
        half = 16 * (lane // 8)
        index += [half + sb + lane // 8, zero]
    return builder.shuffle_vector(twice, ir.Constant(V32I8, [0] * 32), _lanes(index))


@intrinsic
def rowdot_q2_k(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_q2_K_q8_K`` of one Q2_K row with Q8_K ``x``: per block, ggml's AVX2 order
    ``acc = fma(-d_x dmin_w, sum_j m_j bsum_j, acc)`` then ``acc = fma(d_x d_w, sum_j sc_j dot_j, acc)``
    on 8 lanes, float32."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    sig = types.float32(row, q, d, bsums, n_blocks)

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        bs = _Ptr(context, builder, signature.args[3], args[3])
        v16i8 = ir.VectorType(I8, 16)

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, Q2_K_BYTES))
            xo = builder.mul(b, _const(I64, 256))
            ko = builder.mul(b, _const(I64, 16))
            x_scale = dx.load(b, F32, align=4)
            packed = w.load(o, v16i8)
            scales8 = builder.and_(packed, _vsplat(v16i8, 15))
            twice = builder.shuffle_vector(scales8, scales8, _lanes(list(range(16)) * 2))
            # ggml's madd of the mins and the int16 block sums: one pmaddwd
            mins = builder.zext(builder.lshr(packed, _vsplat(v16i8, 4)), V16I16)
            prod = _madd(builder, mins, _bsums16(builder, bs, ko), avx2)
            dmin = builder.fmul(builder.fneg(x_scale), _half(builder, w.load(_offset(builder, o, 82), I16)))
            acc = _fmuladd(builder, _splat(builder, dmin, 8), builder.sitofp(prod, V8F32), acc)
            sumi = ir.Constant(V8I32, [0] * 8)
            for j in range(2):
                bits = w.load(_offset(builder, o, 16 + 32 * j), V32I8)
                for k in range(4):
                    codes = builder.and_(builder.lshr(bits, _vsplat(V32I8, 2 * k)), _vsplat(V32I8, 3))
                    quants = qx.load(_offset(builder, xo, 128 * j + 32 * k), V32I8)
                    sb = 8 * j + 2 * k
                    scale = builder.bitcast(_zext_broadcast(builder, twice, sb), V16I16)
                    sumi = builder.add(sumi, _madd(builder, _maddubs(builder, codes, quants, avx2), scale, avx2))
            scale = builder.fmul(x_scale, _half(builder, w.load(_offset(builder, o, 80), I16)))
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), acc), accs

        return _row_loop(context, builder, args[4], body, with_scalar=False, prefetch=(w, Q2_K_BYTES))

    return sig, codegen


Q3_K_BYTES = 110


def _scales_q3_k(builder: ir.IRBuilder, w: _Ptr, o: Any) -> Any:
    """The 16 scales of the Q3_K block at byte ``o`` minus 32, ``<16 x i16>``: ggml's AVX2 unpacking
    (``aux``, ``kmask1`` = 0x03030303, ``kmask2`` = 0x0F0F0F0F) of the 12 scale bytes at ``o + 96``."""
    u0, u1, u2 = (w.load(_offset(builder, o, 96 + 4 * k), I32) for k in range(3))
    kmask1, kmask2 = _const(I32, 0x03030303), _const(I32, 0x0F0F0F0F)

    def word(low: Any, low_shift: int, high_shift: int) -> Any:
        low_bits = builder.and_(builder.lshr(low, _const(I32, low_shift)), kmask2)
        high_bits = builder.and_(builder.lshr(u2, _const(I32, high_shift)), kmask1)
        return builder.or_(low_bits, builder.shl(high_bits, _const(I32, 4)))

    words = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for k, t in enumerate((word(u0, 0, 0), word(u1, 0, 2), word(u0, 4, 4), word(u1, 4, 6))):
        words = builder.insert_element(words, t, _const(I32, k))
    v16i8 = ir.VectorType(I8, 16)
    data = builder.sub(builder.bitcast(words, v16i8), _vsplat(v16i8, 32))
    return builder.sext(data, ir.VectorType(I16, 16))


@intrinsic
def rowdot_q3_k(typingctx, row, q, d, bsums, n_blocks):
    """``ggml_vec_dot_q3_K_q8_K`` of one Q3_K row with Q8_K ``x``: ``sum_b d_x d_w sum_j (sc_j - 32)
    dot(low_j - 4 (1 - hbit_j), q8_j)`` on 8 lanes in ggml's AVX2 order (``bsums`` unused, taken for
    the common signature), float32."""
    if not _ok_k(row, q, d, bsums, n_blocks):
        return None
    sig = types.float32(row, q, d, bsums, n_blocks)

    def codegen(context, builder, signature, args):
        avx2 = _avx2()
        w = _Ptr(context, builder, signature.args[0], args[0])
        qx = _Ptr(context, builder, signature.args[1], args[1])
        dx = _Ptr(context, builder, signature.args[2], args[2])
        three = _vsplat(V32I8, 3)

        def body(b, acc, accs):
            o = builder.mul(b, _const(I64, Q3_K_BYTES))
            xo = builder.mul(b, _const(I64, 256))
            scales16 = _scales_q3_k(builder, w, o)
            hbits = w.load(o, V32I8)
            missing = builder.xor(hbits, _vsplat(V32I8, -1))  # ggml's andnot: 4 where the high bit is clear
            sumi = ir.Constant(V8I32, [0] * 8)
            for j in range(2):
                bits = w.load(_offset(builder, o, 32 + 32 * j), V32I8)
                for k in range(4):
                    low = builder.and_(builder.lshr(bits, _vsplat(V32I8, 2 * k)), three)
                    high = builder.and_(builder.lshr(missing, _vsplat(V32I8, 4 * j + k)), _vsplat(V32I8, 1))
                    high = builder.shl(high, _vsplat(V32I8, 2))
                    quants = qx.load(_offset(builder, xo, 128 * j + 32 * k), V32I8)
                    p16 = builder.sub(_maddubs(builder, low, quants, avx2), _maddubs(builder, high, quants, avx2))
                    sb = 8 * j + 2 * k
                    scale = builder.shuffle_vector(scales16, scales16, _lanes([sb] * 8 + [sb + 1] * 8))
                    sumi = builder.add(sumi, _madd(builder, p16, scale, avx2))
            scale = builder.fmul(dx.load(b, F32, align=4), _half(builder, w.load(_offset(builder, o, 108), I16)))
            return _fmuladd(builder, _splat(builder, scale, 8), builder.sitofp(sumi, V8F32), acc), accs

        return _row_loop(context, builder, args[4], body, with_scalar=False, prefetch=(w, Q3_K_BYTES))

    return sig, codegen
