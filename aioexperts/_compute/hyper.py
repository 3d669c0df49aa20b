"""DeepSeek-V4's hyper-connections: ``n_hc`` residual streams mixed into and out of each block.

llama.cpp src/models/deepseek4.cpp ``build_hc_pre``, ``build_hc_sinkhorn``, ``build_hc_post`` and
``build_hc_head``. The residual of each token is ``X`` ``(n_hc, n_embd)``; before a block,
``m = fn @ rms(flatten(X))`` gives ``pre`` (sigmoid, plus eps), ``post`` (``2 sigmoid``) and the
``(src, dst)`` mixing matrix ``comb`` (softmax over ``dst`` made doubly stochastic by Sinkhorn
iterations); the block's input is ``sum_h pre[h] X[h]``, and after it
``X'[dst] = post[dst] * out + sum_src comb[src, dst] X[src]``. Everything is float32, summed in
llama.cpp's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aioexperts._compute.norms import rms_norm

__all__ = ("HyperMix", "hc_coefficients", "hc_head_weights", "hc_post", "hc_pre", "sinkhorn")

#: ``matmul(x)``: ``(n, n_hc * n_embd)`` float32 -> ``(n, rows)`` float32 (a dense matrix in its ggml type).
Matmul = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class HyperMix:
    """The coefficients of one hyper-connection, per token.

    Attributes:
        pre: ``(n, n_hc)`` float32, the weights that mix the streams into the block input.
        post: ``(n, n_hc)`` float32, how much of the block output each stream gets.
        comb: ``(n, n_hc, n_hc)`` float32, ``comb[t, src, dst]``.
    """

    pre: np.ndarray
    post: np.ndarray
    comb: np.ndarray


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out: np.ndarray = (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    return out


def sinkhorn(logits: np.ndarray, iterations: int, eps: float) -> np.ndarray:
    """``build_hc_sinkhorn``: softmax over ``dst``, ``+ eps``, one column (``src``) normalisation,
    then ``iterations - 1`` times rows (``dst``) then columns.

    Args:
        logits: ``(n, n_hc, n_hc)`` float32 indexed ``[t, src, dst]``.
        iterations: ``hyper_connection.sinkhorn_iterations`` (>= 1).
        eps: ``hyper_connection.epsilon``.

    Returns:
        A new ``(n, n_hc, n_hc)`` float32 array.
    """
    e = np.float32(eps)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z, dtype=np.float32)
    comb = (p / p.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32) + e
    comb = comb / (comb.sum(axis=1, keepdims=True) + e)  # columns: over src
    for _ in range(1, iterations):
        comb = comb / (comb.sum(axis=2, keepdims=True) + e)  # rows: over dst
        comb = comb / (comb.sum(axis=1, keepdims=True) + e)
    out: np.ndarray = comb.astype(np.float32, copy=False)
    return out


def _mixes(x: np.ndarray, fn: Matmul, norm_eps: float) -> np.ndarray:
    n = x.shape[0]
    flat = rms_norm(np.ascontiguousarray(x.reshape(n, -1)), None, norm_eps)
    return fn(flat)


def hc_coefficients(
    x: np.ndarray,
    fn: Matmul,
    scale: np.ndarray,
    base: np.ndarray,
    *,
    iterations: int,
    eps: float,
    norm_eps: float,
) -> HyperMix:
    """``build_hc_pre``'s coefficients of the streams ``x``.

    Args:
        x: ``(n, n_hc, n_embd)`` float32, the residual streams.
        fn: ``hc_*_fn`` (``((2 + n_hc) n_hc, n_hc n_embd)``) as a product.
        scale: ``hc_*_scale`` ``(3,)`` float32 (pre, post, comb).
        base: ``hc_*_base`` ``((2 + n_hc) n_hc,)`` float32.
        iterations, eps: the Sinkhorn iterations and ``hyper_connection.epsilon``.
        norm_eps: the RMSNorm epsilon of the flattened streams.
    """
    n, hc = x.shape[0], x.shape[1]
    m = _mixes(x, fn, norm_eps)
    pre = _sigmoid(m[:, :hc] * scale[0] + base[:hc]) + np.float32(eps)
    post = _sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc]) * np.float32(2.0)
    comb_logits = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(n, hc, hc)
    return HyperMix(pre, post, sinkhorn(comb_logits, iterations, eps))


def hc_head_weights(
    x: np.ndarray, fn: Matmul, scale: np.ndarray, base: np.ndarray, eps: float, norm_eps: float
) -> np.ndarray:
    """``build_hc_head``'s ``pre`` ``(n, n_hc)`` float32 (``output_hc_fn/scale/base``)."""
    m = _mixes(x, fn, norm_eps)
    return _sigmoid(m * scale[0] + base) + np.float32(eps)


def hc_pre(x: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """The block input ``sum_h pre[:, h] x[:, h]``: ``(n, n_embd)`` float32 (summed stream by stream)."""
    out = x[:, 0] * pre[:, 0:1]
    for h in range(1, x.shape[1]):
        out = out + x[:, h] * pre[:, h : h + 1]
    mixed: np.ndarray = out.astype(np.float32, copy=False)
    return mixed


def hc_post(out: np.ndarray, x: np.ndarray, mix: HyperMix) -> np.ndarray:
    """The streams after a block: ``X'[dst] = post[dst] out + sum_src comb[src, dst] X[src]``.

    Args:
        out: ``(n, n_embd)`` float32, the block's output.
        x: ``(n, n_hc, n_embd)`` float32, the streams before the block.
        mix: their :func:`hc_coefficients`.

    Returns:
        A new ``(n, n_hc, n_embd)`` float32 array.
    """
    hc = x.shape[1]
    res = np.empty_like(x)
    for dst in range(hc):
        cur = out * mix.post[:, dst : dst + 1]
        for src in range(hc):
            cur = cur + x[:, src] * mix.comb[:, src, dst : dst + 1]
        res[:, dst] = cur
    return res
