"""The gated delta net's maths (aioexperts._compute.delta_net) against a float64 transcription of the
fixtures README / llama.cpp (qwen35moe.cpp ``build_layer_attn_linear``, ops.cpp ``gated_delta_net``)."""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute import delta_net, fused


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, s0: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per value head ``h`` (q/k head ``h mod n_k``), per token: ``S <- exp(g) S``,
    ``delta = beta (v - S^T k)``, ``S <- S + k delta^T``, ``o = S^T q / sqrt(d)``; ``S`` is ``(d_k, d_v)``."""
    n, n_v, d_v = v.shape
    n_k = q.shape[1]
    s = s0.astype(np.float64).transpose(0, 2, 1).copy()  # the kernel's state is S^T
    out = np.zeros((n, n_v, d_v))
    for h in range(n_v):
        for t in range(n):
            kk, qq = k[t, h % n_k].astype(np.float64), q[t, h % n_k].astype(np.float64)
            s[h] *= np.exp(np.float64(g[t, h]))
            delta = beta[t, h] * (v[t, h] - s[h].T @ kk)
            s[h] += np.outer(kk, delta)
            out[t, h] = s[h].T @ qq / np.sqrt(d_v)
    return out, s.transpose(0, 2, 1)


def _inputs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    q = delta_net.l2_norm(rng.standard_normal((n, 2, 16), dtype=np.float32), 1e-6)
    k = delta_net.l2_norm(rng.standard_normal((n, 2, 16), dtype=np.float32), 1e-6)
    v = rng.standard_normal((n, 4, 16), dtype=np.float32)
    g = (-rng.uniform(0.01, 1.0, (n, 4))).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (n, 4)).astype(np.float32)
    return q, k, v, g, beta


def test_the_delta_rule_is_the_float64_transcription_with_tiled_heads() -> None:
    rng = np.random.default_rng(0)
    q, k, v, g, beta = _inputs(rng, 12)
    s0 = rng.standard_normal((4, 16, 16), dtype=np.float32) * np.float32(0.1)
    state = s0.copy()
    got = delta_net.delta_rule(q, k, v, g, beta, state)
    want, want_state = reference(q, k, v, g, beta, s0)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(state - want_state).max() <= 1e-5 * np.abs(want_state).max()


def test_a_prefill_split_in_two_carries_the_state() -> None:
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _inputs(rng, 10)
    whole = np.zeros((4, 16, 16), dtype=np.float32)
    split = np.zeros((4, 16, 16), dtype=np.float32)
    one = delta_net.delta_rule(q, k, v, g, beta, whole)
    two = np.concatenate(
        [delta_net.delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], split) for a, b in ((0, 3), (3, 10))]
    )
    assert one.tobytes() == two.tobytes() and whole.tobytes() == split.tobytes()


def test_the_causal_conv_sees_the_kept_inputs_and_zeros_before_the_sequence() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 5), dtype=np.float32)
    w = rng.standard_normal((5, 4), dtype=np.float32)
    padded = np.concatenate([np.zeros((3, 5)), x.astype(np.float64)])
    want = np.stack([(padded[t : t + 4].T * w).sum(axis=1) for t in range(7)])
    state = np.zeros((3, 5), dtype=np.float32)
    got = np.concatenate([delta_net.causal_conv(x[a:b], state, w) for a, b in ((0, 2), (2, 3), (3, 7))])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert state.tobytes() == x[-3:].tobytes()


def test_l2_norm_softplus_and_silu_are_ggml_s() -> None:
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    assert np.allclose(delta_net.l2_norm(x, 1e-6), [[0.6, 0.8], [0.0, 0.0]], atol=1e-6)
    y = np.array([-30.0, -1.0, 0.0, 2.0, 20.5], dtype=np.float32)
    assert np.allclose(delta_net.softplus(y), np.where(y > 20, y, np.log1p(np.exp(y.astype(np.float64)))), rtol=1e-6)
    assert np.allclose(delta_net.silu(y), y / (1 + np.exp(-y.astype(np.float64))), rtol=1e-6)


def test_the_compiled_kernel_and_the_numpy_loop_agree() -> None:
    if not delta_net.warmup():
        pytest.skip(f"the numba backend does not serve: {fused.backend().reason}")
    rng = np.random.default_rng(3)
    q, k, v, g, beta = _inputs(rng, 9)
    compiled_state = np.zeros((4, 16, 16), dtype=np.float32)
    compiled = delta_net.delta_rule(q, k, v, g, beta, compiled_state)
    fused.set_backend("numpy")
    try:
        numpy_state = np.zeros((4, 16, 16), dtype=np.float32)
        plain = delta_net.delta_rule(q, k, v, g, beta, numpy_state)
    finally:
        fused.set_backend(None)
    assert np.abs(compiled - plain).max() <= 1e-5 * np.abs(plain).max()
    assert np.abs(compiled_state - numpy_state).max() <= 1e-5 * np.abs(numpy_state).max()
