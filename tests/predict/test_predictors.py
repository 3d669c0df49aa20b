"""Next-layer predictors and their scoring: hand-made sequences, a router property, llama.cpp fixtures."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioexperts._compute.moe import ResidentLayer, route
from aioexperts._errors import ConfigError, InvalidRequestError
from aioexperts._format.hparams import GatingFunc, MoEHParams
from aioexperts._predict.predictors import (
    DEFAULT_FREQUENCY_DECAY,
    PREDICTORS,
    FrequencyPredictor,
    NextRouterPredictor,
    NullPredictor,
    Predictor,
    PreviousTokenPredictor,
    make_predictor,
)
from aioexperts._predict.scoring import (
    PredictorScore,
    format_score_table,
    random_guess_recall,
    score_predictors,
    steps_from_arrays,
    steps_from_trace,
)
from aioexperts._predict.trace import RoutingTrace, skewed_random_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compute"))
import fixture_views as fv  # noqa: E402


def _hp(n_expert: int = 8, k: int = 2, n_embd: int = 4, **kw) -> MoEHParams:
    return MoEHParams(arch="t", n_layer=0, n_embd=n_embd, n_expert=n_expert, n_expert_used=k, n_ff_exp=4, **kw)


# --------------------------------------------------------------------------------------------------
# previous token


def test_previous_token_orders_by_votes_then_recency() -> None:
    p = PreviousTokenPredictor()
    p.observe(1, None, np.array([[2, 4], [4, 1], [4, -1]]))
    # 4 chosen by 3 tokens; 1 and 2 by one each: 1 belongs to the more recent token
    assert p.predict(0, 1, None, 8) == [4, 1, 2]
    assert p.predict(0, 1, None, 2) == [4, 1]
    assert p.predict(0, 1, None, 0) == []


def test_previous_token_single_token_keeps_router_order() -> None:
    p = PreviousTokenPredictor()
    p.observe(3, None, np.array([[7, 0, 5]], dtype=np.int32))
    assert p.predict(2, 3, None, 8) == [7, 0, 5]
    p.observe(3, None, np.array([6, 2], dtype=np.int16))  # a (k,) row is one token; last call wins
    assert p.predict(2, 3, None, 8) == [6, 2]


def test_previous_token_ignores_inactive_and_duplicates() -> None:
    p = PreviousTokenPredictor()
    p.observe(1, None, np.array([[6, 6], [5, -1]]))
    assert p.predict(0, 1, None, 4) == [5, 6]  # 6 twice in one token counts once
    p.observe(1, None, np.array([[-1, -1]]))
    assert p.predict(0, 1, None, 4) == []


def test_previous_token_without_history_is_empty_and_layers_are_separate() -> None:
    p = PreviousTokenPredictor()
    assert p.predict(0, 1, None, 4) == []
    p.observe(0, None, np.array([[1, 2]]))
    assert p.predict(0, 1, None, 4) == []  # only layer 0 was observed
    assert p.predict(5, 0, None, 4) == [1, 2]
    p.reset()
    assert p.predict(5, 0, None, 4) == []


# --------------------------------------------------------------------------------------------------
# frequency


def test_frequency_decays_per_token() -> None:
    p = FrequencyPredictor(decay=0.5)
    p.observe(1, None, np.array([[0, 1]]))
    p.observe(1, None, np.array([[1, 2]]))
    p.observe(1, None, np.array([[2, -1]]))
    np.testing.assert_array_equal(p.counts(1), [0.25, 0.75, 1.5])
    assert p.predict(0, 1, None, 8) == [2, 1, 0]
    assert p.predict(0, 1, None, 2) == [2, 1]
    assert p.predict(0, 1, None, 0) == []

    batch = FrequencyPredictor(decay=0.5)
    batch.observe(1, None, np.array([[0, 1], [1, 2], [2, -1]]))  # one call of 3 tokens, same counts
    np.testing.assert_array_equal(batch.counts(1), p.counts(1))
    assert batch.predict(0, 1, None, 8) == [2, 1, 0]


def test_frequency_plain_counts_ties_to_lower_id_and_duplicates_once() -> None:
    p = FrequencyPredictor(decay=1.0)
    p.observe(2, None, np.array([[5, 3], [3, 5], [1, 1], [-1, 1]]))
    np.testing.assert_array_equal(p.counts(2), [0, 2, 0, 2, 0, 2])
    assert p.predict(1, 2, None, 8) == [1, 3, 5]
    assert p.predict(1, 3, None, 8) == []  # never observed: no fallback
    p.reset()
    assert p.predict(1, 2, None, 8) == []


def test_frequency_recent_expert_overtakes_old_one() -> None:
    p = FrequencyPredictor(decay=0.5)
    p.observe(0, None, np.array([[4, -1]] * 3))  # 4: 0.25 + 0.5 + 1 = 1.75
    p.observe(0, None, np.array([[2, -1]] * 3))  # 4 decays to 0.21875, 2 gets 1.75
    assert p.predict(0, 0, None, 2) == [2, 4]


def test_frequency_default_decay_and_validation() -> None:
    assert FrequencyPredictor().decay == DEFAULT_FREQUENCY_DECAY == 0.99
    for bad in (0, 0.0, -0.1, 1.01, True, "0.5", math.nan):
        with pytest.raises(ConfigError):
            FrequencyPredictor(decay=bad)


# --------------------------------------------------------------------------------------------------
# common contract, registry


@pytest.mark.parametrize("cls", [PreviousTokenPredictor, FrequencyPredictor, NullPredictor])
def test_contract_errors(cls: type[Predictor]) -> None:
    p = cls()
    with pytest.raises(ConfigError):
        p.predict(0, 1, None, -1)
    with pytest.raises(InvalidRequestError):
        p.observe(1, None, np.array([[0, -2]]))
    with pytest.raises(InvalidRequestError):
        p.observe(1, None, np.array([[0.0, 1.0]]))
    with pytest.raises(InvalidRequestError):
        p.observe(1, None, np.zeros((1, 2, 2), dtype=np.int32))


def test_null_predictor_never_predicts() -> None:
    p = NullPredictor()
    p.observe(0, None, np.array([[1, 2]]))
    assert p.predict(0, 0, np.zeros((1, 4), np.float32), 8) == []


def test_make_predictor() -> None:
    assert set(PREDICTORS) == {"router", "previous", "frequency", "none"}
    assert isinstance(make_predictor("previous"), PreviousTokenPredictor)
    assert isinstance(make_predictor("none"), NullPredictor)
    freq = make_predictor("frequency", decay=0.9)
    assert isinstance(freq, FrequencyPredictor)
    assert freq.decay == 0.9
    hp = _hp()
    resident = ResidentLayer(layer=1, router=np.ones((8, 4), np.float32))
    router = make_predictor("router", residents={1: resident}, hparams=hp)
    assert isinstance(router, NextRouterPredictor)
    assert router.name == "router"
    with pytest.raises(ConfigError, match="known: frequency, none, previous, router"):
        make_predictor("lru")
    with pytest.raises(ConfigError, match="residents"):
        make_predictor("router", hparams=hp)
    with pytest.raises(ConfigError):
        make_predictor("previous", decay=0.5)
    with pytest.raises(ConfigError):
        make_predictor("frequency", decay=2.0)


# --------------------------------------------------------------------------------------------------
# next router


@st.composite
def _router_case(draw):
    gating = draw(st.sampled_from(list(GatingFunc)))
    n_expert = draw(st.sampled_from([4, 8, 16]))
    groups = draw(st.sampled_from([0, 2, 4]))
    n_group_used = draw(st.integers(1, groups)) if groups > 1 else 0
    max_k = n_expert if groups < 2 else n_group_used * (n_expert // groups)
    k = draw(st.integers(1, max_k))
    n_tokens = draw(st.integers(1, 6))
    with_bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return gating, n_expert, groups, n_group_used, k, n_tokens, with_bias, seed


@settings(max_examples=80, deadline=None)
@given(_router_case())
def test_router_predicts_what_route_chooses_on_same_x(case) -> None:
    gating, n_expert, groups, n_group_used, k, n_tokens, with_bias, seed = case
    n_embd = 16
    rng = np.random.default_rng(seed)
    hp = _hp(
        n_expert=n_expert,
        k=k,
        n_embd=n_embd,
        gating_func=gating,
        n_expert_groups=groups,
        n_group_used=n_group_used,
    )
    resident = ResidentLayer(
        layer=5,
        router=rng.standard_normal((n_expert, n_embd), dtype=np.float32),
        router_bias=rng.standard_normal(n_expert, dtype=np.float32) if rng.random() < 0.3 else None,
        selection_bias=rng.standard_normal(n_expert, dtype=np.float32) if with_bias else None,
    )
    x = rng.standard_normal((n_tokens, n_embd), dtype=np.float32)
    ids, weights = route(x, resident, hp)

    p = NextRouterPredictor({5: resident}, hp)
    full = p.predict(4, 5, x, n_expert)
    # with the weights (the miss tier's gate weight of a prefetch): each the largest the rows give it
    ranked, gate = p.predict_weighted(4, 5, x, n_expert)
    assert ranked == full and sorted(gate) == sorted(full)
    for e in full:
        assert gate[e] == float(weights[ids == e].max())
    assert sorted(full) == sorted(set(ids.reshape(-1).tolist()))
    votes = [int((ids == e).any(axis=1).sum()) for e in full]
    assert votes == sorted(votes, reverse=True)
    if n_tokens == 1:
        assert full == ids[0].tolist()  # llama.cpp's order
    for budget in range(len(full) + 1):
        assert p.predict(4, 5, x, budget) == full[:budget]


def test_router_honours_selection_bias() -> None:
    hp = _hp(n_expert=4, k=2, gating_func=GatingFunc.SIGMOID)
    router = np.eye(4, dtype=np.float32)
    x = np.array([[4.0, 3.0, 2.0, 1.0]], dtype=np.float32)  # probabilities rank 0 > 1 > 2 > 3
    plain = NextRouterPredictor({1: ResidentLayer(layer=1, router=router)}, hp)
    assert plain.predict(0, 1, x, 4) == [0, 1]
    bias = np.array([0.0, 0.0, 0.0, 0.5], dtype=np.float32)  # lifts expert 3 above 1 and 0
    biased_layer = ResidentLayer(layer=1, router=router, selection_bias=bias)
    biased = NextRouterPredictor({1: biased_layer}, hp)
    expected, _ = route(x, biased_layer, hp)
    assert expected[0].tolist() == [3, 0]
    assert biased.predict(0, 1, x, 4) == [3, 0]
    assert biased.predict(0, 1, x[0], 1) == [3]  # a (n_embd,) row is one token


def test_router_edge_cases() -> None:
    hp = _hp()
    resident = ResidentLayer(layer=1, router=np.ones((8, 4), np.float32))
    p = NextRouterPredictor({1: resident}, hp)
    x = np.ones((2, 4), np.float32)
    assert p.predict(1, 2, x, 4) == []  # no router for layer 2
    assert p.predict(0, 1, None, 4) == []
    assert p.predict(0, 1, x, 0) == []
    assert p.predict(0, 1, np.zeros((0, 4), np.float32), 4) == []
    with pytest.raises(InvalidRequestError):
        p.predict(0, 1, np.ones((2, 4), np.float64), 4)
    with pytest.raises(ConfigError):
        p.predict(0, 1, x, -1)
    with pytest.raises(ConfigError):
        NextRouterPredictor({1: resident}, _hp(n_embd=8))
    p.observe(0, x, np.array([[0, 1], [2, 3]]))  # stateless
    p.reset()


# --------------------------------------------------------------------------------------------------
# scoring arithmetic


def _hand_steps() -> list[dict]:
    def s(*rows):
        return {layer: (None, np.array(ids)) for layer, ids in zip((0, 1, 2), rows, strict=True)}

    return [s([0, 1], [2, 3], [4, 5]), s([0, 2], [2, 4], [5, 6]), s([1, -1], [3, -1], [5, -1])]


def test_scoring_arithmetic_on_hand_made_case() -> None:
    scores = score_predictors(
        [PreviousTokenPredictor(), NullPredictor()], [0, 1, 2], _hand_steps(), {1: 100, 2: 1000}, 2
    )
    assert list(scores) == ["previous", "none"]
    # previous: t0 nothing known; t1 [2,3] vs {2,4} and [4,5] vs {5,6}; t2 [2,4] vs {3}, [5,6] vs {5}
    assert scores["previous"] == PredictorScore(
        "previous",
        predictions=6,
        predicted=8,
        actual=10,
        hits=3,
        useful_bytes=100 + 1000 + 1000,
        wasted_bytes=100 + 1000 + 200 + 1000,
        missed_bytes=(200 + 2000) + 100 + 1000 + 100,
    )
    assert scores["previous"].precision == 3 / 8
    assert scores["previous"].recall == 3 / 10
    none = scores["none"]
    assert (none.predictions, none.predicted, none.hits, none.missed_bytes) == (6, 0, 0, 5500)
    assert math.isnan(none.precision)
    assert none.recall == 0.0
    table = format_score_table(scores)
    header = table.splitlines()[0].split()
    assert header[:6] == ["predictor", "predictions", "predicted", "hits", "precision", "recall"]
    assert "0.375" in table
    assert "0.300" in table
    assert " - " in table.splitlines()[3]


class _Fixed(Predictor):
    name = "fixed"

    def __init__(self, ids: list) -> None:
        self.ids = ids

    def observe(self, layer, x, ids) -> None:
        pass

    def predict(self, layer, next_layer, x, budget):
        return self.ids


def test_scoring_perfect_and_contract_checks() -> None:
    steps = [{0: (None, np.array([1, 2])), 1: (None, np.array([3, 0]))}]
    s = score_predictors([_Fixed([0, 3])], [0, 1], steps, 7, 2)["fixed"]
    assert (s.precision, s.recall, s.useful_bytes, s.wasted_bytes, s.missed_bytes) == (1.0, 1.0, 14, 0, 0)
    for bad in ([0, 3, 4], [3, 3], [-1], [1.0], (0,)):
        with pytest.raises(ConfigError, match="fixed"):
            score_predictors([_Fixed(bad)], [0, 1], steps, 7, 2)
    with pytest.raises(ConfigError, match="distinct"):
        score_predictors([NullPredictor(), NullPredictor()], [0, 1], steps, 7, 2)
    with pytest.raises(ConfigError, match="layer"):
        score_predictors([NullPredictor()], [0, 1], steps, {0: 7}, 2)
    with pytest.raises(ConfigError):
        score_predictors([NullPredictor()], [1, 0], steps, 7, 2)
    with pytest.raises(ConfigError):
        score_predictors([NullPredictor()], [0, 1], steps, 7, -1)
    with pytest.raises(ConfigError):
        score_predictors([NullPredictor()], [0, 1], [{0: (None, np.array([0.5, 1.0]))}], 7, 2)
    with pytest.raises(ConfigError):
        score_predictors([NullPredictor()], [0, 1], [{0: (np.zeros(4), np.array([0, 1]))}], 7, 2)


def test_steps_from_arrays_aligns_short_layers_to_the_end() -> None:
    ids = {0: np.array([[0, 1], [2, 3], [4, 5]]), 1: np.array([6, 7])}
    xs = {0: np.arange(6, dtype=np.float32).reshape(3, 2), 1: np.array([9.0, 9.0], np.float32)}
    steps = steps_from_arrays(ids, xs)
    assert [sorted(s) for s in steps] == [[0], [0], [0, 1]]
    np.testing.assert_array_equal(steps[2][1][1], [6, 7])
    np.testing.assert_array_equal(steps[1][0][0], [2.0, 3.0])
    scores = score_predictors([FrequencyPredictor()], [0, 1], steps, 1, 2)
    assert scores["frequency"].predictions == 1  # only the last token reached layer 1
    assert len(steps_from_arrays(ids, n_tokens=5)) == 5
    with pytest.raises(ConfigError):
        steps_from_arrays(ids, {2: xs[0]})
    with pytest.raises(ConfigError):
        steps_from_arrays(ids, {0: xs[0][:2]})
    with pytest.raises(ConfigError):
        steps_from_arrays(ids, n_tokens=2)


def test_steps_from_trace_and_locality_beats_random() -> None:
    trace = skewed_random_trace(400, [1, 2, 3], 16, 2, seed=3, zipf_exponent=1.0, locality=0.8)
    steps = list(steps_from_trace(trace, n_embd=8, seed=1))
    assert len(steps) == 400
    x, ids = steps[0][1]
    assert x.shape == (8,)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(ids, trace.ids[0, 0])
    hp = _hp(n_expert=16, k=2, n_embd=8)
    rng = np.random.default_rng(0)
    residents = {
        layer: ResidentLayer(layer=layer, router=rng.standard_normal((16, 8), dtype=np.float32)) for layer in (2, 3)
    }
    predictors = [NextRouterPredictor(residents, hp), PreviousTokenPredictor(), FrequencyPredictor()]
    scores = score_predictors(predictors, trace.layers, steps, 1000, 2)
    for s in scores.values():
        assert s.predictions == 400 * 2
        assert s.useful_bytes + s.missed_bytes == s.actual * 1000
        assert s.useful_bytes + s.wasted_bytes == s.predicted * 1000
    guess = random_guess_recall(2, 16)
    assert scores["previous"].recall > 2 * guess  # locality 0.8: most experts repeat
    assert scores["frequency"].recall > guess  # Zipf popularity
    # random x: the router predictor guesses (no assertion on its score beyond sanity)
    assert 0.0 <= scores["router"].recall <= 1.0

    # unrecorded rows (all -1) are left out; without n_embd x is None
    holes = RoutingTrace(np.array([[[0, 1], [-1, -1]], [[2, -1], [3, 1]]]), [0, 4], 4)
    steps = list(steps_from_trace(holes))
    assert [sorted(s) for s in steps] == [[0], [0, 4]]
    assert steps[1][4][0] is None
    with pytest.raises(ConfigError):
        list(steps_from_trace(holes, n_embd=0))


def test_random_guess_recall() -> None:
    assert random_guess_recall(2, 8) == 0.25
    assert random_guess_recall(20, 8) == 1.0
    assert random_guess_recall(0, 8) == 0.0
    with pytest.raises(ConfigError):
        random_guess_recall(2, 0)


# --------------------------------------------------------------------------------------------------
# llama.cpp fixtures: real hidden states


def _fixture_cases() -> list:
    cases = []
    for path in fv.fixture_paths():
        layers = sorted(int(k.split("-")[-1]) for k in fv.golden(path) if k.startswith("topk-"))
        if len(layers) >= 2:  # qwen3moe-mixed has layer 0 only
            cases.append(path)
    return cases


FIXTURES = _fixture_cases()


def _expert_bytes(path: Path, layer: int) -> int:
    total = 0
    for t in fv.reader(path).tensors:
        if t.name.startswith(f"blk.{layer}.ffn_") and "_exps" in t.name and t.name.endswith(".weight"):
            total += int(t.n_bytes) // int(t.shape[2])
    assert total > 0
    return total


def _score_fixture(path: Path) -> tuple[dict[str, PredictorScore], int, int]:
    gold = fv.golden(path)
    md = fv.metadata(path)
    hp = MoEHParams.from_metadata(str(md["general.architecture"]), md)
    layers = sorted(int(k.split("-")[-1]) for k in gold if k.startswith("topk-"))
    get = fv.tensor_getter(path)
    residents = {layer: ResidentLayer.from_tensors(layer, get, hp) for layer in layers[1:]}
    steps = steps_from_arrays(
        {layer: gold[f"topk-{layer}"] for layer in layers},
        {layer: gold[f"moe_in-{layer}"] for layer in layers},
    )
    budget = hp.n_expert_used
    predictors = [
        NextRouterPredictor(residents, hp),
        PreviousTokenPredictor(),
        FrequencyPredictor(),
        NullPredictor(),
    ]
    bytes_per_expert = {layer: _expert_bytes(path, layer) for layer in layers}
    return score_predictors(predictors, layers, steps, bytes_per_expert, budget), budget, hp.n_expert


@pytest.mark.skipif(not FIXTURES, reason="shared fixtures not found")
def test_router_predictor_beats_random_guess_on_llama_cpp_hidden_states() -> None:
    beats = []
    pooled: dict[str, list[int]] = {}
    random_hits = 0.0  # expected hits of a random guess, pooled like the scores
    for path in FIXTURES:
        scores, budget, n_expert = _score_fixture(path)
        guess = random_guess_recall(budget, n_expert)
        router = scores["router"]
        beats.append(router.recall > guess)
        random_hits += guess * router.actual
        print(f"\n{path.stem}: budget {budget} of {n_expert} experts, random-guess recall {guess:.3f}")
        print(format_score_table(scores))
        for s in scores.values():
            assert s.predictions == router.predictions
            acc = pooled.setdefault(s.name, [0] * 7)
            fields = (s.predictions, s.predicted, s.actual, s.hits)
            fields += (s.useful_bytes, s.wasted_bytes, s.missed_bytes)
            for i, v in enumerate(fields):
                acc[i] += v
    total = {name: PredictorScore(name, *acc) for name, acc in pooled.items()}
    random_recall = random_hits / total["router"].actual
    print(f"\nall {len(FIXTURES)} fixtures pooled (random-guess recall {random_recall:.3f}):")
    print(format_score_table(total))
    assert sum(beats) >= math.ceil(0.75 * len(beats)), beats
    assert total["router"].recall > random_recall
