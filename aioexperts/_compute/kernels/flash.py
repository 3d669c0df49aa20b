"""ggml-cpu's one-chunk flash attention over an F16 KV cache, with its F16 value accumulator.

ggml/src/ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` with F16 K and V:
per query row and head, ``s = dot(fp16(q), k) * scale`` (masked positions skipped), an online
softmax whose running sum ``S`` and maximum ``M`` are float32 and whose weighted sum of values
``VKQ`` is kept in float16 (``ggml_vec_scale_f16`` when the maximum grows, ``ggml_vec_mad_f16``
per position, each result rounded to float16), then the sink (float32) and ``VKQ / S``; the
dot products and FMAs in the order and rounding of the x86 AVX2 build (ggml-cpu/vec.cpp, vec.h).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .common import CACHE_LINE, F32, U32, prefetch
from .halfvec import dot_f16_q, mad_f16, narrow_f16, scale_f16, widen_f16
from .rope import norm_rope_heads

# ruff: noqa: N803, N806

#: positions ahead whose key and value rows the vector kernel prefetches
FLASH_PREFETCH_ROWS = 4
HALF_MAX_ROUNDED = F32(65520.0)  # values at or above round to inf in float16
HALF_MIN_NORMAL = F32(2.0**-14)
HALF_SUBNORMAL_UNIT = F32(2.0**-24)
HALF_DROPPED_BITS = U32(13)


@kernel(exact=True, inline=True)
def to_half(value):
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(value))``: round half to even to float16, as float32."""
    a = abs(value)
    if not a < HALF_MAX_ROUNDED:  # inf, NaN or overflow
        return value if a != a else (F32(np.inf) if value > 0 else F32(-np.inf))
    if a < HALF_MIN_NORMAL:
        r = F32(np.rint(a / HALF_SUBNORMAL_UNIT)) * HALF_SUBNORMAL_UNIT
    else:
        bits = F32(a).view(U32)
        lsb = (bits >> HALF_DROPPED_BITS) & U32(1)
        r = U32((bits + U32(0x0FFF) + lsb) & U32(0xFFFF_E000)).view(F32)
    return -r if value < 0 else r


@kernel(exact=True, inline=True)
def fma32(a, b, c):
    """``a * b + c`` rounded once to float32 (``_mm256_fmadd_ps``; through float64, where the
    product is exact)."""
    return F32(np.float64(a) * np.float64(b) + np.float64(c))


@kernel(exact=True, inline=True)
def dot_f16(qh, k, j, kh, lanes):
    """x86 AVX2 ``ggml_vec_dot_f16`` of ``qh`` with ``k[j, kh]``: four 8-lane float32 FMA
    accumulators over steps of 32, reduced as ``GGML_F32x8_REDUCE`` does, leftovers in float64."""
    n = qh.size
    np32 = n - n % 32
    for a in range(32):
        lanes[a] = F32(0.0)
    for i in range(0, np32, 32):
        for a in range(32):
            lanes[a] = fma32(qh[i + a], k[j, kh, i + a], lanes[a])
    for a in range(8):  # x[0] += x[2], x[1] += x[3]; then x[0] += x[1]
        lanes[a] = F32(lanes[a] + lanes[16 + a])
        lanes[8 + a] = F32(lanes[8 + a] + lanes[24 + a])
        lanes[a] = F32(lanes[a] + lanes[8 + a])
    t0 = F32(lanes[0] + lanes[4])
    t1 = F32(lanes[1] + lanes[5])
    t2 = F32(lanes[2] + lanes[6])
    t3 = F32(lanes[3] + lanes[7])
    total = np.float64(F32(F32(t0 + t1) + F32(t2 + t3)))
    for i in range(np32, n):
        total += np.float64(F32(qh[i] * k[j, kh, i]))
    return F32(total)


