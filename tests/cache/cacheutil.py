"""A fake-backed store for cache tests, with a backend that checks slot reuse on every submit."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
from faults.guard import CheckedFake

__all__ = ("CheckedFake", "fake_factory", "settle")


def fake_factory(holder: dict[str, CheckedFake], **kwargs: Any):  # type: ignore[no-untyped-def]
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        holder["fake"] = CheckedFake(files, slab, loop, depth, **kwargs)
        return holder["fake"]

    return factory


def cache_of(store: Any) -> Any:
    """The store's internal cache. TODO(issue 10): port these white-box tests to aioexperts.testing."""
    return store._source.cache


async def settle(ticks: int = 5) -> None:
    """Let callbacks and tasks run a few loop iterations."""
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()
