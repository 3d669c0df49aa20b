"""Top-k ties: equal selection scores go to the lower expert id (docs/executor.md, section 2).

llama.cpp's CPU ``ggml_argsort`` is a ``std::sort``: stable for rows of at most 16 (an insertion
sort), implementation-defined beyond (an introsort). The rule here is the stable order everywhere; the
expected ids below are written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute.gating import select_experts
from aioexperts._format.hparams import GatingFunc, MoEHParams


def _hp(n_expert: int, k: int, **kw: object) -> MoEHParams:
    return MoEHParams(arch="t", n_layer=1, n_embd=4, n_expert=n_expert, n_expert_used=k, n_ff_exp=4, **kw)


@pytest.mark.parametrize(("n_expert", "k"), [(8, 2), (128, 8), (256, 8)])
def test_all_zero_logits_pick_the_lowest_ids(n_expert: int, k: int) -> None:
    """The example of the docs: an all-zero input, so every router logit is 0."""
    logits = np.zeros((3, n_expert), dtype=np.float32)
    ids, weights = select_experts(logits, _hp(n_expert, k, weights_norm=True))
    assert ids.tolist() == [list(range(k))] * 3
    np.testing.assert_allclose(weights, np.full((3, k), 1.0 / k, dtype=np.float32), rtol=1e-6)


def test_partial_ties_keep_score_order_then_id_order() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 1.0, 2.0, 2.0, -1.0]], dtype=np.float32)
    ids, _ = select_experts(logits, _hp(5, 3, gating_func=GatingFunc.SOFTMAX))
    assert ids.tolist() == [[1, 2, 4], [0, 2, 3]]


def test_ties_after_the_selection_bias() -> None:
    # sigmoid(0) = 0.5 everywhere; the bias ties experts 5 and 2, then 0, 1, 3, 4, 6, 7 tie at 0.5
    bias = np.array([0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0], dtype=np.float32)
    ids, weights = select_experts(np.zeros((1, 8), np.float32), _hp(8, 3, gating_func=GatingFunc.SIGMOID), bias)
    assert ids.tolist() == [[2, 5, 0]]
    np.testing.assert_allclose(weights, [[0.5, 0.5, 0.5]])  # weights come from the unbiased sigmoid


def test_tied_groups_keep_the_lower_group() -> None:
    # 4 groups of 4; groups 1 and 3 tie for the best group score, groups 0 and 2 tie below them
    scores = np.array([[0, 0, 0, 0, 5, 5, 0, 0, 0, 0, 0, 0, 5, 5, 0, 0]], dtype=np.float32)
    hp = _hp(16, 2, gating_func=GatingFunc.SOFTMAX_WEIGHT, n_expert_groups=4, n_group_used=1)
    ids, _ = select_experts(scores, hp)
    assert ids.tolist() == [[4, 5]]  # group 1 wins the tie with group 3
