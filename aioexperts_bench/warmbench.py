"""Warm figures: what a hit costs once every expert is resident in the slab.

A hit copies nothing (the caller gets views of slot memory), so it is reported as time per hit
and hits per second, never as GB/s:

- ``experts()`` of one expert: ``async with store.experts(layer, [e])`` (route nothing, pin one
  slot, build its views, unpin): the target is <= 20 us;
- ``experts()`` of a token's top-k: the same with ``k`` ids per call;
- ``moe()``: ``await runner.moe(layer, x)``: routing, pinning and the executor on ``k``
  resident experts (dominated by the executor's compute: numba kernels, numpy fallback).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import store_adapter as ea

__all__ = ("warm_figures",)


async def warm_figures(
    store: Any,
    info: ea.ModelInfo,
    steps: Sequence[tuple[int, tuple[int, ...]]],
    calls: int,
    moe_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """Warm figures of a store whose slab holds every expert of ``steps`` (read already).

    Args:
        store: a running store.
        info: the model.
        steps: the routing of the cold pass (its experts are resident).
        calls: ``experts()`` calls per figure.
        moe_tokens: tokens of ``moe()`` calls (each through every MoE layer).
        seed: seed of the ``moe()`` inputs.
    """
    singles = [(layer, (ids[i % len(ids)],)) for i, (layer, ids) in enumerate(steps)]
    singles = (singles * (calls // max(len(singles), 1) + 1))[:calls]
    topk = (list(steps) * (calls // max(len(steps), 1) + 1))[: max(1, calls // 4)]
    await ea.warm_experts(store, singles[:100])  # warm-up of the code paths
    single_s = await ea.warm_experts(store, singles)
    topk_s = await ea.warm_experts(store, topk)
    k = info.n_expert_used
    out: dict[str, Any] = {
        "experts_single_calls": len(singles),
        "experts_single_us_per_hit": single_s / len(singles) * 1e6,
        "experts_single_hits_per_s": len(singles) / single_s,
        "experts_topk_calls": len(topk),
        "experts_topk_us_per_call": topk_s / len(topk) * 1e6,
        "experts_topk_us_per_hit": topk_s / (len(topk) * k) * 1e6,
        "experts_topk_hits_per_s": len(topk) * k / topk_s,
    }
    if moe_tokens > 0:
        rng = np.random.default_rng(seed)
        xs = [_rms_norm(rng.standard_normal((1, info.n_embd), dtype=np.float32)) for _ in range(moe_tokens)]
        moe_s, moe_calls = await ea.warm_moe(store, info.layers, xs)
        out.update(
            moe_calls=moe_calls,
            moe_us_per_call=moe_s / moe_calls * 1e6,
            moe_hits_per_s=moe_calls * k / moe_s,
        )
    return out


def _rms_norm(x: np.ndarray) -> np.ndarray:
    y: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return y.astype(np.float32)
