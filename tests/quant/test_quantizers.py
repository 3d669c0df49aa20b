"""Our Q2_K / Q3_K / IQ4_XS quantizers (the miss tier's): within ggml's own error bounds, exact fp16
rounding, refusals, and llama.cpp's bytes for the same input where llama-cpp-python is installed."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aioexperts import ConfigError
from aioexperts._format.dequant import dequantize
from aioexperts._quant import TIER_TYPES, quantize, quantized_bytes
from aioexperts._quant.kernels import round_half

#: llama.cpp's tests/test-quantize-fns.cpp: MAX_QUANTIZATION_TOTAL_ERROR_2BITS / _3BITS / (generic)
GGML_TOTAL_ERROR = {T.Q2_K: 0.0075, T.Q3_K: 0.0040, T.IQ4_XS: 0.002}
#: relative L2 error on standard normal weights (768 x 2048 and smaller): measured 0.297 / 0.151 / 0.077
GAUSSIAN_REL_L2 = {T.Q2_K: 0.31, T.Q3_K: 0.16, T.IQ4_XS: 0.082}


def ggml_test_data(n: int, offset: float) -> np.ndarray:
    """test-quantize-fns.cpp's generate_data: ``0.1 + 2 cos(i + offset)`` in float32."""
    return (np.float32(0.1) + np.float32(2.0) * np.cos(np.arange(n, dtype=np.float32) + np.float32(offset))).astype(
        np.float32
    )


@pytest.mark.parametrize("qtype", list(GGML_TOTAL_ERROR), ids=lambda t: t.name)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_total_error_within_ggmls_own_bound(qtype: T, offset: float) -> None:
    n = 32 * 128  # test-quantize-fns' test_size
    x = ggml_test_data(n, offset)
    q = quantize(x, qtype)
    assert q.nbytes == quantized_bytes(qtype, n)
    y = dequantize(q, qtype, (n,))
    rmse = float(np.sqrt(np.sum((x.astype(np.float64) - y) ** 2)) / n)  # their array_rmse
    assert rmse < GGML_TOTAL_ERROR[qtype]


@pytest.mark.parametrize("qtype", list(GAUSSIAN_REL_L2), ids=lambda t: t.name)
def test_gaussian_rows_kept_and_error_bounded(qtype: T) -> None:
    x = np.random.default_rng(7).standard_normal((48, 512)).astype(np.float32) * np.float32(0.02)
    q = quantize(x, qtype)
    assert q.shape == (48, quantized_bytes(qtype, 512))
    y = dequantize(q.reshape(-1), qtype, x.shape)
    assert np.linalg.norm(x - y) / np.linalg.norm(x) < GAUSSIAN_REL_L2[qtype]
    for r in (0, 17, 47):  # a row alone gives the same bytes: blocks never straddle rows
        assert np.array_equal(quantize(x[r], qtype), q[r])


@pytest.mark.parametrize("qtype", list(TIER_TYPES.values()), ids=lambda t: t.name)
def test_zero_and_constant_blocks(qtype: T) -> None:
    x = np.zeros(512, dtype=np.float32)
    x[256:] = 0.5
    y = dequantize(quantize(x, qtype), qtype, x.shape)
    assert np.array_equal(y[:256], np.zeros(256, np.float32))
    assert np.abs(y[256:] - 0.5).max() < 0.05


def test_fp16_rounding_is_numpys_round_to_nearest_even() -> None:
    rng = np.random.default_rng(1)
    edge = np.array([0, 1e-8, 3e-8, 6.1e-5, 6.0e-5, 1.0005, 65504, 65519, 65520, 1e6, -2.5e-7], dtype=np.float32)
    vals = np.concatenate([edge, (rng.standard_normal(3000) * np.exp(rng.uniform(-20, 12, 3000))).astype(np.float32)])
    ours = np.array([round_half(v) for v in vals], dtype=np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(ours, vals.astype(np.float16).astype(np.float32))


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="multiple of 256"):
        quantize(np.zeros(100, np.float32), T.Q2_K)
    with pytest.raises(ConfigError, match="finite"):
        quantize(np.full(256, np.nan, np.float32), T.Q3_K)
    with pytest.raises(ConfigError, match="no quantizer"):
        quantize(np.zeros(256, np.float32), T.Q4_K)


