"""Causal scaled dot-product attention over a KV cache, with grouped KV heads, sinks and a sliding window.

The reference is llama-graph.cpp ``llm_graph_context::build_attn_mha`` (the non-flash path):
``kq = k . q``, ``ggml_soft_max_ext(kq, mask, kq_scale)`` with the sinks of
``ggml_soft_max_add_sinks`` (ops.cpp ``ggml_compute_forward_soft_max_f32``: the sink joins the row
maximum and adds ``exp(sink - max)`` to the denominator), then ``v . softmax``. The causal mask and
the standard sliding window follow llama-hparams.h ``is_masked_swa``: key position ``p0`` is hidden
from query position ``p1`` when ``p0 > p1`` or, with a window ``n_swa``, when ``p1 - p0 >= n_swa``.
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute import fused
from aioexperts._errors import ConfigError

__all__ = ("FLASH_TILE_QUERIES", "SCORE_BYTES", "SPLIT_MIN", "attend")

SCORE_BYTES = 64 << 20
"""A long prefill runs its queries in chunks whose score matrix stays within this many bytes."""
FLASH_TILE_QUERIES = 64
"""ggml-cpu's ``GGML_FA_TILE_Q``: batches of at least this many queries take its tiled flash
attention (float32 queries and accumulators), smaller ones the one-chunk kernel (float16 queries
and value accumulator)."""


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    *,
    sinks: np.ndarray | None = None,
    window: int = 0,
) -> np.ndarray:
    """Attention of ``n_tokens`` queries at positions ``start..start+n_tokens-1`` over the cache.

    With a float16 cache (llama.cpp's default ``type_k``/``type_v``, flash attention on), fewer than
    :data:`FLASH_TILE_QUERIES` queries follow ggml-cpu's one-chunk flash attention
    (:mod:`aioexperts._compute.kernels.flash`: float16 queries and value accumulator); larger
    batches (ggml's tiled kernel: float32 queries and accumulators) and the numpy backend compute
    in float32 from the float16 keys and values.

    Args:
        q: ``(n_tokens, n_head, head_k)`` float32 (after RoPE).
        k: ``(n_kv, n_head_kv, head_k)`` float32 or float16: cached keys of positions ``0..n_kv-1``
            (``n_kv = start + n_tokens``).
        v: ``(n_kv, n_head_kv, head_v)``, the dtype of ``k``.
        start: position of the first query.
        scale: the score scale (``kq_scale``, e.g. ``1/sqrt(head_k)``).
        sinks: optional ``(n_head,)`` float32 sink logits (gpt-oss ``attn_sinks``).
        window: sliding window in positions, 0 for none.

    Returns:
        ``(n_tokens, n_head * head_v)`` float32, heads concatenated (ggml's ``kqv_merged``).

    Raises:
        ConfigError: shapes that do not fit.
    """
    n_tokens, n_head, head_k = q.shape
    n_kv, n_head_kv, _ = k.shape
    if n_kv != start + n_tokens or n_head % n_head_kv or k.shape[2] != head_k or v.shape[:2] != k.shape[:2]:
        raise ConfigError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}, start {start} do not fit")
    if (k.dtype == np.float16 or v.dtype == np.float16) and n_tokens < FLASH_TILE_QUERIES:  # F16 KV cache
        flash = fused.flash_kernel() if k.dtype == v.dtype else None
        if flash is not None:
            out = np.empty((n_tokens, n_head, v.shape[2]), dtype=np.float32)
            no_sinks = np.empty(0, dtype=np.float32)
            sink_logits = no_sinks if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
            flash(np.ascontiguousarray(q, dtype=np.float32), k, v, start, np.float32(scale), sink_logits, window, out)
            return out.reshape(n_tokens, -1)
    group = n_head // n_head_kv
    if _head_parts(n_tokens, n_head, n_kv, n_head_kv) > 1:  # a prefill: KV heads over the pool (the same bits)
        out = np.empty((n_tokens, n_head * v.shape[2]), dtype=np.float32)
        width = group * v.shape[2]

        def heads(h: int) -> None:
            out[:, h * width : (h + 1) * width] = attend(
                q[:, h * group : (h + 1) * group],
                k[:, h : h + 1],
                v[:, h : h + 1],
                start,
                scale,
                sinks=None if sinks is None else sinks[h * group : (h + 1) * group],
                window=window,
            )

        from .pool import compute_pool

        compute_pool().map(heads, range(n_head_kv))
        return out
    if k.dtype == np.float16 or v.dtype == np.float16:
        k, v = k.astype(np.float32), v.astype(np.float32)
    chunk = max(1, SCORE_BYTES // (4 * n_head * n_kv))
    if n_tokens <= chunk:
        return _attend(q, k, v, start, scale, sinks, window)
    parts = []
    for c in range(0, n_tokens, chunk):
        qc = q[c : c + chunk]
        end = start + c + len(qc)
        parts.append(_attend(qc, k[:end], v[:end], start + c, scale, sinks, window))
    return np.concatenate(parts)


SPLIT_MIN = 1 << 18
"""Query rows times heads times cached positions from which a float32 attention of at least
:data:`FLASH_TILE_QUERIES` queries (a prefill) splits its KV heads over the compute pool's idle
workers: each head's numbers are the same however split (a 256-token prefill ran its attention on
one core while the other waited)."""


def _head_parts(n_tokens: int, n_head: int, n_kv: int, n_head_kv: int) -> int:
    """KV-head groups the float32 path splits into: one per KV head for a batch of at least
    :data:`FLASH_TILE_QUERIES` queries and :data:`SPLIT_MIN` work where a compute pool of more than
    one thread exists (this never creates one), else 1."""
    from . import pool as _pool_module

    pool = _pool_module._pool
    if pool is None or pool.n_threads <= 1 or n_head_kv <= 1 or n_tokens < FLASH_TILE_QUERIES:
        return 1
    return n_head_kv if n_tokens * n_head * n_kv >= SPLIT_MIN else 1


def _attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, sinks: np.ndarray | None, window: int
) -> np.ndarray:
    n_tokens, n_head, head_k = q.shape
    n_kv, n_head_kv, _ = k.shape
    group = n_head // n_head_kv
    head_v = v.shape[2]
    qg = q.reshape(n_tokens, n_head_kv, group, head_k).transpose(1, 2, 0, 3)  # (kv, group, t, d)
    kt = k.transpose(1, 2, 0)  # (kv, d, n_kv)
    scores = np.matmul(qg, kt[:, None, :, :]) * np.float32(scale)  # (kv, group, t, n_kv)
    qpos = np.arange(start, start + n_tokens)[:, None]
    kpos = np.arange(n_kv)[None, :]
    masked = kpos > qpos
    if window:
        masked |= (qpos - kpos) >= window
    scores = np.where(masked[None, None], np.float32(-np.inf), scores)
    row_max = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float32).reshape(n_head_kv, group, 1, 1)
        row_max = np.maximum(row_max, sk)
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True, dtype=np.float64)
    if sinks is not None:
        total = total + np.exp(sk - row_max)
    probs = (e / total).astype(np.float32)
    vt = v.transpose(1, 0, 2)  # (kv, n_kv, dv)
    out = np.matmul(probs, vt[:, None, :, :])  # (kv, group, t, dv)
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(n_tokens, n_head * head_v), dtype=np.float32)
