"""select_experts: llama.cpp build_moe_ffn routing semantics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioexperts._compute.gating import WEIGHTS_SUM_MIN, select_experts, sigmoid, softmax
from aioexperts._errors import ConfigError, InvalidRequestError
from aioexperts._format.hparams import GatingFunc, MoEHParams


def _hp(n_expert=8, k=2, **kw) -> MoEHParams:
    return MoEHParams(arch="t", n_layer=1, n_embd=4, n_expert=n_expert, n_expert_used=k, n_ff_exp=4, **kw)


def _logit(p) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    return np.log(p / (1 - p)).astype(np.float32)


def test_worked_example_groups_bias_norm_scale() -> None:
    """The issue's check: 8 experts in 4 groups, 2 groups used, top-2, sigmoid, bias -1, norm, x2.5."""
    hp = _hp(
        gating_func=GatingFunc.SIGMOID,
        n_expert_groups=4,
        n_group_used=2,
        weights_norm=True,
        weights_scale=2.5,
    )
    scores = [0.9, 0.8, 0.7, 0.6, 0.2, 0.1, 0.3, 0.2]
    logits = _logit(scores)[None, :]
    bias = np.full(8, -1.0, dtype=np.float32)
    ids, weights = select_experts(logits, hp, bias)
    assert ids.dtype == np.int32
    assert weights.dtype == np.float32
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(weights, [[1.3235, 1.1765]], atol=1e-4)
    np.testing.assert_allclose(weights, [[0.9 / 1.7 * 2.5, 0.8 / 1.7 * 2.5]], rtol=1e-5)


def _zero_masked_reference(probs, bias, n_groups, n_used, k):
    """The wrong variant: masked groups set to 0 instead of -inf."""
    sel = (probs + bias).reshape(n_groups, -1)
    scores = np.sort(sel, axis=1)[:, -2:].sum(axis=1)
    keep = np.argsort(-scores, kind="stable")[:n_used]
    masked = np.zeros_like(sel)
    masked[keep] = sel[keep]
    return np.argsort(-masked.reshape(-1), kind="stable")[:k]


def test_group_mask_is_minus_inf_not_zero() -> None:
    """Biased scores are negative; a 0 mask would let an expert of a dropped group win."""
    hp = _hp(n_expert=8, k=3, gating_func=GatingFunc.SIGMOID, n_expert_groups=4, n_group_used=2)
    probs = np.array([0.5, 0.4, 0.45, 0.35, 0.2, 0.1, 0.3, 0.25], dtype=np.float32)
    bias = np.array([-0.6, -0.6, -0.6, -0.6, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    # biased: [-.1,-.2,-.15,-.25, .2,.1,.3,.25]; groups (sum of top 2): -.3, -.4, .3, .55 -> keep 3, 2
    ids, weights = select_experts(_logit(probs)[None, :], hp, bias)
    assert ids.tolist() == [[6, 7, 4]]
    np.testing.assert_allclose(weights, [[0.3, 0.25, 0.2]], rtol=1e-5)

    # now make every biased score negative: the kept groups hold the "least negative" experts
    bias2 = np.full(8, -1.0, dtype=np.float32)
    ids2, _ = select_experts(_logit(probs)[None, :], hp, bias2)
    # groups (sum of top 2): (.5,.4) -1.1, (.45,.35) -1.2, (.2,.1) -1.7, (.3,.25) -1.45 -> keep 0, 1
    assert ids2.tolist() == [[0, 2, 1]]
    wrong = _zero_masked_reference(probs, bias2, 4, 2, 3)
    assert wrong.tolist() != ids2[0].tolist()
    assert set(wrong.tolist()) & {4, 5, 6, 7}  # a masked expert would have been chosen


def test_softmax_gating() -> None:
    hp = _hp(k=3)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 8), dtype=np.float32)
    ids, weights = select_experts(logits, hp)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, np.argsort(-probs, axis=1, kind="stable")[:, :3])
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids, 1), rtol=1e-6)
    np.testing.assert_allclose(softmax(logits).sum(1), 1.0, rtol=1e-6)


def test_softmax_gating_normalised() -> None:
    hp = _hp(k=2, weights_norm=True)
    logits = np.array([[2.0, 1.0, 0.0, -1.0, 3.0, -2.0, 0.5, 0.25]], dtype=np.float32)
    ids, weights = select_experts(logits, hp)
    assert ids.tolist() == [[4, 0]]
    top = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(weights, [[top, 1 - top]], rtol=1e-6)


