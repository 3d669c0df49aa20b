"""The public objects under faults: ``aioexperts.open`` with a checked backend, ``experts()`` and
``MoERunner.moe()`` requests, and the invariants of docs/architecture.md checked from outside.

:class:`StoreRun` opens a store through the public API with a backend factory from
:mod:`faults.guard` (a slot-guarded fake or the real io_uring backend, the latter usually under the
``liburing`` proxy of :mod:`faults.ringproxy`), records what every request ended with, and checks:

- :meth:`StoreRun.problems` (when quiet): the slot guard saw no read into a slot another load owns
  and nothing submitted after close; ``statistics()`` shows no pinned slot and no read in flight;
  the request counters add up;
- :meth:`StoreRun.verify_all`: every expert's bytes equal a plain ``pread``, requested a whole
  slab at a time (a lost slot shows as a failed request);
- :meth:`StoreRun.close_and_check`: after ``aclose()`` the process holds as many descriptors and
  io_uring mappings as before ``open``, and the slab's memory is unmapped.

The slab is found through the address of a view it served (``np.frombuffer(view).ctypes.data``)
and the mapping of ``/proc/self/maps`` that holds it, noted just before the close: after the close
that exact mapping (same bounds) must be gone. Counting anonymous mappings of the slab's exact size
is not reliable: Linux merges adjacent anonymous mappings with the same protection into one (two
352 KiB ``mmap`` calls in a row showed as one 708 KiB mapping here). Nor is "the address is no
longer mapped": the freed range is where the next ``mmap`` of the process tends to go (seen here:
a new mapping at the slab's address right after a close).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

import aioexperts
from aioexperts.policies import EvictionPolicy
from faults.guard import SlotGuard, checked_factory
from faults.stack import BOUND, Key, open_fds

__all__ = (
    "BOUND",
    "MoEReference",
    "Resources",
    "StoreRun",
    "address_of",
    "mapping_of",
    "moe_inputs",
    "moe_references",
)

#: Outcomes that are always a failure of the case.
BAD_OUTCOMES = ("HANG", "WRONG BYTES", "WRONG OUTPUT")


def _maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.readlines()


def mapping_of(address: int) -> str | None:
    """The mapping (``start-end perms offset``) of ``/proc/self/maps`` that holds ``address``, or None."""
    for line in _maps():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return " ".join(fields[:3])
    return None


def uring_mappings() -> int:
    """Mappings of io_uring rings (``anon_inode:[io_uring]``) in this process."""
    return sum(1 for line in _maps() if "[io_uring]" in line)


def address_of(data: memoryview) -> int:
    """The address of the first byte of ``data`` (through numpy; the array is dropped at once)."""
    array = np.frombuffer(data, dtype=np.uint8)
    try:
        return int(array.ctypes.data)
    finally:
        del array


@dataclass(frozen=True)
class Resources:
    """What the process holds: descriptors and io_uring mappings."""

    fds: int
    uring_maps: int

    @classmethod
    def now(cls) -> Resources:
        return cls(open_fds(), uring_mappings())


#: ``(layer, seed) -> (x, expected ffn_out)``; see :func:`moe_references`.
MoEReference = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]


def moe_inputs(n_embd: int, layers: Sequence[int], seeds: Sequence[int]) -> dict[tuple[int, int], np.ndarray]:
    """Deterministic ``x`` per ``(layer, seed)``: ``1 + seed % 2`` tokens of small values."""
    out = {}
    for layer in layers:
        for seed in seeds:
            rng = np.random.default_rng(1000 * layer + seed)
            out[(layer, seed)] = (0.01 * rng.standard_normal((1 + seed % 2, n_embd))).astype(np.float32)
    return out


def moe_references(path: Path, seeds: Sequence[int]) -> MoEReference:
    """``runner.moe(layer, x)`` of every MoE layer and seed on a fault-free store (plain threads backend)."""

    async def compute() -> MoEReference:
        async with aioexperts.open(path, io=aioexperts.IOOptions(backend="threads")) as store:
            runner = aioexperts.MoERunner(store)
            xs = moe_inputs(store.hparams.n_embd, list(store.layout.layers), seeds)
            return {key: (x, await runner.moe(key[0], x)) for key, x in xs.items()}

    return anyio.run(compute)


@dataclass
class StoreRun:
    """One store opened through the public API with a slot-guarded backend.

    Attributes:
        store, runner: the public objects.
        holder: ``holder["backend"]`` is the backend the factory built.
        reference: every expert's bytes by a plain ``pread``.
        moe_refs: expected ``moe`` outputs (see :func:`moe_references`).
        before: descriptors and ring mappings before ``open``.
        outcomes: what each request ended with: ``"ok"``, an ``AioExpertsError`` class name, or one
            of :data:`BAD_OUTCOMES`.
        errors: the ``AioExpertsError`` instances the requests raised.
        slab_address: an address inside the slab, seen through a view (0 until one was served).
        slab_mapping: the mapping that held ``slab_address`` when :meth:`note_slab` last ran.
    """

    store: aioexperts.ExpertStore
    runner: aioexperts.MoERunner
    holder: dict[str, Any]
    reference: dict[Key, list[bytes]]
    moe_refs: MoEReference
    before: Resources
    outcomes: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    slab_address: int = 0
    slab_mapping: str | None = None

    @classmethod
    async def open(
        cls,
        path: Path,
        backend_cls: type[SlotGuard],
        reference: dict[Key, list[bytes]],
        moe_refs: MoEReference,
        *,
        slots: int = 8,
        depth: int = 32,
        policy: EvictionPolicy | str = "lru",
        **backend_kwargs: Any,
    ) -> StoreRun:
        """Open and start a store whose backend is ``backend_cls(files, slab, loop, depth, **backend_kwargs)``."""
        before = Resources.now()
        holder: dict[str, Any] = {}
        store = aioexperts.open(
            path,
            cache=aioexperts.CacheOptions(slots=slots, policy=policy),
            io=aioexperts.IOOptions(backend=checked_factory(backend_cls, holder, **backend_kwargs), queue_depth=depth),
        )
        await store.start()
        return cls(store, aioexperts.MoERunner(store), holder, reference, moe_refs, before)

    @property
    def backend(self) -> Any:
        """The slot-guarded backend the store reads with."""
        return self.holder["backend"]

    def record(self, outcome: str, error: BaseException | None = None) -> str:
        self.outcomes.append(outcome)
        if error is not None:
            self.errors.append(error)
        return outcome

    async def request(self, layer: int, ids: Sequence[int], wait: bool | None = None, hold: int = 1) -> str:
        """``async with store.experts(layer, ids, wait=wait)``: check the bytes, hold ``hold`` checkpoints.

        Returns (and records) ``"ok"``, the ``AioExpertsError`` class name, ``"WRONG BYTES"`` or
        ``"HANG"`` (not answered within :data:`BOUND` seconds).
        """
        outcome = "ok"
        try:
            with anyio.fail_after(BOUND):
                async with self.store.experts(layer, ids, wait=wait) as views:
                    if not self.views_right(layer, ids, views):
                        outcome = "WRONG BYTES"
                    for _ in range(hold):
                        await anyio.lowlevel.checkpoint()
        except aioexperts.AioExpertsError as exc:
            return self.record(type(exc).__name__, exc)
        except TimeoutError:
            return self.record("HANG")
        return self.record(outcome)

    def views_right(self, layer: int, ids: Sequence[int], views: Sequence[aioexperts.ExpertView | None]) -> bool:
        """True when every view holds the expert's bytes (a plain ``pread``); notes where the slab is."""
        right = True
        for expert, view in zip(ids, views, strict=True):
            assert view is not None
            if [bytes(p.data) for p in (view.gate, view.up, view.down)] != self.reference[(layer, expert)]:
                right = False
            if not self.slab_address:
                self.slab_address = address_of(view.gate.data)
        return right

    async def moe(self, layer: int, seed: int) -> str:
        """``runner.moe(layer, x)`` for a reference input; the output must equal the fault-free one."""
        x, expected = self.moe_refs[(layer, seed)]
        try:
            with anyio.fail_after(BOUND):
                y = await self.runner.moe(layer, x)
        except aioexperts.AioExpertsError as exc:
            return self.record(type(exc).__name__, exc)
        except TimeoutError:
            return self.record("HANG")
        return self.record("ok" if np.array_equal(y, expected) else "WRONG OUTPUT")

    async def quiesce(self) -> None:
        """Wait (bounded) until no read is in flight, twice in a row, and the io_uring NOPs are reaped."""
        backend = self.backend
        quiet = 0
        with anyio.fail_after(BOUND):
            while quiet < 2:
                await anyio.sleep(0.001)
                busy = (
                    self.store.statistics().in_flight
                    or backend.in_flight
                    or getattr(backend, "pending", None)
                    or (getattr(backend, "nops_in_flight", 0) and backend.attached)
                )
                quiet = 0 if busy else quiet + 1

    def problems(self) -> list[str]:
        """Broken invariants now (call when quiet): an empty list is a pass."""
        out = [f"guard: {v}" for v in self.backend.violations]
        st = self.store.statistics()
        if st.pinned_slots:
            out.append(f"{st.pinned_slots} slots still pinned")
        if st.in_flight or self.backend.in_flight:
            out.append(f"reads in flight: store {st.in_flight}, backend {self.backend.in_flight}")
        if st.requests != st.hits + st.inflight_joins + st.misses:
            out.append(f"requests {st.requests} != hits {st.hits} + joins {st.inflight_joins} + misses {st.misses}")
        bad = [o for o in self.outcomes if o in BAD_OUTCOMES or not (o == "ok" or o.endswith("Error"))]
        if bad:
            out.append(f"bad outcomes: {bad}")
        return out

    async def verify_all(self) -> list[str]:
        """Request every expert, a whole slab at a time (``wait=False``); what failed or had wrong bytes."""
        bad = []
        n_slots = self.store.statistics().n_slots
        for layer, moe in self.store.layout.layers.items():
            ids = list(range(moe.n_experts))
            for i in range(0, len(ids), n_slots):
                group = ids[i : i + n_slots]
                outcome = await self.request(layer, group, wait=False)
                if outcome != "ok":
                    bad.append(f"layer {layer} {group}: {outcome}")
        return bad

    def note_slab(self) -> None:
        """Note the mapping that holds the slab now (call while the store is open, after a request)."""
        assert self.slab_address, "no view was served yet: the slab's address is unknown"
        self.slab_mapping = mapping_of(self.slab_address)
        assert self.slab_mapping is not None, f"the slab address {self.slab_address:#x} is not mapped while open"

    async def close_if_open(self) -> None:
        """``aclose()`` unless closed already, shielded and bounded (the ``finally`` of every case)."""
        if not self.store.closed:
            with anyio.CancelScope(shield=True), anyio.fail_after(BOUND):
                await self.store.aclose()

    async def close_and_check(self, close: Callable[[], Any] | None = None) -> list[str]:
        """``aclose()`` (unless ``close`` did), then what the process still holds that it did not before."""
        if self.slab_address and not self.store.closed:
            self.note_slab()
        if not self.store.closed or close is not None:
            with anyio.fail_after(BOUND):
                await (close or self.store.aclose)()
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """After close: descriptors, io_uring mappings and the slab mapping back to where they were."""
        out = []
        now = Resources.now()
        if now != self.before:
            out.append(f"resources before open {self.before}, after close {now}")
        if self.slab_mapping is not None and mapping_of(self.slab_address) == self.slab_mapping:
            gc.collect()  # views kept alive by reference cycles (tracebacks) keep the slab mapped until collected
            if mapping_of(self.slab_address) == self.slab_mapping:
                out.append(f"the slab's mapping {self.slab_mapping} is still there after close")
        backend = self.backend
        closed = getattr(backend, "closed", None)
        if closed is None:
            closed = not getattr(backend, "_ring_open", True)
        if not closed:
            out.append(f"the backend {backend!r} was not closed")
        return out
