"""The I/O core as the store assembles it (files, slab, backend, scheduler, cache), for fault tests.

:func:`open_stack` builds it on the running event loop from a GGUF path and a backend factory;
:class:`Stack` drives it through the cache API (``acquire`` / ``release`` / ``prefetch``) and
checks the invariants of docs/architecture.md after a case.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from aioexperts._cache.cache import Entry, ExpertCache, SlotState
from aioexperts._cache.eviction import LRU, EvictionPolicy
from aioexperts._cache.scheduler import ReadScheduler
from aioexperts._cache.stats import Counters
from aioexperts._errors import AioExpertsError
from aioexperts._format.layout import ExpertLayout, build_layout
from aioexperts._format.model import GGUFModel, open_model
from aioexperts._io.backends.base import IOBackend
from aioexperts._io.files import ShardFiles, open_shards
from aioexperts._io.loop import current_loop
from aioexperts._io.plan import ExpertPlan, max_plan_bytes, plan_expert
from aioexperts._io.slab import Slab

Key = tuple[int, int]
BackendFactory = Callable[[ShardFiles, Slab, Any, int], IOBackend]

#: Seconds any single wait of a case may take before the case fails as a hang.
BOUND = 10.0


def open_fds() -> int:
    """File descriptors open in this process now."""
    return len(os.listdir("/proc/self/fd"))


async def waiter_threads_ended() -> None:
    """Wait (up to :data:`BOUND`) until no ``aioexperts-uring-waiter`` thread runs: a backend closed on
    the loop thread only stops its batched wake-ups' waiter, which then ends by itself and closes its
    duplicates of the descriptors (``open_fds`` counts them until then)."""
    with anyio.fail_after(BOUND):
        while any(t.name == "aioexperts-uring-waiter" and t.is_alive() for t in threading.enumerate()):
            await anyio.sleep(0.001)


def reference_bytes(path: Path) -> dict[Key, list[bytes]]:
    """Every expert's (gate, up, down) bytes by a plain buffered ``pread``."""
    model = open_model(path)
    out = {}
    for loc in build_layout(model):
        segs = []
        for seg in loc.segments:
            with open(model.shards[seg.shard].path, "rb", buffering=0) as f:
                segs.append(os.pread(f.fileno(), seg.n_bytes, seg.offset))
        out[(loc.layer, loc.expert)] = segs
    return out


