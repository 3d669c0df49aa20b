"""``aioexperts.load(..., runner=...)``: the hook the sharded runner uses (no Ray needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioexperts

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
