"""A layer whose every expert is resident at full precision: the store says so, and the router
predicts nothing for it (no read could help), while it still predicts the layers that are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioexperts
from aioexperts.predictors import NextRouterPredictor
from aioexperts.testing import SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resident") / "m.gguf"
    write_synthetic_model(path, SPEC)
    return path


class _Counting(NextRouterPredictor):
    """The router's own predictor, recording which layers it was asked about."""

    def __init__(self, inner: Any) -> None:
        self.asked: list[int] = []
        self._inner = inner

    def observe(self, layer: int, x: Any, ids: Any) -> None:
        self._inner.observe(layer, x, ids)

    def predict(self, layer: int, next_layer: int, x: Any, budget: int) -> list[int]:
        self.asked.append(next_layer)
        return list(self._inner.predict(layer, next_layer, x, budget))


async def test_a_fully_resident_layer_is_not_predicted(model: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model, slots=2 * SPEC.n_expert) as store:
        first, second = store.layout.layers
        assert not store.layer_resident(first) and not store.layer_resident(second)
        async with store.experts(second, range(SPEC.n_expert)):
            pass  # every expert of the second layer read once: READY, unpinned, never evicted
        assert store.layer_resident(second) and not store.layer_resident(first)
        runner = aioexperts.MoERunner(store)
        await runner.warmup()
        predictor = _Counting(runner.predictor)
        x = np.random.default_rng(0).standard_normal((1, SPEC.n_embd)).astype(np.float32)
        await runner.run_moe_layers(x, predictor=predictor)
        assert second not in predictor.asked  # resident: nothing to prefetch, no prediction
        assert first in predictor.asked  # the next token's first layer is not resident: predicted
        with pytest.raises(aioexperts.InvalidRequestError):
            store.layer_resident(SPEC.n_layer + 5)


async def test_the_model_is_resident_once_every_layer_is_and_no_longer_after_an_eviction(
    model: Path, anyio_backend: object
) -> None:
    """``model_resident`` is every ``layer_resident`` in one call: False while a layer has an expert
    left to read, True once all are READY, False again when an eviction takes one out; the cache's
    total of full-precision READY experts follows every load and eviction."""
    async with aioexperts.open(model, slots=2 * SPEC.n_expert) as store:
        first, second = store.layout.layers
        cache = store._source.cache  # type: ignore[attr-defined]
        assert not store.model_resident()
        async with store.experts(second, range(SPEC.n_expert)):
            pass
        assert store.layer_resident(second) and not store.model_resident()
        async with store.experts(first, range(SPEC.n_expert - 1)):
            pass
        assert not store.model_resident()  # one expert of the first layer not read yet
        async with store.experts(first, [SPEC.n_expert - 1]):
            pass
        assert store.model_resident() and all(store.layer_resident(layer) for layer in (first, second))
        assert cache.full_ready_total() == sum(cache.full_ready(layer) for layer in (first, second))
        runner = aioexperts.MoERunner(store)
        await runner.warmup()
        predictor = _Counting(runner.predictor)
        x = np.random.default_rng(2).standard_normal((1, SPEC.n_embd)).astype(np.float32)
        await runner.run_moe_layers(x, predictor=predictor)
        assert predictor.asked == []  # every layer resident: nothing predicted
    async with aioexperts.open(model, slots=SPEC.n_expert + 1) as store:  # room for one layer and one more
        first, second = store.layout.layers
        cache = store._source.cache  # type: ignore[attr-defined]
        async with store.experts(first, range(SPEC.n_expert)):
            pass
        async with store.experts(second, [0, 1]):  # evicts one of the first layer's
            pass
        assert not store.layer_resident(first) and not store.model_resident()
        total = sum(cache.full_ready(layer) for layer in (first, second))
        assert cache.full_ready_total() == total == SPEC.n_expert + 1
    assert not store.model_resident()  # closed


async def test_the_first_layer_of_a_step_is_not_predicted_once_resident(model: Path, anyio_backend: object) -> None:
    """predict_first (a decode step's first MoE layer, from the embeddings) asks nothing about a
    resident layer, and still asks about one that is not."""
    async with aioexperts.open(model, slots=2 * SPEC.n_expert) as store:
        first, _ = store.layout.layers
        runner = aioexperts.MoERunner(store)
        await runner.warmup()
        x = np.random.default_rng(1).standard_normal((1, SPEC.n_embd)).astype(np.float32)
        assert runner.router.predict_first(first, x)  # not resident: predicted
        async with store.experts(first, range(SPEC.n_expert)):
            pass
        assert store.layer_resident(first)
        assert runner.router.predict_first(first, x) == []


