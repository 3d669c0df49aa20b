"""The library under pytest-asyncio's own event loop, the way an asyncio application awaits it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("asyncio") / "m.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2))
    return path


@pytest.mark.asyncio
async def test_concurrent_sequences_share_one_runner(model_path: Path) -> None:
    async with aioexperts.open(model_path, cache=aioexperts.CacheOptions(slots=8, wait_for_slots=True)) as store:
        runner = aioexperts.MoERunner(store)

        async def sequence(seed: int) -> np.ndarray:
            x = 0.01 * np.random.default_rng(seed).standard_normal((1, 256)).astype(np.float32)
            for layer in store.layout.layers:
                x = x + await runner.moe(layer, x)
            return x

        outs = await asyncio.gather(*(sequence(s) for s in range(6)))
        again = await sequence(3)
        np.testing.assert_array_equal(outs[3], again)
        st = store.statistics()
        assert st.requests == st.hits + st.inflight_joins + st.misses > 0


@pytest.mark.asyncio
async def test_task_cancellation_is_not_turned_into_another_error(model_path: Path) -> None:
    async with aioexperts.open(model_path, slots=8) as store:
        runner = aioexperts.MoERunner(store)
        task = asyncio.create_task(runner.moe(0, np.ones((4, 256), dtype=np.float32)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        y = await runner.moe(0, np.ones((4, 256), dtype=np.float32))
        assert y.shape == (4, 256)