@kernel(exact=True, inline=True)
def finish_row(acc, S, M, sinks, h, out, t):
    """The end of one query head: the sink of head ``h`` (float32, joins the maximum and the sum),
    then ``out[t, h] = VKQ / S``."""
    if sinks.size:
        sk = sinks[h]
        ms = F32(1.0)
        vs = F32(1.0)
        if sk > M:
            ms = F32(np.exp(F32(M - sk)))
            for d in range(acc.size):
                acc[d] = F32(acc[d] * ms)
        else:
            vs = F32(np.exp(F32(sk - M)))
        S = F32(S * ms + vs)
    inverse = F32(1.0) / S if S != 0 else F32(0.0)
    for d in range(acc.size):
        out[t, h, d] = acc[d] * inverse


@kernel(exact=True)
def flash_attend_f16(q, k, v, start, scale, sinks, window, out):
    """``out[t, h] = softmax(q[t, h] . k) v`` as ggml's one-chunk F16 flash attention computes it.

    ``q`` ``(T, H, DK)`` float32 (rounded to float16 here), ``k`` ``(n_kv, HKV, DK)`` and ``v``
    ``(n_kv, HKV, DV)`` float32 holding float16 values, query ``t`` at position ``start + t`` sees
    keys ``j <= start + t`` with ``start + t - j < window`` (``window`` 0: all); ``sinks`` ``(H,)``
    float32 (empty: none); ``out`` ``(T, H, DV)`` float32.
    """
    T, H, DK = q.shape
    n_kv, HKV, _ = k.shape
    DV = v.shape[2]
    group = H // HKV
    qh = np.empty(DK, dtype=F32)
    acc = np.empty(DV, dtype=F32)
    lanes = np.empty(32, dtype=F32)
    for t in range(T):
        p1 = start + t
        for h in range(H):
            kh = h // group
            for d in range(DK):
                qh[d] = to_half(q[t, h, d])
            for d in range(DV):
                acc[d] = F32(0.0)
            S = F32(0.0)
            M = F32(-np.inf)
            for j in range(min(n_kv, p1 + 1)):
                if window > 0 and p1 - j >= window:
                    continue
                s = F32(dot_f16(qh, k, j, kh, lanes) * F32(scale))
                ms = F32(1.0)
                vs = F32(1.0)
                if s > M:
                    ms = F32(np.exp(F32(M - s)))
                    M = s
                    for d in range(DV):
                        acc[d] = to_half(F32(acc[d] * ms))
                else:
                    vs = F32(np.exp(F32(s - M)))
                dv32 = DV - DV % 32
                for d in range(dv32):  # ggml_vec_mad_f16: FMA, then float16
                    acc[d] = to_half(fma32(v[j, kh, d], vs, acc[d]))
                for d in range(dv32, DV):
                    acc[d] = to_half(F32(acc[d] + F32(v[j, kh, d] * vs)))
                S = F32(S * ms + vs)
            finish_row(acc, S, M, sinks, h, out, t)


