"""The miss-tier tests' shared pieces: a store on a scripted backend, and letting the loop run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio.lowlevel

import aioexperts
from aioexperts import MissTier
from aioexperts.testing import FakeBackend


def fake_store(path: Path, holder: dict[str, FakeBackend], tier: MissTier, **kwargs: Any) -> aioexperts.ExpertStore:
    """A store of 8 slots with ``tier`` on a :class:`FakeBackend` (``kwargs``), kept in ``holder["fake"]``."""

    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        holder["fake"] = FakeBackend(files, slab, loop, depth, **kwargs)
        return holder["fake"]

    return aioexperts.open(path, slots=8, io=aioexperts.IOOptions(backend=factory), miss_tier=tier)


async def settle(ticks: int = 6) -> None:
    """``ticks`` checkpoints: the loop runs what the last step scheduled."""
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()
