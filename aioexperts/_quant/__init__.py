"""Our own quantizers for the low-precision miss tier: float32 rows to Q2_K, Q3_K or IQ4_XS bytes.

They follow llama.cpp's reference quantizers without an importance matrix (``ggml-quants.c``:
``quantize_row_q2_K_ref``, ``quantize_row_q3_K_ref``, ``quantize_iq4_xs``), operation for operation
in float32 (:mod:`aioexperts._quant.kernels`, numba). The bytes are llama.cpp's for the same input
where its build does not contract multiply-adds into FMA (a compiler choice of ggml's build:
``tests/quant/test_quantizers.py`` compares them when llama-cpp-python is installed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._errors import ConfigError

__all__ = ("TIER_TYPES", "quantize", "quantized_bytes")

#: The ggml types the miss tier can hold, by name.
TIER_TYPES: dict[str, GGMLQuantizationType] = {
    "Q2_K": GGMLQuantizationType.Q2_K,
    "Q3_K": GGMLQuantizationType.Q3_K,
    "IQ4_XS": GGMLQuantizationType.IQ4_XS,
}

_QK_K = 256


def quantized_bytes(ggml_type: GGMLQuantizationType, n_values: int) -> int:
    """Bytes of ``n_values`` values (a multiple of 256) in ``ggml_type``."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_values // block * size


def quantize(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize float32 ``values`` to ``ggml_type`` (Q2_K, Q3_K or IQ4_XS), block by block.

    Args:
        values: float32 array of any shape whose last dimension (the ggml row) is a multiple of 256;
            finite (ggml's quantizers assume it).

    Returns:
        uint8 array of shape ``values.shape[:-1] + (row bytes,)``: the ggml blocks of each row.

    Raises:
        ConfigError: another type, a row that is not a multiple of 256, or non-finite values.
    """
    if ggml_type not in TIER_TYPES.values():
        raise ConfigError(f"no quantizer for {ggml_type!r}; the tier types are {', '.join(TIER_TYPES)}")
    x = np.ascontiguousarray(values, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % _QK_K:
        raise ConfigError(f"rows of {x.shape[-1] if x.ndim else 0} values: the K-quants need a multiple of {_QK_K}")
    if not np.isfinite(x).all():
        raise ConfigError("the values to quantize are not all finite")
    from . import kernels as compiled  # numba compiles on first use (cached on disk)

    kernels: Any = compiled  # untyped numba dispatchers
    flat = x.reshape(-1)
    nb = flat.size // _QK_K
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    out = np.zeros((nb, type_size), dtype=np.uint8)
    if ggml_type == GGMLQuantizationType.Q2_K:
        halves = np.zeros((nb, 2), dtype=np.float32)
        kernels.quantize_q2_k(flat, out, halves)
        out[:, 80:84] = halves.astype(np.float16).view(np.uint8).reshape(nb, 4)
    elif ggml_type == GGMLQuantizationType.Q3_K:
        halves = np.zeros((nb, 1), dtype=np.float32)
        kernels.quantize_q3_k(flat, out, halves)
        out[:, 108:110] = halves.astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:
        halves = np.zeros((nb, 1), dtype=np.float32)
        kernels.quantize_iq4_xs(flat, out, halves, kernels.KVALUES_IQ4NL)
        out[:, 0:2] = halves.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return out.reshape(*x.shape[:-1], -1)
