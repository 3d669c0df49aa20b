"""A fake-backed engine for cache tests, with a backend that checks slot reuse on every submit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel

from aioexperts._io.backends.base import ReadOp
from aioexperts.testing import FakeBackend


class CheckedFake(FakeBackend):
    """A FakeBackend that fails loudly if a read targets a slot another load is still reading into."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot_loads: dict[int, dict[int, int]] = {}  # slot -> id(load) -> ops in flight
        self.submitted: list[list[ReadOp]] = []
        self.violations: list[str] = []

    def submit(self, ops: Sequence[ReadOp]) -> None:
        for op in ops:
            load = id(op.context[0])
            owners = self.slot_loads.setdefault(op.slot, {})
            others = [k for k in owners if k != load]
            if others:
                self.violations.append(f"slot {op.slot} reused while another load reads into it: {op}")
            owners[load] = owners.get(load, 0) + 1
        self.submitted.append(list(ops))
        super().submit(ops)

    def _complete(self, op: ReadOp, result: int | OSError | None) -> None:
        owners = self.slot_loads[op.slot]
        load = id(op.context[0])
        owners[load] -= 1
        if owners[load] == 0:
            del owners[load]
        super()._complete(op, result)

    def ops_for_slot(self, slot: int) -> list[ReadOp]:
        return [op for op in self.pending if op.slot == slot]


def fake_factory(holder: dict[str, CheckedFake], **kwargs: Any):  # type: ignore[no-untyped-def]
    def factory(files, slab, loop, depth):  # type: ignore[no-untyped-def]
        holder["fake"] = CheckedFake(files, slab, loop, depth, **kwargs)
        return holder["fake"]

    return factory


def cache_of(store: Any) -> Any:
    """The store's internal cache. TODO(issue 10): port these white-box tests to aioexperts.testing."""
    return store._cache


async def settle(ticks: int = 5) -> None:
    """Let callbacks and tasks run a few loop iterations."""
    for _ in range(ticks):
        await anyio.lowlevel.checkpoint()
