"""Dequantize ggml blocks to float32 (temporary: delegates to ``gguf.quants``; fast kernels land next)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

__all__ = ("dequantize",)


def dequantize(
    data: memoryview | np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """Dequantize raw ggml bytes to a float32 array of numpy ``shape``."""
    raw = np.frombuffer(data, dtype=np.uint8)
    return np.asarray(_gguf_dequantize(raw, ggml_type), dtype=np.float32).reshape(shape)
