"""Oracle and block generators shared by the dequantization tests (``tests/format/test_dequant.py``)
and the kernel tests (``tests/compute/test_kernels.py``): gguf-py as reference, bit-exact comparison,
random blocks and the extreme scale bit patterns."""

from __future__ import annotations

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

#: byte offsets of the f16 scale fields (d, dmin, m) inside one block
F16_SCALES = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
EXTREME_F16 = (
    0x7C00,  # +inf
    0xFC00,  # -inf
    0x7E00,  # quiet NaN
    0xFD01,  # negative signalling NaN
    0x7BFF,  # max
    0xFBFF,  # -max
    0x0001,  # smallest subnormal
    0x83FF,  # largest negative subnormal
    0x0400,  # smallest normal
    0x8000,  # negative zero
    0x0000,  # zero
    0x3C00,  # 1.0
)
EXTREME_E8M0 = (0, 1, 2, 126, 127, 128, 200, 253, 254, 255)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py on the tensor's rows, the way GGUFReader hands them out."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block_size * type_size)
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


def assert_bit_exact(ours: np.ndarray, ref: np.ndarray) -> None:
    """Equal values and NaN positions (assert_array_equal), and equal bits wherever not NaN."""
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 256, n_blocks * type_size, dtype=np.uint8)
