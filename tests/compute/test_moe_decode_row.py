"""The one-token (decode) shortcuts of plan_moe and combine_moe give exactly the general path's plan
and bits."""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute.moe import ExpertOutputs, ResidentLayer, combine_moe, plan_moe
from aioexperts._format.hparams import MoEHParams

N_EMBD, N_EXPERT, K = 64, 32, 8


def _hp() -> MoEHParams:
    return MoEHParams(arch="test", n_layer=1, n_embd=N_EMBD, n_expert=N_EXPERT, n_expert_used=K, n_ff_exp=16)


def _general_positions(ids: np.ndarray) -> dict[int, list[int]]:
    """The grouping of the general path: experts ascending, each its flat positions ascending."""
    flat = ids.reshape(-1)
    out: dict[int, list[int]] = {}
    for pos in np.argsort(flat, kind="stable").tolist():
        if flat[pos] >= 0:
            out.setdefault(int(flat[pos]), []).append(pos)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_decode_rows_plan_is_the_general_grouping(seed: int) -> None:
    rng = np.random.default_rng(seed)
    resident = ResidentLayer(0, router=rng.standard_normal((N_EXPERT, N_EMBD), dtype=np.float32))
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32)
    ids = rng.choice(N_EXPERT, size=(1, K), replace=False).astype(np.int32)
    if seed % 4 == 1:
        ids[0, 3] = -1  # an inactive slot: the general path
    if seed % 4 == 2:
        ids[0, 5] = ids[0, 1]  # a repeated id (a custom route step): the general path
    weights = rng.random((1, K), dtype=np.float32)
    plan = plan_moe(x, ids, weights, resident, _hp())
    got = {e: p.tolist() for e, p in plan.positions.items()}
    want = _general_positions(ids)
    assert list(got) == list(want)  # the same order: experts ascending
    assert got == want
    assert all(p.dtype == np.intp for p in plan.positions.values())


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("split", [False, True])
def test_a_decode_rows_sum_is_bit_for_bit_the_general_sum(seed: int, split: bool) -> None:
    """combine_moe of one token (every slot active) against its general path (``expert_out=True``
    takes it), the outputs in one part or two (hits first); values of very different sizes, so a
    different order of the sums would show."""
    rng = np.random.default_rng(seed)
    resident = ResidentLayer(0, router=rng.standard_normal((N_EXPERT, N_EMBD), dtype=np.float32))
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32)
    ids = rng.choice(N_EXPERT, size=(1, K), replace=False).astype(np.int32)
    weights = rng.random((1, K), dtype=np.float32)
    plan = plan_moe(x, ids, weights, resident, _hp())
    rows = {
        e: (rng.standard_normal((1, N_EMBD), dtype=np.float32) * np.float32(10.0 ** rng.integers(-4, 5)))
        for e in plan.positions
    }
    experts = list(rows)
    if split:
        parts = [ExpertOutputs({e: rows[e] for e in experts[:3]}), ExpertOutputs({e: rows[e] for e in experts[3:]})]
    else:
        parts = [ExpertOutputs(rows)]
    fast = combine_moe(plan, parts)
    general = combine_moe(plan, parts, expert_out=True)
    np.testing.assert_array_equal(fast.moe_out.view(np.uint32), general.moe_out.view(np.uint32))
    np.testing.assert_array_equal(fast.ffn_out.view(np.uint32), general.ffn_out.view(np.uint32))
    assert fast.moe_out.shape == (1, N_EMBD) and fast.moe_out.dtype == np.float32
    assert fast.shared_out is None and fast.expert_out is None
    with pytest.raises(Exception, match="no output for selected expert"):
        combine_moe(plan, ExpertOutputs({e: rows[e] for e in experts[1:]}))


@pytest.mark.parametrize("seed", range(12))
def test_a_routed_rows_plan_is_plan_moes(seed: int) -> None:
    from aioexperts._compute.moe import plan_routed_row, route

    rng = np.random.default_rng(100 + seed)
    resident = ResidentLayer(0, router=rng.standard_normal((N_EXPERT, N_EMBD), dtype=np.float32))
    x = rng.standard_normal((1, N_EMBD), dtype=np.float32)
    ids, weights = route(x, resident, _hp())
    got = plan_routed_row(x, ids, weights, resident, _hp())
    want = plan_moe(x, ids, weights, resident, _hp())
    assert got is not None
    assert got.ids.dtype == want.ids.dtype and np.array_equal(got.ids, want.ids)
    assert got.weights is weights or np.array_equal(got.weights, want.weights)
    assert list(got.positions) == list(want.positions)  # experts ascending
    assert all(np.array_equal(got.positions[e], want.positions[e]) for e in want.positions)
    repeated = ids.copy()
    repeated[0, 2] = repeated[0, 0]
    assert plan_routed_row(x, repeated, weights, resident, _hp()) is None  # not distinct: plan_moe serves
    inactive = ids.copy()
    inactive[0, 4] = -1
    assert plan_routed_row(x, inactive, weights, resident, _hp()) is None