@dataclass
class Stack:
    """The assembled core; see :func:`open_stack`.

    Attributes:
        outcomes: what each :meth:`request` ended with: ``"ok"`` or the error's class name.
        errors: the errors :meth:`request` caught, in order.
    """

    model: GGUFModel
    layout: ExpertLayout
    files: ShardFiles
    slab: Slab
    backend: IOBackend
    scheduler: ReadScheduler
    cache: ExpertCache
    counters: Counters
    reference: dict[Key, list[bytes]]
    plan_of: Callable[[int, int], ExpertPlan]
    outcomes: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    closed: bool = False

    @property
    def keys(self) -> list[Key]:
        return list(self.reference)

    def entry_bytes(self, entry: Entry) -> list[bytes]:
        plan = entry.plan
        return [
            bytes(self.slab.view(entry.slot, off, seg.n_bytes))
            for off, seg in zip(plan.payload_offsets, plan.location.segments, strict=True)
        ]

    async def request(self, keys: Sequence[Key], *, wait: bool = False, hold: int = 1) -> str:
        """Acquire ``keys``, check their bytes, hold them ``hold`` checkpoints, release.

        Returns ``"ok"`` or the class name of the ``AioExpertsError`` raised; a wrong byte is
        ``"WRONG BYTES"``. A wait longer than :data:`BOUND` fails the test.
        """
        outcome = "ok"
        try:
            with anyio.fail_after(BOUND):
                entries = await self.cache.acquire(keys, wait=wait)
            try:
                for entry in entries:
                    if self.entry_bytes(entry) != self.reference[entry.key]:
                        outcome = "WRONG BYTES"
                for _ in range(hold):
                    await anyio.lowlevel.checkpoint()
            finally:
                self.cache.release(entries)
        except AioExpertsError as exc:
            self.errors.append(exc)
            outcome = type(exc).__name__
        self.outcomes.append(outcome)
        return outcome

    async def quiesce(self) -> None:
        """Wait (bounded) until no read is queued or in flight and the io_uring NOPs are reaped."""
        with anyio.fail_after(BOUND):
            await self.scheduler.wait_idle()
            while getattr(self.backend, "nops_in_flight", 0) and getattr(self.backend, "attached", False):
                await anyio.sleep(0.001)

    def problems(self) -> list[str]:
        """Broken invariants right now (call when quiet): an empty list is a pass."""
        out: list[str] = list(getattr(self.backend, "violations", []))
        cache, scheduler, backend = self.cache, self.scheduler, self.backend
        if cache.pinned_slots:
            out.append(f"{cache.pinned_slots} slots still pinned")
        if scheduler.reads_in_flight or backend.in_flight or not scheduler.idle:
            out.append(
                f"not idle: scheduler {scheduler.reads_in_flight} reads in flight, backend {backend.in_flight}, "
                f"idle={scheduler.idle}"
            )
        if scheduler.bytes_in_flight:
            out.append(f"{scheduler.bytes_in_flight} bytes still counted in flight")
        slots = list(cache.free_slots) + [e.slot for e in cache.entries.values()]
        if sorted(slots) != list(range(cache.n_slots)):
            out.append(f"slots lost or doubled: free {sorted(cache.free_slots)}, entries {sorted(cache.entries)}")
        loading = [e.key for e in cache.entries.values() if e.state is not SlotState.READY]
        if loading and scheduler.idle:
            out.append(f"entries not READY although nothing is in flight: {loading}")
        return out

    async def verify_all(self) -> list[str]:
        """Request every expert once (in groups that fit the slab); the keys whose bytes were wrong or failed."""
        bad = []
        keys = self.keys
        step = max(1, self.cache.n_slots // 2)
        for i in range(0, len(keys), step):
            group = keys[i : i + step]
            outcome = await self.request(group)
            if outcome != "ok":
                bad.append(f"{group}: {outcome}")
        return bad

    async def aclose(self) -> None:
        """Close like the store does: cache (and scheduler), wait for reads, backend, files, slab."""
        if self.closed:
            return
        self.closed = True
        self.cache.close()
        with anyio.CancelScope(shield=True), anyio.fail_after(BOUND):
            await self.scheduler.wait_idle()
        try:
            # detached on the loop, closed off it (as the store does): the close then waits for
            # the batched wake-ups' waiter thread, which holds duplicates of the ring's descriptors
            self.backend.detach()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.backend.close)
        finally:
            self.files.close()
            self.slab.close()


def open_stack(
    path: Path,
    factory: BackendFactory,
    *,
    slots: int = 8,
    depth: int = 32,
    policy: EvictionPolicy | None = None,
    reference: dict[Key, list[bytes]] | None = None,
    direct_io: bool | None = None,
) -> Stack:
    """Assemble the core on the running event loop (blocking calls included: test files are small)."""
    model = open_model(path)
    layout = build_layout(model)
    files = open_shards(model, direct_io)
    slab: Slab | None = None
    backend: IOBackend | None = None
    try:
        alignment = files.alignment

        @functools.cache
        def plan_of(layer: int, expert: int) -> ExpertPlan:
            return plan_expert(layout.locate(layer, expert), alignment)

        slab = Slab(slots, max_plan_bytes(layout, alignment))
        loop = current_loop()
        backend = factory(files, slab, loop, depth)
        backend.attach()
        counters = Counters()
        scheduler = ReadScheduler(
            backend, loop, counters, files.sizes, files.dio_alignment, 1 << 30, tuple(s.path for s in model.shards)
        )
        cache = ExpertCache(slots, plan_of, scheduler, policy if policy is not None else LRU(), loop, counters)
    except BaseException:
        if backend is not None:
            backend.close()
        if slab is not None:
            slab.close()
        files.close()
        raise
    return Stack(
        model,
        layout,
        files,
        slab,
        backend,
        scheduler,
        cache,
        counters,
        reference if reference is not None else reference_bytes(path),
        plan_of,
    )
