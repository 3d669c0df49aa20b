"""DeepSeek-V4's compressed attention: compressor rows, the lightning indexer, window + row attention.

llama.cpp src/models/deepseek4.cpp (``build_hca_compressed_kv_from_state``,
``build_overlap_compressed_kv_from_state``, ``build_lid_top_k``, ``build_*_attention``) and
src/llama-kv-cache-dsv4.cpp (which positions a row reads, which rows a query sees). Stateless: the
caller keeps every position's compressor inputs and the finished rows.

- A compressed row ``b`` of ratio ``r`` sums, per channel, the compressor values of positions
  ``[r b, r b + r)`` weighted by a softmax of their scores (HCA, ``r = 128``); the overlapped
  compressor (CSA, ``r = 4``) has 2 d wide inputs and softmaxes each output channel over the
  ``r`` positions of block ``b - 1`` (channels ``[0, d)``) and of block ``b`` (channels ``[d, 2 d)``).
- Row ``b`` is visible to the queries at positions ``>= r (b + 1) - 1``.
- The indexer scores a visible row ``b`` for a query as ``sum_h w_h relu(q_h . k_b)``; the
  ``top_k`` best join the query's window keys.
- Attention: one K = V head, the sinks in the softmax denominator (ggml ``soft_max`` with sinks).
"""

from __future__ import annotations

import numpy as np

__all__ = (
    "attend_window_rows",
    "compressed_rows",
    "hadamard",
    "index_scores",
    "select_rows",
)


def compressed_rows(kv: np.ndarray, score: np.ndarray, blocks: range, ratio: int, *, overlap: bool) -> np.ndarray:
    """The compressor's rows of ``blocks`` (before their RMSNorm and RoPE).

    Args:
        kv: ``(n_pos, w)`` float32, the compressor values of positions ``0..n_pos-1`` (``attn_compressor_kv x``).
        score: ``(n_pos, w)`` float32, their scores (``attn_compressor_gate x + ape[pos % ratio]``).
        blocks: the row ids; every position of ``[ratio * blocks.start - (ratio if overlap), ratio * blocks.stop)``
            must be in ``kv``.
        ratio: positions per row.
        overlap: the overlapped (CSA) compressor: ``w = 2 d``.

    Returns:
        ``(len(blocks), d)`` float32 with ``d = w // 2`` when ``overlap`` else ``w``.
    """
    w = kv.shape[1]
    d = w // 2 if overlap else w
    out = np.empty((len(blocks), d), dtype=np.float32)
    for i, b in enumerate(blocks):
        cur = slice(ratio * b, ratio * b + ratio)
        if overlap:
            if b > 0:
                prev = slice(ratio * (b - 1), ratio * b)
                vals = np.concatenate([kv[prev, :d], kv[cur, d:]])
                scores = np.concatenate([score[prev, :d], score[cur, d:]])
            else:  # block -1: value 0, score -inf
                vals, scores = kv[cur, d:], score[cur, d:]
        else:
            vals, scores = kv[cur], score[cur]
        e = np.exp(scores - scores.max(axis=0), dtype=np.float32)
        wts = e / e.sum(axis=0, dtype=np.float32)
        out[i] = (vals * wts).sum(axis=0, dtype=np.float32)
    return out


def hadamard(n: int) -> np.ndarray:
    """The ``(n, n)`` Sylvester-Hadamard matrix divided by ``sqrt(n)`` (orthonormal, symmetric), float32;
    llama.cpp rotates the indexer's rows and queries by it before keeping the rows in F16."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"no Sylvester-Hadamard matrix of size {n}")
    out: np.ndarray = (h / np.sqrt(n)).astype(np.float32)
    return out


def index_scores(q: np.ndarray, weights: np.ndarray, rows: np.ndarray, n_visible: np.ndarray) -> np.ndarray:
    """The lightning indexer's scores (``build_lid_top_k``).

    Args:
        q: ``(n, n_head, d)`` float32, the index queries (after RoPE).
        weights: ``(n, n_head)`` float32, ``indexer.proj x / sqrt(d n_head)``.
        rows: ``(n_rows, d)`` float32, the index rows.
        n_visible: ``(n,)`` rows each query sees (``(pos + 1) // ratio``).

    Returns:
        ``(n, n_rows)`` float32, ``-inf`` where a row is not visible.
    """
    kq = np.einsum("nhd,bd->nhb", q, rows, dtype=np.float32)
    s: np.ndarray = (np.maximum(kq, 0) * weights[:, :, None]).sum(axis=1, dtype=np.float32)
    s[np.arange(rows.shape[0])[None, :] >= n_visible[:, None]] = -np.inf
    return s


def select_rows(scores: np.ndarray, n_visible: np.ndarray, top_k: int) -> list[np.ndarray]:
    """Per query, the ids of its ``top_k`` best visible rows (all of them when fewer), ascending."""
    out = []
    for s, nv in zip(scores, n_visible, strict=True):
        nv = int(nv)
        if nv <= top_k:
            out.append(np.arange(nv))
        else:
            part = np.argpartition(-s[:nv], top_k - 1)[:top_k]
            out.append(np.sort(part))
    return out


def attend_window_rows(
    q: np.ndarray,
    kv: np.ndarray,
    rows: np.ndarray,
    start: int,
    window: int,
    picks: list[np.ndarray],
    scale: float,
    sinks: np.ndarray,
) -> np.ndarray:
    """Attention of ``n`` queries over their window keys and their compressed rows (K = V).

    Args:
        q: ``(n, n_head, d)`` float32 (after RoPE), positions ``start..start+n-1``.
        kv: ``(start + n, d)`` float32, the raw (rotated) keys of every position so far.
        rows: ``(n_rows, d)`` float32, the compressed rows (normed and rotated).
        start: position of the first query.
        window: the sliding window: query ``i`` sees raw keys ``i - window < j <= i``.
        picks: per query, the row ids it attends to.
        scale: ``1/sqrt(d)``.
        sinks: ``(n_head,)`` float32, one logit per head added to the softmax denominator.

    Returns:
        ``(n, n_head, d)`` float32.
    """
    n = q.shape[0]
    out = np.empty_like(q)
    for i in range(n):
        pos = start + i
        keys = kv[max(0, pos - window + 1) : pos + 1]
        if len(picks[i]):
            keys = np.concatenate([keys, rows[picks[i]]])
        s = (q[i] @ keys.T) * np.float32(scale)  # (n_head, m)
        m = np.maximum(s.max(axis=1), sinks)
        e = np.exp(s - m[:, None])
        denom = e.sum(axis=1) + np.exp(sinks - m)
        out[i] = (e / denom[:, None]) @ keys
    return out