def test_sigmoid_gating() -> None:
    hp = _hp(k=2, gating_func=GatingFunc.SIGMOID)
    logits = np.array([[0.0, 3.0, -1.0, 2.0, -50.0, 60.0, 1.0, -3.0]], dtype=np.float32)
    ids, weights = select_experts(logits, hp)
    assert ids.tolist() == [[5, 1]]
    np.testing.assert_allclose(weights, [[1.0, 1 / (1 + np.exp(-3.0))]], rtol=1e-6)
    s = sigmoid(np.array([-1000.0, 1000.0], dtype=np.float32))  # no overflow warning (warnings = errors)
    np.testing.assert_array_equal(s, [0.0, 1.0])


def test_softmax_over_selected_logits() -> None:
    """gpt-oss (gating 3): pick on the raw logits, then softmax over the k picked."""
    hp = _hp(k=3, gating_func=GatingFunc.SOFTMAX_WEIGHT)
    logits = np.array([[0.5, 4.0, -2.0, 3.0, 1.0, 3.5, 0.0, -1.0]], dtype=np.float32)
    ids, weights = select_experts(logits, hp)
    assert ids.tolist() == [[1, 5, 3]]
    chosen = np.array([4.0, 3.5, 3.0])
    expected = np.exp(chosen - 4.0) / np.exp(chosen - 4.0).sum()
    np.testing.assert_allclose(weights, [expected], rtol=1e-6)
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-6)


def test_selection_bias_steers_choice_not_weights() -> None:
    hp = _hp(k=2, gating_func=GatingFunc.SIGMOID)
    probs = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], dtype=np.float32)
    bias = np.zeros(8, dtype=np.float32)
    bias[6] = 1.0
    bias[7] = 0.75
    ids, weights = select_experts(_logit(probs)[None, :], hp, bias)
    assert ids.tolist() == [[6, 7]]  # 1.3 and 0.95 (biased) beat 0.9
    np.testing.assert_allclose(weights, [[0.3, 0.2]], rtol=1e-5)  # unbiased probabilities


def test_normalisation_clamp() -> None:
    """The weight sum is clamped below at 6.103515625e-5 before dividing."""
    hp = _hp(k=2, gating_func=GatingFunc.SIGMOID, weights_norm=True)
    logits = np.full((1, 8), -15.0, dtype=np.float32)
    logits[0, 3] = -14.0
    ids, weights = select_experts(logits, hp)
    p = 1 / (1 + np.exp(np.array([14.0, 15.0])))
    assert p.sum() < WEIGHTS_SUM_MIN
    assert ids.tolist() == [[3, 0]]
    np.testing.assert_allclose(weights, [p / float(WEIGHTS_SUM_MIN)], rtol=1e-5)
    assert weights.sum() < 0.1  # not normalised to one
    # above the clamp it is a plain normalisation
    ids, weights = select_experts(np.zeros((1, 8), np.float32), hp)
    np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=1e-6)


def test_scale() -> None:
    logits = np.random.default_rng(1).standard_normal((4, 8), dtype=np.float32)
    ids1, w1 = select_experts(logits, _hp(k=2, weights_norm=True))
    ids2, w2 = select_experts(logits, _hp(k=2, weights_norm=True, weights_scale=2.5))
    ids3, w3 = select_experts(logits, _hp(k=2, weights_norm=True, weights_scale=0.0))
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_allclose(w2, 2.5 * w1, rtol=1e-6)
    np.testing.assert_array_equal(w3, w1)  # 0 means "no scaling", as in llama.cpp


def test_order_descending_ties_to_lower_index() -> None:
    hp = _hp(k=4, gating_func=GatingFunc.SOFTMAX_WEIGHT)
    logits = np.array([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0, -1.0, 3.0]], dtype=np.float32)
    ids, _ = select_experts(logits, hp)
    assert ids.tolist() == [[7, 1, 2, 4]]


def test_pruned_layer_uses_logit_width() -> None:
    """A mixed-tier pruned layer has fewer router outputs than expert_count."""
    hp = _hp(n_expert=8, k=2)
    logits = np.array([[0.0, 1.0, 5.0, 2.0, -1.0]], dtype=np.float32)
    ids, weights = select_experts(logits, hp)
    assert ids.tolist() == [[2, 3]]
    np.testing.assert_allclose(weights, np.take_along_axis(softmax(logits), ids, 1), rtol=1e-6)


