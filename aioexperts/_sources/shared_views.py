"""The views of one expert in its slot, built once per slot load and shared by every request that pins it.

A warm hit then costs no view at all: the slab source keeps one :class:`SharedViews` on the
cache entry (:attr:`aioexperts._cache.cache.Entry.views`), hands its :class:`ExpertView` to
every request, and the cache invalidates it when the slot is reused (eviction) or the store
releases the slab. Invalidating releases the three memoryviews, so a view kept past its block
fails loudly (``ValueError``) once the slot shows another expert, instead of showing that
expert's bytes.

What the views cannot release themselves are arrays made from them (``np.frombuffer``) and
memoryviews sliced from them: those share the view's *managed buffer*, the object that holds the
buffer export for every memoryview made from one view. Its reference count grows with each of
them, which is how :meth:`SharedViews.exported` tells, when the last pin goes, that something
still uses slot memory that may soon hold another expert.
"""

from __future__ import annotations

import gc
import sys

from .._format.views import ExpertView, managed_buffer

__all__ = ("PROJECTIONS", "SharedExpertView", "SharedViews")

PROJECTIONS = ("gate", "up", "down")


class SharedExpertView(ExpertView):
    """An :class:`ExpertView` shared by every request pinning one slot load: its :meth:`release`
    does nothing, since the store releases the memoryviews when the slot is reused (a host
    releasing them would break the expert for every later hit until its eviction)."""

    __slots__ = ()

    def release(self) -> None:
        """Nothing: the store releases these views when the slot is reused; :meth:`copy` keeps bytes."""


class SharedViews:
    """The :class:`ExpertView` of one slot load, shared by the requests that pin it.

    Args:
        expert: views of the expert's three projections in slot memory (each memoryview made
            for this object alone).

    Attributes:
        expert: the view handed to every request; valid until :meth:`invalidate`.
    """

    # the three managed buffers and their reference counts at construction in slots of their own,
    # not in two tuples: one object per slot load instead of three (fewer objects for the collector)
    __slots__ = ("_down", "_down_refs", "_gate", "_gate_refs", "_up", "_up_refs", "expert")

    def __init__(self, expert: ExpertView) -> None:
        self.expert = expert
        # unrolled (no generator per load): this runs once per slot load, on the miss path
        g, u, d = expert.gate.data, expert.up.data, expert.down.data
        found = gc.get_referents(g, u, d)  # one call: CPython's memoryview has its managed buffer as its one referent
        if len(found) == 3:
            gate, up, down = found
        else:  # elsewhere: as managed_buffer tells
            gate, up, down = managed_buffer(g), managed_buffer(u), managed_buffer(d)
        del found  # its references must not count in the baseline below
        self._gate: object | None = gate
        self._up: object | None = up
        self._down: object | None = down
        # the baseline, with the references exported() holds too (a slot and a local name each)
        self._gate_refs = sys.getrefcount(gate)
        self._up_refs = sys.getrefcount(up)
        self._down_refs = sys.getrefcount(down)

    def exported(self) -> list[str]:
        """The projections whose bytes something besides these views still uses (an array made
        by ``np.frombuffer``, a slice of the memoryview); empty when nothing does."""
        gate, up, down = self._gate, self._up, self._down
        if gate is None:  # invalidated
            return []
        g, u, d = sys.getrefcount(gate), sys.getrefcount(up), sys.getrefcount(down)
        if g == self._gate_refs and u == self._up_refs and d == self._down_refs:
            return []
        return [
            name
            for name, before, after in zip(
                PROJECTIONS, (self._gate_refs, self._up_refs, self._down_refs), (g, u, d), strict=True
            )
            if after > before
        ]

    def invalidate(self) -> None:
        """Release the three memoryviews (using one afterwards raises ``ValueError``); idempotent.

        A memoryview exported through itself (a buffer taken from it and still held) cannot be
        released; its exporter keeps the slab mapped until that export ends.
        """
        expert = self.expert  # unrolled (no tuple, no loop): once per eviction, on the miss path
        try:
            expert.gate.data.release()
        except BufferError:
            pass
        try:
            expert.up.data.release()
        except BufferError:
            pass
        try:
            expert.down.data.release()
        except BufferError:
            pass
        self._gate = self._up = self._down = None
