"""Open a model for MoE compute through the public API, whichever shape it has in this checkout.

The engine is being split into an expert store (``aioexperts.open`` -> ``ExpertStore``: layout,
hparams, ``experts``) and a runner (``aioexperts.MoERunner``: ``moe``, ``moe_result``, ``run_token``,
prefetch, traces). Tests that only need "open, then compute" use :func:`moe_session`, which works with
the split API and with the single ``Engine`` that had both faces.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aioexperts


class Session:
    """``store`` answers layout / hparams / experts; ``runner`` computes (the same object before the split)."""

    def __init__(self, store: Any, runner: Any) -> None:
        self.store = store
        self.runner = runner

    @property
    def layout(self) -> Any:
        return self.store.layout

    @property
    def hparams(self) -> Any:
        return self.store.hparams

    def experts(self, layer: int, ids: Any) -> Any:
        return self.store.experts(layer, ids)

    async def warmup(self) -> None:
        """Load the resident weights (``MoERunner.warmup`` / ``Engine.load_resident``)."""
        method = getattr(self.runner, "warmup", None) or self.runner.load_resident
        await method()

    def __getattr__(self, name: str) -> Any:  # moe, moe_result, run_token, upcoming_layers, routing_trace
        return getattr(self.runner, name)


@asynccontextmanager
async def moe_session(
    path: str | os.PathLike[str],
    *,
    slots: int | None = None,
    expert_map: str | os.PathLike[str] | None = None,
    record_trace: bool = False,
) -> AsyncIterator[Session]:
    """``async with moe_session(path) as s: await s.moe_result(layer, x)``."""
    runner_cls = getattr(aioexperts, "MoERunner", None)
    if runner_cls is not None:
        async with aioexperts.open(path, slots=slots, expert_map=expert_map) as store:
            yield Session(store, runner_cls(store, record_trace=record_trace))
    else:
        async with aioexperts.open(path, slots=slots, expert_map=expert_map, record_trace=record_trace) as engine:
            yield Session(engine, engine)
