"""Vector intrinsics: dot products of 16 or 32 packed codes, written as LLVM vector IR.

numba has no vector types, and LLVM's loop vectoriser handles the short fixed loops of ggml blocks
badly: it fully unrolls a 16- or 32-iteration loop and vectorises the block loop with gathers, or
it interleaves for a long trip count and runs a 16-iteration loop in its scalar remainder
(docs/notes/KERNELS.md, pitfalls 1 and 2). These intrinsics state the vector operations directly, so the
machine code no longer depends on those heuristics. They are portable LLVM IR (vector loads,
shifts, ``llvm.vector.reduce.*``); LLVM picks the instructions: on AVX-512 VNNI an unsigned-by-
signed byte product summed to int32 becomes ``vpdpbusd``. Two pieces depend on the target: the
16-entry table lookup of the codebook types (``pshufb`` on x86 with SSSE3, ``tbl`` on AArch64, a
per-lane extract elsewhere) and the float16 conversion (``fpext``, i.e. ``vcvtph2ps``, on x86 with
F16C and on AArch64; an integer rebias elsewhere, where ``fpext`` would need a runtime library
call). numba caches per CPU name and features, so the choice made at compile time always fits.

The codes of every ggml type here are built from one or two byte runs of the block::

    code[i] = ((a[i] >> a_shift) & a_mask) | (((b[i] >> b_shift) & b_mask) << b_pos)

``a`` holds the low bits (nibbles, 2-bit planes, bytes), ``b`` the high bits of Q3_K/Q5_K/Q6_K
(``b_mask = 0`` for the other types; LLVM then drops ``b``). Shifts and masks are uint8 values;
callers pass constants, which LLVM folds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8 = ir.IntType(8)
I32 = ir.IntType(32)
F32 = ir.FloatType()
#: fastmath flags of the float products and reductions (the reduction may be a tree)
FLOAT_FLAGS = ("reassoc", "contract", "nsz", "arcp")
#: codes per lookup of a codebook table (one 16-byte shuffle)
LUT_LANES = 16


def _element_pointer(context: Any, builder: ir.IRBuilder, aryty: Any, ary: Any, index: Any, element: ir.Type) -> Any:
    """Pointer to ``ary[index]`` (1-D array) cast to ``element*``."""
    array = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, array, [index])
    return builder.bitcast(ptr, element.as_pointer())


def _splat(builder: ir.IRBuilder, value: Any, lanes: int) -> Any:
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(
        one, ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    )


def _as_u8(builder: ir.IRBuilder, value: Any) -> Any:
    width = value.type.width
    if width > 8:
        return builder.trunc(value, I8)
    if width < 8:
        return builder.zext(value, I8)
    return value


def _load_bytes(context: Any, builder: ir.IRBuilder, aryty: Any, ary: Any, index: Any, lanes: int) -> Any:
    return builder.load(_element_pointer(context, builder, aryty, ary, index, ir.VectorType(I8, lanes)), align=1)


def _codes(context: Any, builder: ir.IRBuilder, sig: Any, args: Sequence[Any], lanes: int) -> Any:
    """``<lanes x i8>`` codes from ``row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos``."""
    row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos = args[:8]
    a = _load_bytes(context, builder, sig.args[0], row, a_off, lanes)
    a = builder.and_(
        builder.lshr(a, _splat(builder, _as_u8(builder, a_shift), lanes)),
        _splat(builder, _as_u8(builder, a_mask), lanes),
    )
    b = _load_bytes(context, builder, sig.args[0], row, b_off, lanes)
    b = builder.and_(
        builder.lshr(b, _splat(builder, _as_u8(builder, b_shift), lanes)),
        _splat(builder, _as_u8(builder, b_mask), lanes),
    )
    return builder.or_(a, builder.shl(b, _splat(builder, _as_u8(builder, b_pos), lanes)))


def _reduce_add_i32(builder: ir.IRBuilder, vector: Any, lanes: int) -> Any:
    fnty = ir.FunctionType(I32, [ir.VectorType(I32, lanes)])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.add.v{lanes}i32")
    return builder.call(fn, [vector])


def _reduce_fadd(builder: ir.IRBuilder, vector: Any, lanes: int) -> Any:
    # numba's fastmath pass adds the caller's flags (reassoc) to this call: a tree reduction
    fnty = ir.FunctionType(F32, [F32, ir.VectorType(F32, lanes)])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.fadd.v{lanes}f32")
    return builder.call(fn, [ir.Constant(F32, -0.0), vector])


def _is_int(t: Any) -> bool:
    return isinstance(t, types.Integer)


def _is_1d(t: Any, dtype: Any) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == dtype


def _code_args_ok(row: Any, offsets: Sequence[Any]) -> bool:
    return _is_1d(row, types.uint8) and all(_is_int(t) for t in offsets)


def _make_dot_q8(lanes: int) -> Any:
    @intrinsic
    def dot_q8(typingctx, row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q8, q_off):
        if not _code_args_ok(row, (a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q_off)):
            return None
        if not _is_1d(q8, types.int8):
            return None
        sig = types.int32(row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q8, q_off)

        def codegen(context, builder, signature, args):
            wide = ir.VectorType(I32, lanes)
            codes = builder.zext(_codes(context, builder, signature, args, lanes), wide)
            quants = builder.sext(_load_bytes(context, builder, signature.args[8], args[8], args[9], lanes), wide)
            return _reduce_add_i32(builder, builder.mul(codes, quants), lanes)

        return sig, codegen

    dot_q8.__doc__ = f"""``sum(code[i] * q8[q_off + i] for i < {lanes})`` as int32: unsigned codes times int8 ``x``."""
    return dot_q8


@intrinsic
def dot32_q8_scaled(
    typingctx, row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q8, q_off, scale_lo, scale_hi
):  # noqa: E501
    """``scale_lo * sum(code[i] * q8[q_off + i], i < 16) + scale_hi * sum(..., 16 <= i < 32)`` as int32.

    Two 16-value sub-blocks with their integer scales (Q2_K, Q3_K, Q6_K) in one reduction.
    """
    if not _code_args_ok(row, (a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q_off)):
        return None
    if not _is_1d(q8, types.int8) or not _is_int(scale_lo) or not _is_int(scale_hi):
        return None
    sig = types.int32(row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, q8, q_off, scale_lo, scale_hi)

    def codegen(context, builder, signature, args):
        wide = ir.VectorType(I32, 32)
        codes = builder.zext(_codes(context, builder, signature, args, 32), wide)
        quants = builder.sext(_load_bytes(context, builder, signature.args[8], args[8], args[9], 32), wide)
        lo, hi = (builder.trunc(v, I32) if v.type.width > 32 else builder.sext(v, I32) for v in args[10:12])
        scales = builder.shuffle_vector(
            _splat(builder, lo, 16), _splat(builder, hi, 16), ir.Constant(wide, list(range(32)))
        )
        return _reduce_add_i32(builder, builder.mul(builder.mul(codes, quants), scales), 32)

    return sig, codegen


@intrinsic
def dot32_f32_scaled(
    typingctx, row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, x, x_off, scale_lo, scale_hi
):  # noqa: E501
    """``scale_lo * sum(code[i] * x[x_off + i], i < 16) + scale_hi * sum(..., 16 <= i < 32)`` as float32.

    Two 16-value sub-blocks with their float scales (Q2_K, Q3_K, Q6_K) in one reduction.
    """
    if not _code_args_ok(row, (a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, x_off)):
        return None
    if not _is_1d(x, types.float32) or scale_lo != types.float32 or scale_hi != types.float32:
        return None
    sig = types.float32(row, a_off, a_shift, a_mask, b_off, b_shift, b_mask, b_pos, x, x_off, scale_lo, scale_hi)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(F32, 32)
        codes = builder.uitofp(_codes(context, builder, signature, args, 32), vector)
        xv = builder.load(_element_pointer(context, builder, signature.args[8], args[8], args[9], vector), align=4)
        scales = builder.shuffle_vector(
            _splat(builder, args[10], 16),
            _splat(builder, args[11], 16),
            ir.Constant(ir.VectorType(I32, 32), list(range(32))),
        )
        scaled = builder.fmul(codes, scales, flags=FLOAT_FLAGS)
        return _reduce_fadd(builder, builder.fmul(scaled, xv, flags=FLOAT_FLAGS), 32)

    return sig, codegen


def _half_to_float(builder: ir.IRBuilder, halves: Any, lanes: int) -> Any:
    """``<lanes x i16>`` float16 bit patterns to ``<lanes x float>``.

    ``fpext`` where the target converts in hardware (x86 F16C: ``vcvtph2ps``; AArch64), else the
    integer rebias of :func:`aioexperts._compute.kernels.floats.half_bits` on vectors.
    """
    vector = ir.VectorType(F32, lanes)
    triple, features = _target_features()
    if (triple.startswith(("x86_64", "i686", "i386")) and "+f16c" in features) or triple.startswith(
        ("aarch64", "arm64")
    ):
        return builder.fpext(builder.bitcast(halves, ir.VectorType(ir.HalfType(), lanes)), vector)
    wide = ir.VectorType(I32, lanes)

    def splat(value: int) -> Any:
        return ir.Constant(wide, [value] * lanes)

    h = builder.zext(halves, wide)
    sign = builder.shl(builder.and_(h, splat(0x8000)), splat(16))
    exp = builder.and_(h, splat(0x7C00))
    mant = builder.and_(h, splat(0x03FF))
    normal = builder.or_(sign, builder.add(builder.shl(builder.and_(h, splat(0x7FFF)), splat(13)), splat(112 << 23)))
    special = builder.or_(builder.or_(sign, splat(0x7F80_0000)), builder.shl(mant, splat(13)))
    sub_value = builder.fmul(builder.uitofp(mant, vector), ir.Constant(vector, [2.0**-24] * lanes))
    sub = builder.or_(builder.bitcast(sub_value, wide), sign)
    bits = builder.select(builder.icmp_unsigned("==", exp, splat(0)), sub, normal)
    bits = builder.select(builder.icmp_unsigned("==", exp, splat(0x7C00)), special, bits)
    return builder.bitcast(bits, vector)


@intrinsic
def dot32_f16(typingctx, w, off, x, x_off):
    """``sum(float(w[off + i]) * x[x_off + i] for i < 32)``: ``w`` holds float16 bit patterns (uint16)."""
    if not _is_1d(w, types.uint16) or not _is_int(off) or not _is_int(x_off) or not _is_1d(x, types.float32):
        return None
    sig = types.float32(w, off, x, x_off)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(F32, 32)
        halves = builder.load(
            _element_pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(ir.IntType(16), 32)),
            align=2,
        )
        xv = builder.load(_element_pointer(context, builder, signature.args[2], args[2], args[3], vector), align=4)
        return _reduce_fadd(builder, builder.fmul(_half_to_float(builder, halves, 32), xv, flags=FLOAT_FLAGS), 32)

    return sig, codegen


def _nibble_codes(context: Any, builder: ir.IRBuilder, sig: Any, args: Sequence[Any]) -> Any:
    """``<32 x i8>`` codes of a 32-value block: nibbles of ``row[off:off + 16]`` (low: values 0..15,
    high: 16..31), with bit ``i`` of the uint32 ``qh`` as bit 4 of value ``i`` (Q5; 0 for Q4)."""
    raw = _load_bytes(context, builder, sig.args[0], args[0], args[1], LUT_LANES)
    low = builder.and_(raw, _splat(builder, ir.Constant(I8, 0x0F), LUT_LANES))
    high = builder.lshr(raw, _splat(builder, ir.Constant(I8, 4), LUT_LANES))
    nibbles = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
    wide = ir.VectorType(I32, 32)
    qh = builder.zext(args[2], I32) if args[2].type.width < 32 else builder.trunc(args[2], I32)
    bits = builder.and_(
        builder.lshr(_splat(builder, qh, 32), ir.Constant(wide, list(range(32)))), ir.Constant(wide, [1] * 32)
    )
    fifth = builder.shl(builder.trunc(bits, ir.VectorType(I8, 32)), ir.Constant(ir.VectorType(I8, 32), [4] * 32))
    return builder.or_(nibbles, fifth)


@intrinsic
def nib32_dot_f32(typingctx, row, off, qh, x, x_off):
    """``sum(code[i] * x[x_off + i] for i < 32)`` for the codes of a Q4_0/Q4_1/Q5_0/Q5_1 block.

    ``qh``: uint32 fifth bits (Q5), or 0 (Q4: LLVM drops them).
    """
    if not _code_args_ok(row, (off, x_off)) or qh != types.uint32 or not _is_1d(x, types.float32):
        return None
    sig = types.float32(row, off, qh, x, x_off)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(F32, 32)
        codes = builder.uitofp(_nibble_codes(context, builder, signature, args), vector)
        xv = builder.load(_element_pointer(context, builder, signature.args[3], args[3], args[4], vector), align=4)
        return _reduce_fadd(builder, builder.fmul(codes, xv, flags=FLOAT_FLAGS), 32)

    return sig, codegen


@intrinsic
def nib32_dot_q8(typingctx, row, off, qh, q8, q_off):
    """``sum(code[i] * q8[q_off + i] for i < 32)`` as int32 for the codes of a Q4_0/Q4_1/Q5_0/Q5_1 block."""
    if not _code_args_ok(row, (off, q_off)) or qh != types.uint32 or not _is_1d(q8, types.int8):
        return None
    sig = types.int32(row, off, qh, q8, q_off)

    def codegen(context, builder, signature, args):
        wide = ir.VectorType(I32, 32)
        codes = builder.zext(_nibble_codes(context, builder, signature, args), wide)
        quants = builder.sext(_load_bytes(context, builder, signature.args[3], args[3], args[4], 32), wide)
        return _reduce_add_i32(builder, builder.mul(codes, quants), 32)

    return sig, codegen


@intrinsic
def f16_to_f32_32(typingctx, w, off, out, out_off):
    """``out[out_off + i] = float(w[off + i])`` for ``i < 32``: float16 bit patterns (uint16) to float32.

    Exact: every float16 is a float32; NaN stays NaN (a hardware conversion may set the quiet bit).
    """
    if not _is_1d(w, types.uint16) or not _is_int(off) or not _is_int(out_off) or not _is_1d(out, types.float32):
        return None
    sig = types.void(w, off, out, out_off)

    def codegen(context, builder, signature, args):
        halves = builder.load(
            _element_pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(ir.IntType(16), 32)),
            align=2,
        )
        target = _element_pointer(context, builder, signature.args[2], args[2], args[3], ir.VectorType(F32, 32))
        builder.store(_half_to_float(builder, halves, 32), target, align=4)
        return context.get_dummy_value()

    return sig, codegen


dot32_q8 = _make_dot_q8(32)
dot16_q8 = _make_dot_q8(16)


@intrinsic
def dot32_i8_f32(typingctx, row, off, x, x_off):
    """``sum(int8(row[off + i]) * x[x_off + i] for i < 32)`` as float32: signed weights (Q8_0)."""
    if not _code_args_ok(row, (off, x_off)) or not _is_1d(x, types.float32):
        return None
    sig = types.float32(row, off, x, x_off)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(F32, 32)
        weights = builder.sitofp(_load_bytes(context, builder, signature.args[0], args[0], args[1], 32), vector)
        xv = builder.load(_element_pointer(context, builder, signature.args[2], args[2], args[3], vector), align=4)
        return _reduce_fadd(builder, builder.fmul(weights, xv, flags=FLOAT_FLAGS), 32)

    return sig, codegen


@intrinsic
def dot32_i8_q8(typingctx, row, off, q8, q_off):
    """``sum(int8(row[off + i]) * q8[q_off + i] for i < 32)`` as int32: signed weights (Q8_0)."""
    if not _code_args_ok(row, (off, q_off)) or not _is_1d(q8, types.int8):
        return None
    sig = types.int32(row, off, q8, q_off)

    def codegen(context, builder, signature, args):
        wide = ir.VectorType(I32, 32)
        weights = builder.sext(_load_bytes(context, builder, signature.args[0], args[0], args[1], 32), wide)
        quants = builder.sext(_load_bytes(context, builder, signature.args[2], args[2], args[3], 32), wide)
        return _reduce_add_i32(builder, builder.mul(weights, quants), 32)

    return sig, codegen


# ----------------------------------------------------------------------------------------------
# 16-entry table lookups (codebook types)


def _target_features() -> tuple[str, str]:
    """``(triple, features)`` numba compiles for (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` honoured)."""
    from numba.core import config as numba_config

    config: Any = numba_config
    features = (
        config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm_binding.get_host_cpu_features().flatten()
    )
    if config.CPU_NAME == "generic" and config.CPU_FEATURES is None:
        features = ""
    return llvm_binding.get_process_triple(), features


def _lookup(builder: ir.IRBuilder, table: Sequence[int], codes: Any) -> Any:
    """``<16 x i8>`` of ``table[codes[i]]`` for codes 0..15 (table values as bytes)."""
    vector = ir.VectorType(I8, LUT_LANES)
    constant = ir.Constant(vector, [value & 0xFF for value in table])
    triple, features = _target_features()
    if triple.startswith(("x86_64", "i686", "i386")) and "+ssse3" in features:
        fnty = ir.FunctionType(vector, [vector, vector])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [constant, codes])
    if triple.startswith(("aarch64", "arm64")):
        fnty = ir.FunctionType(vector, [vector, vector])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.aarch64.neon.tbl1.v16i8")
        return builder.call(fn, [constant, codes])
    result = ir.Constant(vector, ir.Undefined)
    for lane in range(LUT_LANES):
        index = builder.extract_element(codes, ir.Constant(I32, lane))
        value = builder.extract_element(constant, builder.zext(index, I32))
        result = builder.insert_element(result, value, ir.Constant(I32, lane))
    return result


def make_lut_dots(table: Sequence[int]) -> tuple[Any, Any]:
    """Intrinsics ``(dot_f32, dot_q8)`` over the 32 codes of 16 bytes looked up in ``table``.

    The codes are ggml's 32-value layout: the low nibbles of ``row[off:off + 16]`` are values
    0..15, the high nibbles values 16..31.

    ``dot_f32(row, off, x, x_off)``: ``sum(table[code[i]] * x[x_off + i] for i < 32)`` as float32;
    ``dot_q8(row, off, q8, q_off)``: ``sum((table[code[i]] + 128) * q8[q_off + i])`` as int32, the
    unsigned-times-signed form ``vpdpbusd`` takes (``table`` must fit int8); the caller subtracts
    ``128 * sum(q8)`` (from the sums of ``x`` it keeps anyway).
    """
    if len(table) != LUT_LANES or not all(-128 <= v <= 127 for v in table):
        raise ValueError("a codebook table has 16 int8 values")
    biased = [v + 128 for v in table]
    lanes = 2 * LUT_LANES

    def lookup32(context: Any, builder: ir.IRBuilder, sig: Any, args: Sequence[Any], values: Sequence[int]) -> Any:
        raw = _load_bytes(context, builder, sig.args[0], args[0], args[1], LUT_LANES)
        nibble = _splat(builder, ir.Constant(I8, 0x0F), LUT_LANES)
        low = _lookup(builder, values, builder.and_(raw, nibble))
        high = _lookup(builder, values, builder.lshr(raw, _splat(builder, ir.Constant(I8, 4), LUT_LANES)))
        return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, lanes), list(range(lanes))))

    @intrinsic
    def dot_f32(typingctx, row, off, x, x_off):
        if not _code_args_ok(row, (off, x_off)) or not _is_1d(x, types.float32):
            return None
        sig = types.float32(row, off, x, x_off)

        def codegen(context, builder, signature, args):
            values = builder.sitofp(lookup32(context, builder, signature, args, table), ir.VectorType(F32, lanes))
            xv = builder.load(
                _element_pointer(context, builder, signature.args[2], args[2], args[3], ir.VectorType(F32, lanes)),
                align=4,
            )
            return _reduce_fadd(builder, builder.fmul(values, xv, flags=FLOAT_FLAGS), lanes)

        return sig, codegen

    @intrinsic
    def dot_q8(typingctx, row, off, q8, q_off):
        if not _code_args_ok(row, (off, q_off)) or not _is_1d(q8, types.int8):
            return None
        sig = types.int32(row, off, q8, q_off)

        def codegen(context, builder, signature, args):
            wide = ir.VectorType(I32, lanes)
            values = builder.zext(lookup32(context, builder, signature, args, biased), wide)
            quants = builder.sext(_load_bytes(context, builder, signature.args[2], args[2], args[3], lanes), wide)
            return _reduce_add_i32(builder, builder.mul(values, quants), lanes)

        return sig, codegen

    return dot_f32, dot_q8
