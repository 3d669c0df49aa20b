"""The timeline recorder (issue 36): reads, layer steps, compute jobs and tokens in order, the stall
timed against a backend of known delay, the device's busy fraction from the reads' spans."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioexperts
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)
DELAY = 0.12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


def fake_store(path: Path, **kwargs: Any) -> aioexperts.ExpertStore:
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        return FakeBackend(files, slab, loop, depth, **kwargs)

    return aioexperts.open(path, slots=8, io=aioexperts.IOOptions(backend=factory))


def test_busy_seconds_is_the_union_of_the_spans() -> None:
    from aioexperts._timeline import busy_seconds

    spans = np.array([[0.0, 1.0], [0.5, 2.0], [3.0, 4.0], [3.5, 3.6], [10.0, 11.0]])
    assert busy_seconds(spans) == pytest.approx(4.0)
    assert busy_seconds(spans, 0.5, 3.5) == pytest.approx(2.0)  # clipped to the window
    assert busy_seconds(np.zeros((0, 2))) == 0.0


def test_a_bad_size_is_refused() -> None:
    with pytest.raises(aioexperts.ConfigError, match="max_reads"):
        aioexperts.Timeline(max_reads=0)


async def test_events_in_order_and_the_stall_of_a_known_delay(model_path: Path, anyio_backend: object) -> None:
    async with fake_store(model_path, delay=DELAY) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        await runner.warmup()
        timeline = aioexperts.Timeline()
        with pytest.raises(aioexperts.ConfigError, match="Timeline"):
            runner.record_timeline("yes")  # type: ignore[arg-type]
        runner.record_timeline(timeline)
        x = np.random.default_rng(0).standard_normal((1, SMALL.n_embd)).astype(np.float32)
        walls = []
        for _ in range(3):  # a cold token (every expert read), then two warm ones (no read)
            t0 = time.perf_counter()
            assert timeline.begin_token() == len(walls)
            for layer in store.layout.layers:
                await runner.moe(layer, x)
            timeline.end_token()
            walls.append(time.perf_counter() - t0)
        reads, steps, computes, tokens = timeline.reads(), timeline.steps(), timeline.computes(), timeline.tokens()

        n_layers = len(store.layout.layers)
        assert len(tokens) == 3 and len(steps) == 3 * n_layers
        assert (steps[:, 0] == np.repeat([0, 1, 2], n_layers)).all()  # each step carries its token
        assert len(reads) == n_layers * SMALL.n_expert_used  # only the cold token read
        assert (reads[:, 3] == 0).all()  # demand reads
        # per read: queued <= submitted < done, the device's delay apart
        assert (reads[:, 4] <= reads[:, 5]).all() and (reads[:, 6] - reads[:, 5] >= DELAY * 0.95).all()
        # per step: start <= ready <= compute start <= compute end <= done
        assert (steps[:, 5] <= steps[:, 6]).all() and (steps[:, 6] <= steps[:, 7]).all()
        for step, _layer, _kind, a, b in computes:
            row = steps[int(step)]
            assert row[6] <= a <= b <= row[7]
        for layer, (submitted, done) in zip(reads[:, 0], reads[:, 5:7], strict=True):
            (step,) = steps[(steps[:, 0] == 0) & (steps[:, 1] == layer)]
            assert step[5] <= submitted and done <= step[6]  # read inside its step, before the step had it
        # the stall: the cold steps waited the delay (one submission per layer), the warm ones not at all
        cold, warm = steps[steps[:, 0] == 0], steps[steps[:, 0] > 0]
        assert cold[:, 4].tolist() == [SMALL.n_expert_used] * n_layers and (warm[:, 4] == 0).all()
        assert ((cold[:, 8] >= DELAY * 0.95) & (cold[:, 8] <= DELAY + 0.08)).all()
        assert (warm[:, 8] < 0.02).all()

        s = timeline.summary()
        assert s["tokens"] == 3 and s["reads"] == len(reads) and s["dropped"] == 0
        assert s["wall_seconds"] == pytest.approx(tokens[-1, 1] - tokens[0, 0])
        assert s["wall_seconds"] <= sum(walls) + 1e-3
        # reads are only in flight while the cold steps wait: the device is busy about the stall
        assert s["device_busy_seconds"] == pytest.approx(n_layers * DELAY, rel=0.3)
        assert s["device_busy_fraction"] == pytest.approx(s["device_busy_seconds"] / s["wall_seconds"])
        assert s["stall_seconds"] == pytest.approx(steps[:, 8].sum())
        assert s["stall_seconds_per_token"] == pytest.approx(s["stall_seconds"] / 3)
        assert s["compute_seconds"] == pytest.approx(s["wall_seconds"] - s["stall_seconds"])
        assert s["pipeline_ratio"] >= 1.0
        assert s["bytes_read"] == int(reads[:, 2].sum()) > 0

        d = timeline.as_dict()
        assert d["tokens"]["start_ms"][0] == 0.0 and len(d["reads"]["layer"]) == len(reads)
        assert d["summary"] == s

        runner.record_timeline(None)  # stopped: nothing more is recorded
        await runner.moe(next(iter(store.layout.layers)), -x)
        assert len(timeline.steps()) == len(steps) and len(timeline.reads()) == len(reads)


async def test_a_full_array_drops_later_events(model_path: Path, anyio_backend: object) -> None:
    async with fake_store(model_path) as store:
        runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
        timeline = aioexperts.Timeline(max_reads=1, max_steps=1, max_tokens=1)
        await runner.warmup()
        runner.record_timeline(timeline)
        x = np.ones((1, SMALL.n_embd), np.float32)
        timeline.begin_token()
        for layer in store.layout.layers:
            await runner.moe(layer, x)
        timeline.end_token()
        assert timeline.begin_token() == -1  # the token table is full
        assert len(timeline.reads()) == 1 and len(timeline.steps()) == 1
        assert timeline.dropped >= 2 * SMALL.n_expert_used - 1 + 1 + 1
        assert "dropped" in repr(timeline)
