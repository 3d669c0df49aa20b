"""The gated delta rule as one compiled loop (:func:`aioexperts._compute.delta_net.delta_rule`'s kernel).

Per value head and token, each row ``j`` of the state (``S^T``, as llama.cpp stores it) is decayed,
dotted with ``k``, updated by ``k * delta[j]`` and dotted with ``q`` in one pass: the rows are
independent, so this is ops.cpp ``ggml_compute_forward_gated_delta_net_one_chunk``'s four sweeps
fused (float32 sums, vectorised by fastmath as ggml's ``ggml_vec_dot_f32`` is by SIMD).
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute.jit import kernel


@kernel()
def delta_rule_f32(q, k, v, decay, beta, state, out, scale):
    n, n_v, d_v = v.shape
    n_k = q.shape[1]
    d_k = q.shape[2]
    for h in range(n_v):
        hk = h % n_k
        for t in range(n):
            e = decay[t, h]
            b = beta[t, h]
            for j in range(d_v):
                acc = np.float32(0.0)
                for i in range(d_k):
                    state[h, j, i] *= e
                    acc += state[h, j, i] * k[t, hk, i]
                delta = (v[t, h, j] - acc) * b
                acc = np.float32(0.0)
                for i in range(d_k):
                    state[h, j, i] += k[t, hk, i] * delta
                    acc += state[h, j, i] * q[t, hk, i]
                out[t, h, j] = acc * scale
