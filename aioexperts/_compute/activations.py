"""The rounding llama.cpp's CPU matrix products apply to float activations, as a float32 round trip.

Before ``ggml_mul_mat`` (and ``ggml_mul_mat_id``) multiplies by a matrix of ggml type ``T``,
ggml-cpu converts the float32 activations to ``type_traits_cpu[T].vec_dot_type``
(ggml/src/ggml-cpu/ggml-cpu.c ``ggml_compute_forward_mul_mat``): F16 for F16 weights, BF16 for BF16
weights (``GGML_FP32_TO_BF16`` rounds to nearest even), Q8_0 / Q8_1 / Q8_K for the quantized types
(:func:`vec_dot_type`), nothing for F32. :func:`round_activations` reproduces the two float
conversions; :func:`quantized_round_trip` the 8-bit ones (``quantize_row_q8_K_ref`` of
ggml-quants.c, and the AVX2 ``quantize_row_q8_0`` / ``quantize_row_q8_1`` of
ggml-cpu/arch/x86/quants.c), as the float32 values ``d * q`` the integer dot products stand for.
A product of those values with the exactly dequantized weights is llama.cpp's integer product to
float32 rounding, except for Q8_1's block sum ``s = fp16(d * sum(q))`` (:func:`q8_1_sum_error`).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ("q8_1_sum_error", "quantized_round_trip", "round_activations", "vec_dot_type")

T = GGMLQuantizationType
_F32 = np.float32
QK = 32
QK_K = 256
Q8_MAX = _F32(127.0)

_Q8_0_TYPES = frozenset({T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.MXFP4})
_Q8_1_TYPES = frozenset({T.Q4_1, T.Q5_1})
_Q8_K_TYPES = frozenset(
    {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S}
    | {T.IQ1_S, T.IQ1_M, T.IQ4_XS, T.TQ1_0, T.TQ2_0}
)


def vec_dot_type(weight_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type ggml-cpu converts activations to before a product with ``weight_type`` weights
    (ggml-cpu.c ``type_traits_cpu[weight_type].vec_dot_type``); F32 for types it does not list."""
    if weight_type in _Q8_K_TYPES:
        return T.Q8_K
    if weight_type in _Q8_0_TYPES:
        return T.Q8_0
    if weight_type in _Q8_1_TYPES:
        return T.Q8_1
    if weight_type in (T.F16, T.BF16):
        return weight_type
    return T.F32


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def round_activations(x: np.ndarray, weight_type: GGMLQuantizationType) -> np.ndarray:
    """``x`` (float32, any shape) as llama.cpp's product with F16 or BF16 ``weight_type`` sees it.

    Returns:
        ``x`` itself unless ``weight_type`` is F16 or BF16; then a new float32 array rounded to
        that type.
    """
    if weight_type == GGMLQuantizationType.BF16:
        return _bf16(x)
    if weight_type == GGMLQuantizationType.F16:
        return x.astype(np.float16).astype(np.float32)
    return x


def _q8_k(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` then ``d * q``: blocks ``(..., 256)`` float32."""
    index = np.argmax(np.abs(blocks), axis=-1)[..., None]
    vmax = np.take_along_axis(blocks, index, axis=-1)  # the value of largest magnitude, sign kept
    zero = vmax == 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = (-Q8_MAX / np.where(zero, _F32(1.0), vmax)).astype(_F32)
        q = np.minimum(np.rint(iscale * blocks), Q8_MAX)  # nearest_int: half to even
        d = (_F32(1.0) / iscale).astype(_F32)
        out = (np.where(zero, _F32(0.0), d) * np.where(zero, _F32(0.0), q)).astype(_F32)
    return out


def _q8_0_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AVX2 ``quantize_row_q8_0``: ``(q, d, d16)`` for blocks ``(..., 32)`` float32: ``d = amax /
    127``, ``q = round_half_even(x * (127 / amax))`` saturated to int8, ``d16`` = ``d`` rounded to F16."""
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = (amax / Q8_MAX).astype(_F32)
        inverse = np.where(amax != 0, Q8_MAX / np.where(amax != 0, amax, _F32(1.0)), _F32(0.0)).astype(_F32)
        q = np.clip(np.rint(blocks * inverse), _F32(-128.0), Q8_MAX)
    return q, d, d.astype(np.float16).astype(_F32)


def quantized_round_trip(x: np.ndarray, weight_type: GGMLQuantizationType) -> np.ndarray:
    """``x`` ``(n_tokens, cols)`` float32 as the values llama.cpp's product with ``weight_type``
    multiplies: converted to :func:`vec_dot_type` with ggml's rounding and back to float32.

    Q8_K: ``d * q`` per 256 values; Q8_0 / Q8_1: ``fp16(d) * q`` per 32; F16 / BF16: rounded to
    that type; F32: ``x`` itself. Non-finite values give non-finite results (no exception).

    Raises:
        ValueError: ``cols`` is not a multiple of the vec_dot_type's block (the weight type's block
            size is checked before this is called).
    """
    target = vec_dot_type(weight_type)
    if target in (T.F16, T.BF16):
        return round_activations(x, target)
    if target == T.F32:
        return x
    block = QK_K if target == T.Q8_K else QK
    n, cols = x.shape
    if cols % block:
        raise ValueError(f"{cols} columns are not a multiple of {block} ({target.name})")
    blocks = np.asarray(x, dtype=_F32).reshape(n, cols // block, block)
    if target == T.Q8_K:
        return _q8_k(blocks).reshape(n, cols)
    q, _, d16 = _q8_0_codes(blocks)
    with np.errstate(invalid="ignore", over="ignore"):
        out: np.ndarray = (d16 * q).astype(_F32).reshape(n, cols)
    return out


def q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """Per Q8_1 block of ``x`` ``(n_tokens, cols)``: ``s - fp16(d) * sum(q)``, ``(n_tokens, cols // 32)``
    float32, where ``s = fp16(d * sum(q))`` is what ``ggml_vec_dot_q4_1_q8_1`` / ``q5_1`` multiply the
    weight block's minimum by (the round trip of :func:`quantized_round_trip` carries ``fp16(d) * sum(q)``)."""
    n, cols = x.shape
    blocks = np.asarray(x, dtype=_F32).reshape(n, cols // QK, QK)
    q, d, d16 = _q8_0_codes(blocks)
    total = q.sum(axis=-1, dtype=np.float64).astype(_F32)  # exact: at most 32 * 128
    with np.errstate(invalid="ignore", over="ignore"):
        s = (d[..., 0] * total).astype(np.float16).astype(_F32)
        error: np.ndarray = (s - d16[..., 0] * total).astype(_F32)
    return error
