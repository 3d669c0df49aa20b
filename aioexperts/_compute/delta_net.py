"""The gated delta net (linear attention with a recurrent state) as llama.cpp computes it for Qwen3.5.

Stateless maths of llama.cpp's src/models/qwen35moe.cpp ``build_layer_attn_linear``: the causal
depthwise convolution (ggml-cpu ops.cpp ``ggml_compute_forward_ssm_conv_f32``), the L2 norm of q and
k (models.h ``build_gdn_l2_norm``), the gates (``ggml_softplus``, ``ggml_sigmoid``) and the delta
rule (ops.cpp ``ggml_compute_forward_gated_delta_net_one_chunk``). The caller owns the per-sequence
state: the last ``d_conv - 1`` convolution inputs and one ``(head_v, head_k)`` matrix per value head;
the functions here update the arrays they are given in place. The delta rule runs as one compiled
loop (``kernels/delta_rule.py``) where the numba backend serves, else as numpy products over the heads.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from typing import Any

import numpy as np

from aioexperts._compute import fused

__all__ = ("causal_conv", "delta_rule", "l2_norm", "silu", "softplus", "warmup")

log = logging.getLogger("aioexperts")

_SOFTPLUS_LINEAR = np.float32(20.0)  # ggml op_softplus: x above 20 is returned as is


def silu(x: np.ndarray) -> np.ndarray:
    """``x / (1 + exp(-x))`` in float32 (``ggml_silu``): a new array of ``x``'s shape."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        out: np.ndarray = x / (np.float32(1.0) + np.exp(-x))
    return out.astype(np.float32, copy=False)


def softplus(x: np.ndarray) -> np.ndarray:
    """``x`` for ``x > 20``, else ``log(1 + exp(x))``, float32 (ggml-cpu unary-ops.cpp ``op_softplus``)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        soft = np.log(np.float32(1.0) + np.exp(np.minimum(x, _SOFTPLUS_LINEAR)))
    return np.where(x > _SOFTPLUS_LINEAR, x, soft).astype(np.float32, copy=False)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, as ``build_gdn_l2_norm`` builds it:
    ``ggml_rms_norm(x, eps / n)`` (mean of squares in double) scaled by ``1 / sqrt(n)``.

    Args:
        x: ``(..., n)`` float32.
        eps: the model's RMSNorm epsilon (``attention.layer_norm_rms_epsilon``).

    Returns:
        A new float32 array of ``x``'s shape.
    """
    n = x.shape[-1]
    mean = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    scale = (1.0 / np.sqrt(mean + eps / n)).astype(np.float32)
    out: np.ndarray = (x * scale) * np.float32(1.0 / math.sqrt(n))
    return out.astype(np.float32, copy=False)


def causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The causal depthwise convolution of ``n_tokens`` new rows after the rows kept in ``state``.

    ``out[t, c] = sum_j weight[c, j] * u[t + j, c]`` where ``u`` is ``state`` followed by ``x``
    (``ggml_ssm_conv`` on llama.cpp's ``build_conv_state`` input, summed in float32 in ``j`` order);
    ``state`` is then overwritten with the last ``d_conv - 1`` rows of ``u``.

    Args:
        x: ``(n_tokens, channels)`` float32, the new inputs (``attn_qkv x``).
        state: ``(d_conv - 1, channels)`` float32, the previous inputs (zeros for a new sequence);
            updated in place.
        weight: ``(channels, d_conv)`` float32 (``ssm_conv1d.weight``, numpy order).

    Returns:
        ``(n_tokens, channels)`` float32, before the SiLU.
    """
    n = x.shape[0]
    d_conv = weight.shape[1]
    u = np.concatenate([state, x.astype(np.float32, copy=False)])
    out = np.zeros(x.shape, dtype=np.float32)
    for j in range(d_conv):
        out += u[j : j + n] * weight[:, j]
    state[...] = u[n:]
    return out


class _Kernel:
    lock = threading.Lock()
    fn: Any = None
    failed = False


def _kernel() -> Any:
    """The compiled delta rule where the numba backend serves (None: the numpy loop serves)."""
    if _Kernel.failed or fused.backend().name != "numba":
        return None
    if _Kernel.fn is None:
        with _Kernel.lock:
            if _Kernel.fn is None and not _Kernel.failed:
                try:
                    fn = importlib.import_module(f"{__package__}.kernels.delta_rule").delta_rule_f32
                    fn(*_tiny_arguments())  # compiles (or loads from the kernel cache)
                    _Kernel.fn = fn
                except Exception as exc:  # a broken numba/llvmlite can raise anything
                    _Kernel.failed = True
                    log.warning(
                        "the gated delta rule runs in numpy: its kernel failed (%s: %s)", type(exc).__name__, exc
                    )
    return _Kernel.fn


def _tiny_arguments() -> tuple[Any, ...]:
    z3 = np.zeros((1, 1, 2), dtype=np.float32)
    z2 = np.zeros((1, 1), dtype=np.float32)
    return z3, z3, z3, z2, z2, np.zeros((1, 2, 2), dtype=np.float32), z3.copy(), np.float32(1.0)


def warmup() -> bool:
    """Compile (or load) the delta rule's kernel now; True when it serves (blocking: from a worker)."""
    return _kernel() is not None


def delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> np.ndarray:
    """The gated delta rule over ``n_tokens`` positions, every value head at once.

    Per value head ``h`` (using q/k head ``h % n_k_heads``, ggml's tiled broadcast) and token:
    ``S <- exp(g) S``; ``delta = beta (v - S^T k)``; ``S <- S + k delta^T``; ``o = S^T q / sqrt(head_v)``
    (ops.cpp ``ggml_compute_forward_gated_delta_net_one_chunk``, scalar gate). ``state[h]`` holds
    ``S^T`` as llama.cpp stores it (row ``j`` is column ``j`` of ``S``).

    Args:
        q, k: ``(n_tokens, n_k_heads, head_k)`` float32, L2-normalised.
        v: ``(n_tokens, n_v_heads, head_v)`` float32.
        g: ``(n_tokens, n_v_heads)`` float32 log-decay (``softplus(alpha + dt_bias) * ssm_a``, <= 0).
        beta: ``(n_tokens, n_v_heads)`` float32 write strength (``sigmoid(ssm_beta x)``).
        state: ``(n_v_heads, head_v, head_k)`` float32, C-contiguous, updated in place.

    Returns:
        ``(n_tokens, n_v_heads, head_v)`` float32, the output ``o`` of every head (before the gated norm).
    """
    n, n_v, head_v = v.shape
    decay = np.exp(g).astype(np.float32)
    scale = np.float32(1.0 / math.sqrt(head_v))
    out = np.empty((n, n_v, head_v), dtype=np.float32)
    compiled = _kernel()
    if compiled is not None:
        f32 = np.float32
        args = [np.ascontiguousarray(a, dtype=f32) for a in (q, k, v, decay, np.asarray(beta, dtype=f32))]
        compiled(*args, state, out, scale)
        return out
    n_k = q.shape[1]
    heads = np.arange(n_v) % n_k
    qh, kh = q[:, heads], k[:, heads]  # (n, n_v, head_k)
    for t in range(n):
        state *= decay[t][:, None, None]
        sk = np.matmul(state, kh[t][:, :, None])[:, :, 0]  # (n_v, head_v): S^T k
        delta = (v[t] - sk) * beta[t][:, None]
        state += delta[:, :, None] * kh[t][:, None, :]
        out[t] = np.matmul(state, qh[t][:, :, None])[:, :, 0] * scale
    return out
