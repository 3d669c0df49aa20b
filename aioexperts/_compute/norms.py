"""RMSNorm as ggml computes it (ggml/src/ggml-cpu/ops.cpp ``ggml_compute_forward_rms_norm_f32``)."""

from __future__ import annotations

import numpy as np

from . import fused as _fused

__all__ = ("add_rms_norm", "all_finite", "rms_norm")

#: elements from which the compiled kernel serves (below, numpy's few calls cost no more)
COMPILED_MIN = 64


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis.

    llama-graph.cpp ``build_norm(..., LLM_NORM_RMS)``: ``ggml_rms_norm`` (the mean of squares summed
    in double, as ggml's ``ggml_float``) then ``ggml_mul`` by the weight.

    Args:
        x: ``(..., n)`` float32.
        weight: ``(n,)`` float32 or None.
        eps: ``attention.layer_norm_rms_epsilon``.

    Returns:
        A new float32 array of ``x``'s shape.
    """
    # ggml: sum += (ggml_float)(x * x); const float mean = sum / n; scale = 1.0f / sqrtf(mean + eps)
    n = x.shape[-1]
    if x.size >= COMPILED_MIN and x.dtype == np.float32 and n and (weight is None or weight.shape == (n,)):
        kernel = _fused.compiled_kernel("norm", "rms_norm_rows")
        if kernel is not None:  # the same bits, one call (a decode step norms ~200 rows per token)
            rows = np.ascontiguousarray(x).reshape(-1, n)
            out = np.empty_like(rows)
            w = _NO_WEIGHT if weight is None else np.ascontiguousarray(weight, dtype=np.float32)
            kernel(rows, w, np.float32(eps), out)
            return out.reshape(x.shape)
    squares = np.square(x, dtype=np.float32).astype(np.float64)
    mean = (squares.sum(axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    y: np.ndarray = x * scale
    if weight is not None:
        y *= weight
    return y.astype(np.float32, copy=False)


_NO_WEIGHT = np.empty(0, dtype=np.float32)


def add_rms_norm(
    a: np.ndarray, b: np.ndarray, scale: float, weight: np.ndarray | None, eps: float
) -> tuple[np.ndarray, np.ndarray] | None:
    """``s = a + b * scale`` (``b`` unscaled when ``scale`` is 0: the residual scale's "none") and
    ``rms_norm(s, weight, eps)`` in one compiled call, the bits of numpy's ``a + b * scale`` and of
    :func:`rms_norm`: a residual add and the next norm of a decode step.

    Args:
        a, b: ``(rows, n)`` float32 C-contiguous (the residual stream and what is added to it).
        scale: ``residual_scale`` (granite), 0 for none.
        weight: ``(n,)`` float32 or None.
        eps: the norm's epsilon.

    Returns:
        ``(s, normed)``, new arrays, or None where no compiled kernel serves, the arrays are not so
        shaped, or ``s`` is not finite (the caller's numpy path then raises its own error).
    """
    if not (
        a.dtype == b.dtype == np.float32
        and a.ndim == 2
        and a.shape == b.shape
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and (weight is None or (weight.dtype == np.float32 and weight.shape == (a.shape[1],)))
    ):
        return None
    kernel = _fused.compiled_kernel("norm", "add_rms_norm_rows")
    if kernel is None:
        return None
    total = np.empty(a.shape, dtype=np.float32)  # not empty_like: a Python wrapper, 4 us with cold caches
    out = np.empty(a.shape, dtype=np.float32)
    w = _NO_WEIGHT if weight is None else np.ascontiguousarray(weight)
    if not kernel(a, b, np.float32(scale), w, np.float32(eps), total, out):
        return None
    return total, out


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of ``x`` is finite: one compiled call for a C-contiguous float32 array
    (a decode step checks a few hundred small ones per token), else numpy's."""
    if x.dtype == np.float32 and x.flags.c_contiguous:
        kernel = _fused.compiled_kernel("norm", "all_finite")
        if kernel is not None:
            return bool(kernel(x))
    return bool(np.isfinite(x).all())