async def test_resident_answers_per_id_with_duplicates_inactive_ids_and_numpy_ints(
    model: Path, anyio_backend: object
) -> None:
    """``resident`` answers one flag per id, in order: duplicates alike, ``-1`` False, numpy ints as
    ints, a loading expert False; a bad id or layer raises, as ``experts`` does."""
    async with aioexperts.open(model, slots=2 * SPEC.n_expert) as store:
        first, second = store.layout.layers
        async with store.experts(first, [1, 3]):
            pass
        assert store.resident(first, [3, 0, 1, -1, 3, np.int64(1), np.int32(2)]) == [
            True,
            False,
            True,
            False,
            True,
            True,
            False,
        ]
        assert store.resident(first, []) == []
        assert store.resident(second, [1, 3]) == [False, False]  # another layer's keys
        assert store.start_loads(second, [4, 4, -1, 5]) == 2  # loading: not resident yet
        assert store.resident(second, [4, 5]) == [False, False]
        async with store.experts(second, [4, 5]):
            pass
        assert store.resident(second, [5, 4, -1]) == [True, True, False]
        with pytest.raises(aioexperts.InvalidRequestError, match="expert 99 does not exist"):
            store.resident(first, [1, 99])
        with pytest.raises(aioexperts.InvalidRequestError, match="ints"):
            store.resident(first, [1, 2.0])  # type: ignore[list-item]
        with pytest.raises(aioexperts.InvalidRequestError, match="ints"):
            store.resident(first, [True])
        with pytest.raises(aioexperts.InvalidRequestError):
            store.resident(SPEC.n_layer + 5, [0])


async def test_the_router_skips_a_stateless_predictors_observe_only(
    model: Path, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in router predictor's observe only checks its ids: the router does not call it. An
    observe brought by a subclass, a mixin, a later assignment or the instance is called once per
    routed layer; a class that sets ``stateless`` again for its own observe is skipped."""
    from aioexperts._predict import predictors as predictors_module

    checks: list[int] = []
    real_check = predictors_module._check_ids
    monkeypatch.setattr(predictors_module, "_check_ids", lambda ids: checks.append(1) or real_check(ids))
    seen: list[int] = []

    def learn(self: Any, layer: int, x: Any, ids: Any) -> None:
        seen.append(layer)

    class _Subclass(NextRouterPredictor):
        observe = learn

    class _Mixin:
        observe = learn

    class _Mixed(_Mixin, NextRouterPredictor):
        pass

    class _Assigned(NextRouterPredictor):
        pass

    _Assigned.observe = learn  # type: ignore[method-assign]

    class _Vouched(NextRouterPredictor):
        stateless = True
        observe = learn

    async with aioexperts.open(model, slots=2 * SPEC.n_expert) as store:
        runner = aioexperts.MoERunner(store)
        await runner.warmup()
        x = np.random.default_rng(0).standard_normal((1, SPEC.n_embd)).astype(np.float32)
        own = runner.predictor
        assert isinstance(own, NextRouterPredictor)
        await runner.run_moe_layers(x)  # the runner's own predictor: its observe (the ids check) skipped
        assert checks == []
        own.observe(0, None, np.array([[0, 1]]))
        assert checks == [1]  # the spy sees the built-in observe when it runs
        residents = own._residents  # type: ignore[attr-defined]
        layers = list(store.layout.layers)
        instance = NextRouterPredictor(residents, store.hparams)
        instance.observe = learn.__get__(instance)  # type: ignore[method-assign]
        for cls_or_p in (_Subclass, _Mixed, _Assigned, instance):
            p = cls_or_p if isinstance(cls_or_p, NextRouterPredictor) else cls_or_p(residents, store.hparams)
            seen.clear()
            await runner.run_moe_layers(x, predictor=p)
            assert seen == layers, cls_or_p
        seen.clear()
        await runner.run_moe_layers(x, predictor=_Vouched(residents, store.hparams))
        assert seen == []
