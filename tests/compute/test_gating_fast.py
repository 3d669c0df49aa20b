"""select_experts' compiled softmax path: bit for bit the numpy steps, ties, inf and NaN included."""

from __future__ import annotations

import numpy as np
import pytest

from aioexperts._compute import fused, gating
from aioexperts._compute.gating import select_experts
from aioexperts._format.hparams import GatingFunc, MoEHParams

pytestmark = pytest.mark.skipif(fused.backend().name != "numba", reason="the compiled path needs numba")


def _hp(n_expert: int, k: int, **kw: object) -> MoEHParams:
    return MoEHParams(arch="t", n_layer=1, n_embd=4, n_expert=n_expert, n_expert_used=k, n_ff_exp=4, **kw)  # type: ignore[arg-type]


def _general(logits: np.ndarray, hp: MoEHParams, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    with monkeypatch.context() as m:
        m.setattr(gating, "_kernels", lambda: None)
        with np.errstate(all="ignore"):
            return select_experts(logits, hp)


def _logit_cases(rng: np.random.Generator, n_expert: int) -> list[np.ndarray]:
    """Rows of router logits: plain, wide, near-ties, exact ties, inf, NaN, huge."""
    cases = []
    for n_tokens in (1, 3):
        cases.extend(
            (rng.standard_normal((n_tokens, n_expert)) * spread).astype(np.float32)
            for spread in (0.5, 3.0, 30.0, 300.0)
        )
        base = rng.standard_normal((n_tokens, n_expert)).astype(np.float32)
        cases.append(np.where(rng.random(base.shape) < 0.5, np.nextafter(base, np.float32(np.inf)), base))
        cases.append(rng.integers(0, 3, (n_tokens, n_expert)).astype(np.float32))  # exact ties
        cases.append(np.zeros((n_tokens, n_expert), dtype=np.float32))
        near = np.full((n_tokens, n_expert), 1.0, dtype=np.float32)
        near[:, ::3] = np.nextafter(np.float32(1.0), np.float32(2.0))
        cases.append(near)
        with_inf = (rng.standard_normal((n_tokens, n_expert)) * 10).astype(np.float32)
        with_inf[:, rng.integers(0, n_expert, 3)] = -np.inf
        cases.append(with_inf)
        cases.append(np.full((n_tokens, n_expert), -np.inf, dtype=np.float32))
        plus = with_inf.copy()
        plus[:, 0] = np.inf
        cases.append(plus)
        nan = with_inf.copy()
        nan[:, n_expert // 2] = np.nan
        cases.append(nan)
        huge = (rng.uniform(-1.0, 1.0, (n_tokens, n_expert)) * 3.4e38).astype(np.float32)
        cases.append(huge)
        signed = np.zeros((n_tokens, n_expert), dtype=np.float32)
        signed[:, ::2] = -0.0
        cases.append(signed)
    return cases


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@pytest.mark.parametrize("n_expert", [8, 9, 60, 128, 129, 256, 300, 1000, 1024])
@pytest.mark.parametrize("k", [1, 2, 7, 8])
def test_fast_path_is_the_numpy_path_bit_for_bit(n_expert: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1000 * n_expert + k)
    assert gating._kernels() is not None  # the compiled path serves here
    for norm, scale in ((True, 0.0), (False, 0.0), (True, 2.5), (False, 1.0)):
        hp = _hp(n_expert, k, gating_func=GatingFunc.SOFTMAX, weights_norm=norm, weights_scale=scale)
        for logits in _logit_cases(rng, n_expert):
            ids, weights = select_experts(logits, hp)
            ref_ids, ref_weights = _general(logits, hp, monkeypatch)
            assert ids.dtype == np.int32 and np.array_equal(ids, ref_ids), (logits, ids, ref_ids)
            assert _same(weights, ref_weights), (logits, weights, ref_weights)


def test_fast_path_many_random_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B's router (128 experts, top-8, normalised): 2000 rows whose exp values span
    many binades, so any other summation order shows in the bits of some weights."""
    rng = np.random.default_rng(7)
    hp = _hp(128, 8, gating_func=GatingFunc.SOFTMAX, weights_norm=True)
    logits = (rng.standard_normal((2000, 128)) * rng.choice([1.0, 8.0, 40.0], (2000, 1))).astype(np.float32)
    ids, weights = select_experts(logits, hp)
    ref_ids, ref_weights = _general(logits, hp, monkeypatch)
    assert np.array_equal(ids, ref_ids)
    assert _same(weights, ref_weights)
    one = [select_experts(logits[i : i + 1], hp) for i in range(0, 2000, 97)]
    assert all(np.array_equal(o[0][0], ids[i]) for o, i in zip(one, range(0, 2000, 97), strict=True))


def test_fast_path_not_taken_for_bias_groups_or_other_gating() -> None:
    """Only the plain softmax router is compiled; the others keep the numpy steps."""
    calls = []
    real = gating._softmax_top_k

    def spy(*args: object) -> tuple[np.ndarray, np.ndarray]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    mp = pytest.MonkeyPatch()
    mp.setattr(gating, "_softmax_top_k", spy)
    try:
        logits = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
        select_experts(logits, _hp(8, 2, gating_func=GatingFunc.SOFTMAX))
        assert calls == [1]
        select_experts(logits, _hp(8, 2, gating_func=GatingFunc.SIGMOID))
        select_experts(logits, _hp(8, 2, gating_func=GatingFunc.SOFTMAX), np.zeros(8, dtype=np.float32))
        select_experts(logits, _hp(8, 2, gating_func=GatingFunc.SOFTMAX, n_expert_groups=2, n_group_used=1))
        assert calls == [1]
    finally:
        mp.undo()
