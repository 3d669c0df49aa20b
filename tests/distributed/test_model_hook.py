"""``aioexperts.load(..., runner=...)``: the hook the sharded runner uses (no Ray needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioexperts
from aioexperts._batch import DEFAULT_BATCH_WAIT

pytestmark = pytest.mark.anyio


async def test_load_runs_the_model_on_the_runner_it_is_given(tiny_full_model: Path, anyio_backend: object) -> None:
    made: list[aioexperts.MoERunner] = []

    def recording(store: aioexperts.ExpertStore, prefetch: Any) -> aioexperts.MoERunner:
        made.append(aioexperts.MoERunner(store, prefetch=prefetch, record_trace=True))
        return made[-1]

    async with aioexperts.load(tiny_full_model, slots=8, n_ctx=32) as plain:
        want = await plain.logits([1, 2, 3])
    async with aioexperts.load(tiny_full_model, slots=8, n_ctx=32, runner=recording) as model:
        got = await model.logits([1, 2, 3])
        assert model.runner is made[0]
        trace = model.runner.routing_trace()
    np.testing.assert_array_equal(got, want)
    assert trace.n_tokens == 3 and (trace.ids >= 0).all()


async def test_a_runner_that_is_not_one_is_refused(tiny_full_model: Path, anyio_backend: object) -> None:
    with pytest.raises(aioexperts.ConfigError, match="runner must be a callable"):
        aioexperts.load(tiny_full_model, runner="MoERunner")  # type: ignore[arg-type]
    model = aioexperts.load(tiny_full_model, slots=8, n_ctx=32, runner=lambda store, prefetch: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(aioexperts.ConfigError, match="runner must return a MoERunner"):
        await model.start()
    await model.aclose()


@pytest.mark.parametrize("runner_kind", ["default", "factory", "subclass"])
async def test_load_options_are_honoured_by_every_runner(
    tiny_full_model: Path, runner_kind: str, anyio_backend: object
) -> None:
    """Issue 32: with ``runner=`` a factory, ``load()`` dropped ``batch_wait``, ``hits_first`` and
    ``record_trace`` (``batch_wait=0`` still batched with 0.05 s)."""

    class Custom(aioexperts.MoERunner):
        pass

    factories: dict[str, Any] = {
        "default": None,
        "factory": lambda store, prefetch: aioexperts.MoERunner(store, prefetch=prefetch),
        "subclass": lambda store, prefetch: Custom(store, prefetch=prefetch),
    }
    async with aioexperts.load(
        tiny_full_model, slots=8, n_ctx=32, runner=factories[runner_kind], batch_wait=0, hits_first=False,
        record_trace=True,
    ) as model:  # fmt: skip
        runner = model.runner
        assert runner.batch_wait == 0 and not runner.batching
        assert runner.hits_first is False
        assert runner.record_trace is True
        await model.logits([1, 2, 3])
        assert runner.routing_trace().n_tokens == 3
    async with aioexperts.load(tiny_full_model, slots=8, n_ctx=32, runner=factories[runner_kind]) as model:
        assert model.runner.batch_wait == DEFAULT_BATCH_WAIT > 0 and model.runner.hits_first is True
        with pytest.raises(aioexperts.ConfigError, match="before warmup"):
            model.runner.record_trace = True


async def test_a_factory_that_drops_the_prefetch_options_is_refused(
    tiny_full_model: Path, anyio_backend: object
) -> None:
    """A ``load()`` option the runner cannot honour is an error, not dropped (issue 32)."""
    wanted = aioexperts.PrefetchOptions(predictor="frequency", depth=1)
    model = aioexperts.load(
        tiny_full_model, slots=8, n_ctx=32, prefetch=wanted, runner=lambda store, prefetch: aioexperts.MoERunner(store)
    )
    with pytest.raises(aioexperts.ConfigError, match="prefetch"):
        await model.start()
    async with aioexperts.load(
        tiny_full_model, slots=8, n_ctx=32, prefetch=wanted,
        runner=lambda store, prefetch: aioexperts.MoERunner(store, prefetch=prefetch),
    ) as model:  # fmt: skip
        assert model.runner.prefetch_options == wanted
