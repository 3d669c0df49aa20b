"""The forward pass's hand-offs to the compute pool, and the RoPE table, change no number."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import shared_fixture_paths

import aioexperts
from aioexperts._compute.pool import compute_pool
from aioexperts._compute.rope import RopeTable, rope_cos_sin, rope_table
from aioexperts._format.architectures import RopeParams, RopeType
from aioexperts._model import model as model_module

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
    assert rope_table(params) is not rope_table(params, factors)


@needs_fixture
async def test_routing_in_the_attention_job_saves_hand_offs_and_changes_nothing(anyio_backend: object) -> None:
    """A decode step takes two compute-pool jobs per MoE layer (attention + routing, experts + sum),
    and its logits are those of the runner's own moe() (which routes in a job of its own)."""
    assert QWEN3 is not None
    prompt = [11, 22, 33, 44, 55]  # the fixture has 64 tokens
    async with aioexperts.load(
        QWEN3, slots=1024, io=aioexperts.IOOptions(backend="threads"), hits_first=False
    ) as model:
        n_moe = len(model.store.layout.layers)
        n_dense = model.hparams.n_layer - n_moe
        pool = compute_pool()

        async def decode() -> tuple[np.ndarray, int]:
            async with model.sequence() as seq:
                await seq.forward(prompt)
                jobs = pool.statistics().jobs
                logits = await seq.forward([6])
                return logits, pool.statistics().jobs - jobs

        fused, fused_jobs = await decode()
        original = model_module._plain_moe
        model_module._plain_moe = lambda runner: False  # type: ignore[assignment]
        try:
            plain, plain_jobs = await decode()
        finally:
            model_module._plain_moe = original
    np.testing.assert_array_equal(fused, plain)
    # embedding + head, 2 per dense block (attention, FFN), 2 per MoE block
    assert fused_jobs == 2 + 2 * n_dense + 2 * n_moe
    assert plain_jobs == fused_jobs + n_moe  # the runner's moe() routes in a job of its own
