"""The forward pass's hand-offs to the compute pool, and the RoPE table, change no number."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._compute.pool import compute_pool
from aioexperts._compute.rope import RopeTable, rope_cos_sin, rope_table
from aioexperts._format.architectures import RopeParams, RopeType
from aioexperts._runner import MoERunner

pytestmark = pytest.mark.anyio

QWEN3 = next((p for p in shared_fixture_paths() if p.stem == "qwen3moe-f32"), None)
needs_fixture = pytest.mark.skipif(QWEN3 is None, reason="shared fixtures not found")


@pytest.mark.parametrize(
    "params",
    [
        RopeParams(RopeType.NEOX, 64, freq_base=1e6),
        RopeParams(RopeType.NORM, 32, freq_base=5e5, freq_scale=0.25, ext_factor=1.0, attn_factor=1.1, n_ctx_orig=4096),
    ],
)
def test_rope_table_is_rope_cos_sin_per_position(params: RopeParams) -> None:
    factors = np.linspace(1.0, 8.0, params.n_rot // 2, dtype=np.float32)
    table = RopeTable(params, factors)
    for start, n in ((0, 1), (5, 3), (300, 1), (250, 700), (1999, 1)):  # the last ones grow the table
        cos, sin = table.cos_sin(start, n)
        want_cos, want_sin = rope_cos_sin(params, np.arange(start, start + n), factors)
        np.testing.assert_array_equal(cos, want_cos)
        np.testing.assert_array_equal(sin, want_sin)
    assert table.size >= 2000
    assert rope_table(params, factors) is rope_table(params, factors.copy())
    fresh = RopeTable(params, factors)
    fresh.cos_sin(0, 300)  # a prefill of 300 positions: room for as many decode tokens after it
    assert fresh.size == 600
    long = RopeTable(params, factors)
    long.cos_sin(0, 10_000)  # a long prompt's table gets GROW_AHEAD positions more, not twice
    assert long.size == 10_000 + RopeTable.GROW_AHEAD
    assert rope_table(params) is not rope_table(params, factors)


@needs_fixture
@pytest.mark.parametrize("hits_first", [False, True])
async def test_a_decode_step_takes_one_compute_pool_job_per_layer(
    hits_first: bool, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every expert resident, a layer-by-layer decode step hands the compute pool one job per
    block: a MoE layer's experts, their sum and the next block's attention and routing (or the head)
    run in one job (plus the embedding rows and the first block's attention). (The held pass, which
    a slab with room for the model takes, is one job: tests/model/test_forward_held.py.)"""
    assert QWEN3 is not None
    monkeypatch.setattr(MoERunner, "hold_resident", lambda self: contextlib.nullcontext(None))
    prompt = [11, 22, 33, 44, 55]  # the fixture has 64 tokens
    async with aioexperts.load(
        QWEN3, slots=1024, io=aioexperts.IOOptions(backend="threads"), hits_first=hits_first, batch_wait=0
    ) as model:
        pool = compute_pool()
        async with model.sequence() as seq:
            await seq.forward(prompt)
            await seq.forward([6])  # every expert the next step chooses is resident after a few tokens
            jobs = pool.statistics().jobs
            logits = await seq.forward([7])
            n_jobs = pool.statistics().jobs - jobs
        n_layer = model.hparams.n_layer
    assert np.isfinite(logits).all()
    assert n_jobs == 2 + n_layer  # embedding rows, first attention, one per block