@kernel(exact=True)
def flash_attend_f16_bits(q, k, v, start, scale, sinks, window, out, h_lo, h_hi):
    """:func:`flash_attend_f16` on the float16 cache itself, in vector steps (:mod:`.halfvec`),
    for the query heads ``h_lo..h_hi-1`` (each head is independent: callers split heads over threads).

    ``k`` ``(n_kv, HKV, DK)`` and ``v`` ``(n_kv, HKV, DV)`` uint16 (the float16 bit patterns of the
    cache, C-contiguous), ``DK`` and ``DV`` multiples of 32; everything else as
    :func:`flash_attend_f16`, and bit for bit its result (the same operations in the same order,
    each FMA rounded once).

    The query heads that share a KV head (GQA) walk the positions together: each key and value
    row is widened to float32 once for all of them (:func:`.halfvec.widen_f16`), and their online
    softmaxes (a chain of dot, compare, ``exp`` and FMA per position, each waiting for the one
    before) interleave, so the core overlaps several chains instead of waiting on one. Each head's
    operations and their order are those of the head alone.
    """
    T, H, DK = q.shape
    n_kv, HKV, _ = k.shape
    DV = v.shape[2]
    group = H // HKV
    kf = k.reshape(-1)
    vf = v.reshape(-1)
    qh = np.empty((group, DK), dtype=F32)
    acc = np.empty((group, DV), dtype=F32)
    k_row = np.empty(DK, dtype=F32)
    v_row = np.empty(DV, dtype=F32)
    S = np.empty(group, dtype=F32)
    M = np.empty(group, dtype=F32)
    for t in range(T):
        p1 = start + t
        lo = 0
        if window > 0 and p1 - window + 1 > 0:
            lo = p1 - window + 1
        hi = min(n_kv, p1 + 1)
        for kh in range(h_lo // group, (h_hi + group - 1) // group):
            g0 = max(h_lo, kh * group)
            n_g = min(h_hi, (kh + 1) * group) - g0
            for i in range(n_g):
                for d in range(DK):
                    qh[i, d] = to_half(q[t, g0 + i, d])
                for d in range(DV):
                    acc[i, d] = F32(0.0)
                S[i] = F32(0.0)
                M[i] = F32(-np.inf)
            for j in range(lo, hi):
                if j + FLASH_PREFETCH_ROWS < hi:  # the rows a few positions ahead: each step waits on the one before
                    ka = (j + FLASH_PREFETCH_ROWS) * HKV + kh
                    for c in range(0, DK, CACHE_LINE // 2):
                        prefetch(kf, ka * DK + c)
                    for c in range(0, DV, CACHE_LINE // 2):
                        prefetch(vf, ka * DV + c)
                widen_f16(k_row, kf, (j * HKV + kh) * DK, DK)
                widen_f16(v_row, vf, (j * HKV + kh) * DV, DV)
                for i in range(n_g):
                    s = F32(dot_f16_q(qh[i], k_row, DK) * F32(scale))
                    ms = F32(1.0)
                    vs = F32(1.0)
                    if s > M[i]:
                        ms = F32(np.exp(F32(M[i] - s)))
                        M[i] = s
                        scale_f16(acc[i], ms, DV)
                    else:
                        vs = F32(np.exp(F32(s - M[i])))
                    mad_f16(acc[i], v_row, vs, DV)
                    S[i] = F32(S[i] * ms + vs)
            for i in range(n_g):
                finish_row(acc[i], S[i], M[i], sinks, g0 + i, out, t)


#: the descriptor of :func:`make_flash_task`'s task: ``int64[FLASH_DESC_SIZE]``; ``scale`` holds a
#: float64's bits, the ``*_ADDR`` fields addresses of C-contiguous arrays
(
    F_Q_ADDR, F_T, F_H, F_DK, F_K_ADDR, F_N_KV, F_HKV, F_V_ADDR, F_DV, F_START, F_SCALE,
    F_SINKS_ADDR, F_N_SINKS, F_WINDOW, F_OUT_ADDR, F_HEADS_PER_ITEM,
) = range(16)  # fmt: skip
FLASH_DESC_SIZE = 16


def flash_descriptor(q, n_head_kv, head_v, scale, sinks, window, out):
    """A descriptor of :func:`make_flash_task`'s task for the queries ``q`` ``(T, H, DK)`` float32
    writing ``out`` ``(T, H, DV)`` float32, an item per KV head (``H // n_head_kv`` query heads
    each); ``scale`` goes in as a float64's bits, ``sinks`` is ``(H,)`` float32 or empty. The
    cache's fields are set by :func:`set_flash_cache`. The caller keeps every array alive."""
    T, H, DK = q.shape
    desc = np.zeros(FLASH_DESC_SIZE, dtype=np.int64)
    desc[F_Q_ADDR], desc[F_T], desc[F_H], desc[F_DK] = q.ctypes.data, T, H, DK
    desc[F_HKV], desc[F_DV] = n_head_kv, head_v
    desc[F_SCALE] = np.float64(scale).view(np.int64)
    desc[F_SINKS_ADDR], desc[F_N_SINKS] = sinks.ctypes.data, sinks.shape[0]
    desc[F_WINDOW], desc[F_OUT_ADDR], desc[F_HEADS_PER_ITEM] = window, out.ctypes.data, H // n_head_kv
    return desc


@kernel(exact=True)
def norm_rope_store_kv(
    q, norm_q, wq, q_tmp, q_out, k, norm_k, wk, k_tmp, k_out, v, eps, cos, sin, neox, n_rot, k16, v16, start
):
    """A decode token's q and k heads normed and rotated (:func:`.rope.norm_rope_heads` of each, the
    same bits) and its key and value rows written at ``start`` of the float16 caches ``k16``/``v16``
    (uint16 ``(n_ctx, n_head_kv, head)``, C-contiguous) rounded as numpy's ``astype(float16)``
    (:func:`.halfvec.narrow_f16`): one call for the two calls and two cache writes of
    :class:`aioexperts._compute.decode_attention.RowAttention`. ``k_out`` ``(1, n_head_kv, head_k)``
    and ``v`` ``(n_head_kv, head_v)`` C-contiguous float32, heads multiples of 32."""
    norm_rope_heads(q, norm_q, wq, eps, cos, sin, neox, n_rot, q_tmp, q_out)
    norm_rope_heads(k, norm_k, wk, eps, cos, sin, neox, n_rot, k_tmp, k_out)
    nk = k16.shape[1] * k16.shape[2]
    nv = v16.shape[1] * v16.shape[2]
    narrow_f16(k16[start].reshape(nk), k_out.reshape(nk), nk)
    narrow_f16(v16[start].reshape(nv), v.reshape(nv), nv)


@kernel()
def set_flash_cache(desc, k16, v16, n_kv, start):
    """The cache's fields of a :func:`flash_descriptor`: the float16 bit patterns ``k16`` and
    ``v16`` (uint16, C-contiguous, at least ``n_kv`` positions), ``n_kv`` positions read, the
    first query at position ``start``. Compiled: a decode layer sets them once per token, and
    two ``.ctypes.data`` in Python cost about 30 us there (the caches cold after the weights)."""
    desc[F_K_ADDR] = k16.ctypes.data
    desc[F_V_ADDR] = v16.ctypes.data
    desc[F_N_KV] = n_kv
    desc[F_START] = start


def make_flash_task():  # untyped: a numba kernel factory (mypy skips this package)
    """A fan-out task (:mod:`.fanout`): item ``i`` is :func:`flash_attend_f16_bits` for the query
    heads ``i * per .. min(H, (i + 1) * per) - 1`` (``per`` = ``F_HEADS_PER_ITEM``), every array
    given by address in the descriptor (the caller checked the shapes and keeps them alive);
    returns 0. Compiled when made (not cached on disk)."""
    import numba

    from .common import address_pointer

    sig = numba.types.int64(numba.types.int64, numba.types.int64)

    @numba.cfunc(sig, nopython=True, error_model="numpy", boundscheck=False)
    def task(desc_address, item):
        desc = numba.carray(address_pointer(desc_address), (FLASH_DESC_SIZE,), np.int64)
        T, H, DK = desc[F_T], desc[F_H], desc[F_DK]
        n_kv, HKV, DV = desc[F_N_KV], desc[F_HKV], desc[F_DV]
        q = numba.carray(address_pointer(desc[F_Q_ADDR]), (T, H, DK), np.float32)
        k = numba.carray(address_pointer(desc[F_K_ADDR]), (n_kv, HKV, DK), np.uint16)
        v = numba.carray(address_pointer(desc[F_V_ADDR]), (n_kv, HKV, DV), np.uint16)
        sinks = numba.carray(address_pointer(desc[F_SINKS_ADDR]), (desc[F_N_SINKS],), np.float32)
        out = numba.carray(address_pointer(desc[F_OUT_ADDR]), (T, H, DV), np.float32)
        scale = np.int64(desc[F_SCALE]).view(np.float64)
        per = desc[F_HEADS_PER_ITEM]
        flash_attend_f16_bits(
            q, k, v, desc[F_START], scale, sinks, desc[F_WINDOW], out, item * per, min(H, (item + 1) * per)
        )
        return 0

    return task