def test_errors() -> None:
    hp = _hp(k=2)
    with pytest.raises(InvalidRequestError, match="float32"):
        select_experts(np.zeros((1, 8)), hp)
    with pytest.raises(InvalidRequestError, match="2-D"):
        select_experts(np.zeros(8, np.float32), hp)
    with pytest.raises(ConfigError, match="top-3 experts from a router with 2 outputs"):
        select_experts(np.zeros((1, 2), np.float32), _hp(k=3))
    with pytest.raises(InvalidRequestError, match=r"selection_bias must be a float32 array of shape \(8,\)"):
        select_experts(np.zeros((1, 8), np.float32), hp, np.zeros(7, np.float32))
    grouped = _hp(k=2, n_expert_groups=4, n_group_used=2)
    with pytest.raises(ConfigError, match="4 expert groups do not divide a router with 6 outputs"):
        select_experts(np.zeros((1, 6), np.float32), grouped)


def _reference(logits, hp, bias):
    """Per-token float32 reference written from the llama.cpp description, one step at a time."""
    f32 = np.float32
    ids_out, w_out = [], []
    for row in logits:
        if hp.gating_func == GatingFunc.SOFTMAX:
            e = np.exp(row - row.max())
            probs = (e * f32(1.0 / e.sum(dtype=np.float64))).astype(f32)
        elif hp.gating_func == GatingFunc.SIGMOID:
            probs = (f32(1) / (f32(1) + np.exp(-row))).astype(f32)
        elif hp.gating_func == GatingFunc.SQRT_SOFTPLUS:  # ggml op_softplus, then ggml_sqrt
            probs = np.sqrt(np.array([v if v > 20 else np.log(f32(1) + np.exp(v)) for v in row], dtype=f32))
        else:
            probs = row
        sel = probs + bias if bias is not None else probs.copy()
        n = len(sel)
        if hp.n_expert_groups > 1:
            per = n // hp.n_expert_groups
            scores = []
            for g in range(hp.n_expert_groups):
                top = sorted(sel[g * per : (g + 1) * per].tolist(), reverse=True)[:2]
                scores.append(f32(top[0]) + f32(top[1]))
            kept = sorted(range(hp.n_expert_groups), key=lambda g: (-scores[g], g))[: hp.n_group_used]
            sel = np.array([sel[i] if i // per in kept else -np.inf for i in range(n)], dtype=f32)
        chosen = sorted(range(n), key=lambda i: (-sel[i], i))[: hp.n_expert_used]
        w = probs[chosen].astype(f32)
        if hp.gating_func == GatingFunc.SOFTMAX_WEIGHT:
            e = np.exp(w - w.max())
            w = (e * f32(1.0 / e.sum(dtype=np.float64))).astype(f32)
        if hp.weights_norm:
            w = w / max(w.sum(dtype=f32), WEIGHTS_SUM_MIN)
        if hp.weights_scale not in (0.0, 1.0):
            w = w * f32(hp.weights_scale)
        ids_out.append(chosen)
        w_out.append(w)
    return np.array(ids_out), np.array(w_out, dtype=f32)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    gating=st.sampled_from(list(GatingFunc)),
    groups=st.sampled_from([(0, 0), (2, 1), (4, 2), (4, 3), (8, 4)]),
    norm=st.booleans(),
    scale=st.sampled_from([0.0, 1.0, 2.5]),
    with_bias=st.booleans(),
)
def test_matches_reference(data, gating, groups, norm, scale, with_bias) -> None:
    n_expert = 16
    n_groups, n_used = groups
    max_k = n_expert if n_groups == 0 else n_used * (n_expert // n_groups)
    k = data.draw(st.integers(1, min(max_k, 6)))
    hp = _hp(
        n_expert=n_expert,
        k=k,
        gating_func=gating,
        n_expert_groups=n_groups,
        n_group_used=n_used,
        weights_norm=norm,
        weights_scale=scale,
    )
    n_tokens = data.draw(st.integers(1, 5))
    grid = st.integers(-24, 24).map(lambda v: v / 8)  # exact in float32; ties on purpose
    logits = np.array(
        data.draw(st.lists(st.lists(grid, min_size=n_expert, max_size=n_expert), min_size=n_tokens, max_size=n_tokens)),
        dtype=np.float32,
    )
    bias = None
    if with_bias:
        bias = np.array(data.draw(st.lists(grid, min_size=n_expert, max_size=n_expert)), np.float32)
    ids, weights = select_experts(logits, hp, bias)
    ref_ids, ref_w = _reference(logits, hp, bias)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=2e-6, atol=1e-7)
