"""numba quantizers to Q2_K, Q3_K and IQ4_XS, operation for operation as ggml-quants.c's reference.

Each follows llama.cpp's ``ggml/src/ggml-quants.c`` without an importance matrix:
``quantize_row_q2_K_ref`` (with ``make_qkx2_quants``), ``quantize_row_q3_K_ref`` (with
``make_q3_quants``) and ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl``, ``ntry`` 7). Every value is
float32 and every operation is in the C source's order (compiled without fastmath: no FMA, no
reassociation). ``nearest_int`` is round-half-to-even, as ggml's magic-number trick. The fp16
fields (``GGML_FP32_TO_FP16``, round to nearest even) are written as float32 values already rounded
to fp16 (:func:`round_half`) into ``halves``; the caller stores their fp16 bits. The blocks' other
bytes are written into ``out`` (one row of ``type_size`` bytes per block).

Kept in one module (the numba cache key covers only a function's own file: docs/notes/KERNELS.md).
"""

from __future__ import annotations

import math

import numpy as np

from .._compute.jit import kernel

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
#: Q2_K sub-blocks quantized at once, one per SIMD lane (4 super-blocks: the scratch stays in L1)
Q2K_LANES = 64
_Q2K_STATE = 17  # per-lane float32 state rows of quantize_q2_k
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


@kernel(exact=True, inline=True)
def round_half(f):
    """The float32 value ``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f))`` (round to nearest even, inf past 65504)."""
    v = float(f)
    if v == 0.0 or not math.isfinite(v):
        return np.float32(v)
    _, e = math.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1: fp16 keeps 11 significant bits
    ulp = e - 11
    if ulp < -24:
        ulp = -24  # fp16 subnormals: multiples of 2**-24
    r = np.rint(math.ldexp(v, -ulp)) * math.ldexp(1.0, ulp)  # exact scalings, one RNE rounding
    if abs(r) > 65504.0:
        r = math.copysign(math.inf, v)
    return np.float32(r)


@kernel(exact=True, inline=True)
def nearest_int(f):
    return int(np.rint(f))


