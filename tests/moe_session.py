"""Open a model for MoE compute through the public API: an expert store and a runner over it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aioexperts


class Session:
    """``store`` answers layout / hparams / experts; ``runner`` computes (``moe``, ``run_moe_layers``, ...)."""

    def __init__(self, store: aioexperts.ExpertStore, runner: aioexperts.MoERunner) -> None:
        self.store = store
        self.runner = runner

    @property
    def layout(self) -> aioexperts.ExpertLayout:
        return self.store.layout

    @property
    def hparams(self) -> aioexperts.MoEHParams:
        return self.store.hparams

    def experts(self, layer: int, ids: Any) -> Any:
        return self.store.experts(layer, ids)

    async def warmup(self) -> None:
        await self.runner.warmup()

    def __getattr__(self, name: str) -> Any:  # moe, moe_result, run_moe_layers, upcoming_layers, routing_trace
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
    async with aioexperts.open(path, slots=slots, expert_map=expert_map) as store:
        yield Session(store, aioexperts.MoERunner(store, record_trace=record_trace))