def _ggml_library() -> ctypes.CDLL | None:
    """libggml of an installed llama-cpp-python (its own build), or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    for lib in sorted(Path(spec.origin).parent.rglob("libggml*.so*")):
        try:
            cdll = ctypes.CDLL(str(lib))
            cdll.ggml_quantize_chunk  # noqa: B018 - present in the library that has the quantizers
        except (OSError, AttributeError):
            continue
        return cdll
    return None


def _quantize_chunk() -> Callable[[T, np.ndarray], np.ndarray]:
    """``quantize(qtype, x)`` by llama.cpp's ``ggml_quantize_chunk`` (rows of ``x``); skips without it."""
    lib = _ggml_library()
    if lib is None:
        pytest.skip("llama-cpp-python (its libggml) is not installed: no baseline to compare bytes with")
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]

    def run(qtype: T, x: np.ndarray) -> np.ndarray:
        rows, cols = x.shape
        out = np.zeros((rows, quantized_bytes(qtype, cols)), dtype=np.uint8)
        fn(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        return out

    return run


@pytest.mark.parametrize("qtype", list(TIER_TYPES.values()), ids=lambda t: t.name)
def test_llama_cpps_bytes_for_the_same_input(qtype: T) -> None:
    lib = _quantize_chunk()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 2048)).astype(np.float32) * np.float32(0.03)
    x[3] = ggml_test_data(2048, 0.5)
    x[5, :256] = 0.0  # an all-zero block
    x[7] *= np.float32(1e4)
    theirs = lib(qtype, x)
    ours = quantize(x, qtype)
    # the same bytes (a ggml build that contracts multiply-adds into FMA could differ by a rounding)
    assert np.array_equal(ours, theirs), f"{int(np.sum(ours != theirs))} bytes differ"


def _edge_rows() -> np.ndarray:
    """Rows (of 2048) whose sub-blocks take each branch of the quantizers: constant (zero, negative,
    positive, -0.0), all of one sign, one value apart from zeros, wide dynamic range, few levels."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((8, 2048)) * np.float32(0.02)).astype(np.float32)
    x[0, :256] = 0.0
    x[0, 256:272] = -0.25
    x[0, 272:288] = 0.5
    x[0, 288:304] = -0.0
    x[0, 304:320] = 0.0
    x[0, 310] = 1e-3
    x[1] = np.abs(x[1])
    x[2] = -np.abs(x[2])
    x[3] = (rng.standard_normal(2048) * np.exp(rng.uniform(-30, 10, 2048))).astype(np.float32)
    x[4] = rng.integers(-3, 4, 2048).astype(np.float32) * np.float32(0.5)
    x[5] = rng.uniform(0, 1, 2048).astype(np.float32)
    x[6, ::2] = 0.0
    x[7] = np.repeat(rng.standard_normal(128).astype(np.float32), 16)  # every sub-block constant
    return x


@pytest.mark.parametrize("qtype", list(TIER_TYPES.values()), ids=lambda t: t.name)
def test_llama_cpps_bytes_on_edge_blocks(qtype: T) -> None:
    lib = _quantize_chunk()
    x = _edge_rows()
    theirs = lib(qtype, x)
    ours = quantize(x, qtype)
    bad = [r for r in range(x.shape[0]) if not np.array_equal(ours[r], theirs[r])]
    assert not bad, f"rows {bad} differ"
    part = quantize(x[:3, :768], qtype)  # 9 super-blocks: Q2_K's last pass of 4 has 1 (blocks never straddle)
    assert np.array_equal(part, theirs[:3, : part.shape[1]])