@kernel(exact=True)
def quantize_q2_k(x, out, halves):
    """Q2_K blocks of ``x`` (float32, a multiple of 256): ``out`` (nb, 84) uint8, ``halves`` (nb, 2) d, dmin.

    ggml's ``make_qkx2_quants`` (nmax 3, rmin -0.5, rdelta 0.1, nstep 15, use_mad) runs on
    :data:`Q2K_LANES` sub-blocks at once, one sub-block per lane: every loop over lanes is element by
    element (LLVM turns it into SIMD), and each lane does the source's operations in the source's
    order, so the bytes are those of the scalar code. Branches become selects: a lane computes what
    the source would skip (a step with ``D <= 0``, a constant sub-block) and then discards it. The
    levels of the best step are not copied at each step: the lane keeps that step's iscale and min
    and computes its levels once at the end, with the same operations on the same operands.
    """
    nb = x.shape[0] // QK_K
    lanes = Q2K_LANES
    xt = np.empty((16, lanes), dtype=np.float32)  # value i of sub-block s at [i, s]
    wt = np.empty((16, lanes), dtype=np.float32)  # its weight |x|
    lt = np.empty((16, lanes), dtype=np.float32)  # the levels (0..3, as float)
    la = np.empty((16, lanes), dtype=np.float32)  # the levels of the current step
    st = np.empty((_Q2K_STATE, lanes), dtype=np.float32)
    lo, hi, sum_w, sum_x, best, scale = st[0], st[1], st[2], st[3], st[4], st[5]
    iscale, sum_l, sum_l2, sum_xl = st[6], st[7], st[8], st[9]
    t_scale, t_min, take, flat, err, best_iscale, best_lo = st[10], st[11], st[12], st[13], st[14], st[15], st[16]
    L = np.zeros(QK_K, dtype=np.int64)
    fmax = F32(3.0)
    rmin = F32(-0.5)
    rdelta = F32(0.1)
    q4scale = F32(15.0)
    per_pass = lanes // 16
    for b0 in range(0, nb, per_pass):
        nsb = min(per_pass, nb - b0)
        ns = nsb * 16
        base = b0 * QK_K
        for s in range(ns):
            for i in range(16):
                v = x[base + 16 * s + i]
                xt[i, s] = v
                wt[i, s] = abs(v)
        # make_qkx2_quants, lane s = sub-block s
        for s in range(ns):
            v = xt[0, s]
            lo[s] = v
            hi[s] = v
            w = wt[0, s]
            sum_w[s] = w
            sum_x[s] = w * v
        for i in range(1, 16):
            for s in range(ns):
                v = xt[i, s]
                w = wt[i, s]
                a = lo[s]
                lo[s] = v if v < a else a
                c = hi[s]
                hi[s] = v if v > c else c
                sum_w[s] = sum_w[s] + w
                sum_x[s] = sum_x[s] + w * v
        for s in range(ns):
            a = lo[s]
            a = F32(0.0) if a > F32(0.0) else a
            lo[s] = a
            flat[s] = F32(1.0) if hi[s] == a else F32(0.0)  # the source returns here: levels 0, scale 0
            c = fmax / (hi[s] - a)
            iscale[s] = c
            scale[s] = F32(1.0) / c
            best[s] = F32(0.0)
            best_iscale[s] = c
            best_lo[s] = a
        for i in range(16):
            for s in range(ns):
                v = xt[i, s]
                a = lo[s]
                q = np.rint(iscale[s] * (v - a))
                q = F32(0.0) if q < F32(0.0) else q
                q = fmax if q > fmax else q
                diff = abs(scale[s] * q + a - v)
                best[s] = best[s] + wt[i, s] * diff
        for step in range(16):
            top = rmin + rdelta * F32(step) + fmax
            for s in range(ns):
                iscale[s] = top / (hi[s] - lo[s])
                sum_l[s] = F32(0.0)
                sum_l2[s] = F32(0.0)
                sum_xl[s] = F32(0.0)
            for i in range(16):
                for s in range(ns):
                    v = xt[i, s]
                    q = np.rint(iscale[s] * (v - lo[s]))
                    q = F32(0.0) if q < F32(0.0) else q
                    q = fmax if q > fmax else q
                    la[i, s] = q
                    wq = wt[i, s] * q
                    sum_l[s] = sum_l[s] + wq
                    sum_l2[s] = sum_l2[s] + wq * q
                    sum_xl[s] = sum_xl[s] + wq * v
            for s in range(ns):
                a = sum_l[s]
                b = sum_l2[s]
                c = sum_xl[s]
                d = sum_w[s] * b - a * a
                this_scale = (sum_w[s] * c - sum_x[s] * a) / d
                this_min = (b * sum_x[s] - a * c) / d
                clipped = this_min > F32(0.0)
                t_scale[s] = c / b if clipped else this_scale
                t_min[s] = F32(0.0) if clipped else this_min
                take[s] = F32(1.0) if d > F32(0.0) else F32(0.0)  # the source's `if (D > 0)`
                err[s] = F32(0.0)
            for i in range(16):
                for s in range(ns):
                    diff = abs(t_scale[s] * la[i, s] + t_min[s] - xt[i, s])
                    err[s] = err[s] + wt[i, s] * diff
            for s in range(ns):
                e = err[s]
                was = best[s]
                better = (take[s] > F32(0.0)) & (e < was) & (flat[s] == F32(0.0))
                best[s] = e if better else was
                a = scale[s]
                c = t_scale[s]
                scale[s] = c if better else a
                a = lo[s]
                c = best_lo[s]
                best_lo[s] = a if better else c  # the min this step's levels were taken with
                c = best_iscale[s]
                e = iscale[s]
                best_iscale[s] = e if better else c
                c = t_min[s]
                lo[s] = c if better else a
        # the levels of the best step (or of the first guess), computed again as that step did: the
        # same operations on the same operands, so the same values (cheaper than keeping a copy per step)
        for i in range(16):
            for s in range(ns):
                q = np.rint(best_iscale[s] * (xt[i, s] - best_lo[s]))
                q = F32(0.0) if q < F32(0.0) else q
                lt[i, s] = fmax if q > fmax else q
        # per super-block: the sub-block scales and mins to 4 bits, then the levels again
        for k in range(nsb):
            xb = x[base + k * QK_K : base + (k + 1) * QK_K]
            y = out[b0 + k]
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                s = 16 * k + j
                if flat[s] > F32(0.0):
                    scale[s] = F32(0.0)
                    for i in range(16):
                        lt[i, s] = F32(0.0)
                lo[s] = -lo[s]  # the_min
                if scale[s] > max_scale:
                    max_scale = scale[s]
                if lo[s] > max_min:
                    max_min = lo[s]
                for i in range(16):
                    L[16 * j + i] = int(lt[i, s])
            if max_scale > F32(0.0):
                iscale_b = q4scale / max_scale
                for j in range(16):
                    y[j] = nearest_int(iscale_b * scale[16 * k + j]) & 0xFF
                d = round_half(max_scale / q4scale)
            else:
                for j in range(16):
                    y[j] = 0
                d = F32(0.0)
            if max_min > F32(0.0):
                iscale_b = q4scale / max_min
                for j in range(16):
                    y[j] = (int(y[j]) | (nearest_int(iscale_b * lo[16 * k + j]) << 4)) & 0xFF
                dmin = round_half(max_min / q4scale)
            else:
                dmin = F32(0.0)
            halves[b0 + k, 0] = d
            halves[b0 + k, 1] = dmin
            for j in range(16):
                dj = d * F32(int(y[j]) & 0xF)
                if dj == F32(0.0):
                    continue
                dm = dmin * F32(int(y[j]) >> 4)
                for ii in range(16):
                    li = nearest_int((xb[16 * j + ii] + dm) / dj)
                    L[16 * j + ii] = max(0, min(3, li))
            for j in range(0, QK_K, 128):
                for l in range(32):
                    y[16 + j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)


