"""The rounding llama.cpp's CPU matrix products apply to float activations, as a float32 round trip.

Before ``ggml_mul_mat`` multiplies by a matrix of ggml type ``T``, ggml-cpu converts the float32
activations to ``type_traits_cpu[T].vec_dot_type`` (ggml/src/ggml-cpu/ggml-cpu.c
``ggml_compute_forward_mul_mat``): F16 for F16 weights, BF16 for BF16 weights (``GGML_FP32_TO_BF16``
rounds to nearest even). :func:`round_activations` reproduces those two. The 8-bit conversions of
the quantized types (Q8_0, Q8_K) are not reproduced: a value within float32 rounding of a rounding
boundary would flip a whole quantization step, so prefill and decode would no longer agree.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ("round_activations",)


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def round_activations(x: np.ndarray, weight_type: GGMLQuantizationType) -> np.ndarray:
    """``x`` (float32, any shape) as llama.cpp's product with ``weight_type`` sees it.

    Returns:
        ``x`` itself unless ``weight_type`` is F16 or BF16; then a new float32 array rounded to
        that type.
    """
    if weight_type == GGMLQuantizationType.BF16:
        return _bf16(x)
    if weight_type == GGMLQuantizationType.F16:
        return x.astype(np.float16).astype(np.float32)
    return x