@kernel(exact=True, inline=True)
def make_q3_quants(n, nmax, x, L):
    """ggml's make_q3_quants with do_rmse = true: the scale; L in 0..2*nmax-1."""
    fmax = F32(nmax)
    amax = F32(0.0)
    xmax = F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            xmax = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = -fmax / xmax
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        li = nearest_int(iscale * x[i])
        li = max(-nmax, min(nmax - 1, li))
        L[i] = li
        w = x[i] * x[i]
        fl = F32(li)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fl = F32(L[i])
            slx = sumlx - w * x[i] * fl
            if slx > F32(0.0):
                sl2 = suml2 - w * fl * fl
                new_l = nearest_int(x[i] * sl2 / slx)
                new_l = max(-nmax, min(nmax - 1, new_l))
                if new_l != L[i]:
                    fn = F32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > F32(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > F32(0.0) else F32(0.0)


@kernel(exact=True)
def quantize_q3_k(x, out, halves):
    """Q3_K blocks of ``x``: ``out`` (nb, 110) uint8 (hmask, qs, scales; d left), ``halves`` (nb, 1) d."""
    nb = x.shape[0] // QK_K
    L = np.zeros(QK_K, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    for i in range(nb):
        xb = x[i * QK_K : (i + 1) * QK_K]
        y = out[i]
        max_scale = F32(0.0)
        amax = F32(0.0)
        for j in range(16):
            s = make_q3_quants(16, 4, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16])
            scales[j] = s
            a = abs(s)
            if a > amax:
                amax = a
                max_scale = s
        for j in range(12):
            y[96 + j] = 0
        if max_scale != F32(0.0):
            iscale = F32(-32.0) / max_scale
            for j in range(16):
                li = nearest_int(iscale * scales[j])
                li = max(-32, min(31, li)) + 32
                if j < 8:
                    y[96 + j] = li & 0xF
                else:
                    y[96 + j - 8] = int(y[96 + j - 8]) | ((li & 0xF) << 4)
                li >>= 4
                y[96 + j % 4 + 8] = int(y[96 + j % 4 + 8]) | (li << (2 * (j // 4)))
            d = round_half(F32(1.0) / iscale)
        else:
            d = F32(0.0)
        halves[i, 0] = d
        for j in range(16):
            if j < 8:
                low = np.int64(y[96 + j]) & 0xF
            else:
                low = np.int64(y[96 + j - 8]) >> 4
            high = (np.int64(y[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3
            sc = (low | (high << 4)) - 32
            dj = d * F32(sc)
            if dj == F32(0.0):
                continue
            for ii in range(16):
                li = nearest_int(xb[16 * j + ii] / dj)
                L[16 * j + ii] = max(-4, min(3, li)) + 4
        for j in range(32):
            y[j] = 0
        m = 0
        hm = 1
        for j in range(QK_K):
            if L[j] > 3:
                y[m] = int(y[m]) | hm
                L[j] -= 4
            m += 1
            if m == 32:
                m = 0
                hm <<= 1
        for j in range(0, QK_K, 128):
            for l in range(32):
                y[32 + j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)


@kernel(exact=True, inline=True)
def best_index_int8(values, x):
    n = values.shape[0]
    if x <= F32(values[0]):
        return 0
    if x >= F32(values[n - 1]):
        return n - 1
    ml = 0
    mu = n - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < F32(values[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - F32(values[mu - 1]) < F32(values[mu]) - x else mu


@kernel(exact=True)
def quantize_iq4_xs(x, out, halves, values):
    """IQ4_XS blocks of ``x`` (quantize_row_iq4_nl_impl(QK_K, 32, ..., ntry 7) without quant weights):
    ``out`` (nb, 136) uint8 (scales_h, scales_l, qs; d left), ``halves`` (nb, 1) d."""
    nb = x.shape[0] // QK_K
    L = np.zeros(QK_K, dtype=np.int64)
    weight = np.zeros(32, dtype=np.float32)
    scales = np.zeros(8, dtype=np.float32)
    ntry = 7
    v0 = F32(values[0])
    for ibl in range(nb):
        xs = x[ibl * QK_K : (ibl + 1) * QK_K]
        y = out[ibl]
        sigma2 = F32(0.0)
        for j in range(QK_K):
            sigma2 += xs[j] * xs[j]
        sigma2 *= F32(2.0) / F32(QK_K)  # unused without quant weights, kept for the order of the source
        for j in range(128):
            y[8 + j] = 0
        max_scale = F32(0.0)
        amax_scale = F32(0.0)
        for ib in range(8):
            xb = xs[ib * 32 : ib * 32 + 32]
            for j in range(32):
                weight[j] = xb[j] * xb[j]
            amax = F32(0.0)
            xmax = F32(0.0)
            for j in range(32):
                ax = abs(xb[j])
                if ax > amax:
                    amax = ax
                    xmax = xb[j]
            if amax < GROUP_MAX_EPS:
                scales[ib] = F32(0.0)
                continue
            d = -xmax / v0
            id_ = F32(1.0) / d
            sumqx = F32(0.0)
            sumq2 = F32(0.0)
            for j in range(32):
                al = id_ * xb[j]
                li = best_index_int8(values, al)
                L[ib * 32 + j] = li
                q = F32(values[li])
                w = weight[j]
                sumqx += w * q * xb[j]
                sumq2 += w * q * q
            d = sumqx / sumq2 if sumq2 > F32(0.0) else F32(0.0)
            best = d * sumqx
            for itry in range(-ntry, ntry + 1):
                id_ = F32(itry + int(values[0])) / xmax
                sumqx = F32(0.0)
                sumq2 = F32(0.0)
                for j in range(32):
                    al = id_ * xb[j]
                    li = best_index_int8(values, al)
                    q = F32(values[li])
                    w = weight[j]
                    sumqx += w * q * xb[j]
                    sumq2 += w * q * q
                if sumq2 > F32(0.0) and sumqx * sumqx > best * sumq2:
                    d = sumqx / sumq2
                    best = d * sumqx
            scales[ib] = d
            abs_d = abs(d)
            if abs_d > amax_scale:
                amax_scale = abs_d
                max_scale = d
        scales_h = 0
        d = -max_scale / F32(32.0)  # the source goes on with the unrounded d; only dh is fp16
        halves[ibl, 0] = round_half(d)
        id_ = F32(1.0) / d if d != F32(0.0) else F32(0.0)
        for ib in range(8):
            li = nearest_int(id_ * scales[ib])
            li = max(-32, min(31, li))
            dl = d * F32(li)
            idl = F32(1.0) / dl if dl != F32(0.0) else F32(0.0)
            for j in range(32):
                L[ib * 32 + j] = best_index_int8(values, idl * xs[ib * 32 + j])
            li += 32
            l_l = li & 0xF
            l_h = li >> 4
            if ib % 2 == 0:
                y[4 + ib // 2] = l_l
            else:
                y[4 + ib // 2] = int(y[4 + ib // 2]) | (l_l << 4)
            scales_h |= l_h << (2 * (ib % 8))
        y[2] = scales_h & 0xFF
        y[3] = (scales_h >> 8) & 0xFF
        for i in range(8):
            for j in range(16):
                y[8 + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)
