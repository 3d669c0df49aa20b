"""Turn an expert's byte segments into aligned reads and a layout inside one slot.

Each segment (gate, up, down) is widened to the alignment; widened ranges of the same shard that
overlap or touch are merged into one read (a merged ``gate_up`` run is one segment pair that
always merges). Reads are packed one after another from the start of the slot, so every read
starts at a multiple of the alignment in page-aligned slot memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .._format.layout import ExpertLayout, ExpertLocation
from .._format.views import LayoutKey, projections_layout
from .align import align_up, widen

__all__ = ("ExpertPlan", "LoadPlan", "PlannedRead", "max_plan_bytes", "plan_all_experts", "plan_expert")


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One aligned read of an expert.

    Attributes:
        shard: file index.
        file_offset: aligned start in the file (bytes).
        n_bytes: aligned length (bytes).
        slot_offset: where in the slot the read lands (bytes, aligned).
        needed: bytes from ``file_offset`` that hold payload: a read that stops at end of file
            after at least this many bytes is complete.
    """

    shard: int
    file_offset: int
    n_bytes: int
    slot_offset: int
    needed: int


class LoadPlan(Protocol):
    """What the cache and the scheduler need of a plan: its key, its reads, what it is."""

    @property
    def key(self) -> tuple[int, int]: ...
    @property
    def reads(self) -> tuple[PlannedRead, ...]: ...
    @property
    def read_bytes(self) -> int: ...
    @property
    def payload_bytes(self) -> int: ...
    @property
    def what(self) -> str: ...


#: every distinct layout of the plans made, to itself (a few per model): equal layouts, one object
_LAYOUTS: dict[LayoutKey, LayoutKey] = {}


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """The reads of one expert and where its payloads sit in the slot.

    Attributes:
        location: the expert.
        reads: the aligned reads, in slot order.
        payload_offsets: slot offsets (bytes) of the gate, up and down payloads.
        slot_bytes: bytes of the slot the reads occupy.
        read_bytes: bytes the reads request (payload plus alignment padding); computed once, the
            scheduler reads it for every load.
        payload_bytes: bytes of the expert itself (gate + up + down); computed once.
        payload_spans: ``(start, end)`` slot offsets (bytes) of the gate, up and down payloads,
            flat: what the slab's views of a load are cut from; computed once.
        layout: the :func:`~aioexperts._format.views.projections_layout` of the expert's
            projections, one shared object per distinct layout (equal layouts are the same
            object, so a layer's table tells one layout by identity); computed once.
    """

    location: ExpertLocation
    reads: tuple[PlannedRead, ...]
    payload_offsets: tuple[int, int, int]
    slot_bytes: int
    read_bytes: int = field(init=False, compare=False)
    payload_bytes: int = field(init=False, compare=False)
    payload_spans: tuple[int, int, int, int, int, int] = field(init=False, compare=False, repr=False)
    layout: LayoutKey = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "read_bytes", sum(r.n_bytes for r in self.reads))
        object.__setattr__(self, "payload_bytes", self.location.n_bytes)
        g, u, d = self.location.segments
        g0, u0, d0 = self.payload_offsets
        object.__setattr__(self, "payload_spans", (g0, g0 + g.n_bytes, u0, u0 + u.n_bytes, d0, d0 + d.n_bytes))
        layout = projections_layout(g, u, d)
        object.__setattr__(self, "layout", _LAYOUTS.setdefault(layout, layout))

    @property
    def key(self) -> tuple[int, int]:
        """``(layer, expert)``: the cache key of what this plan loads."""
        return self.location.layer, self.location.expert

    @property
    def what(self) -> str:
        """What the plan loads, for messages: ``layer 3 expert 17``."""
        return f"layer {self.location.layer} expert {self.location.expert}"


def plan_expert(
    location: ExpertLocation, alignment: int, split_bytes: int | None = None, max_reads: int | None = None
) -> ExpertPlan:
    """Plan the aligned reads of ``location``.

    Args:
        location: the expert.
        alignment: bytes, a power of two: every read starts, ends and lands at a multiple.
        split_bytes: cut reads longer than this (bytes, rounded up to the alignment) into
            chunks submitted together, so that one large expert keeps several reads in the
            device's queue (the source design's ``read_expert_range``); None: one read per run.
        max_reads: the chunks are made larger if needed so that the expert takes at most this
            many reads (the scheduler's queue depth: a load's reads go out together).
    """
    segments = location.segments
    order = sorted(range(3), key=lambda i: (segments[i].shard, segments[i].offset))
    groups: list[tuple[int, int, int, list[int]]] = []  # shard, start, end, member indices
    for i in order:
        seg = segments[i]
        start, length, _ = widen(seg.offset, seg.n_bytes, alignment)
        if groups and groups[-1][0] == seg.shard and start <= groups[-1][2]:
            shard, g_start, g_end, members = groups[-1]
            groups[-1] = (shard, g_start, max(g_end, start + length), [*members, i])
        else:
            groups.append((seg.shard, start, start + length, [i]))
    chunk = _chunk_bytes([end - start for _, start, end, _ in groups], alignment, split_bytes, max_reads)
    reads: list[PlannedRead] = []
    payload = [0, 0, 0]
    slot_offset = 0
    for shard, start, end, members in groups:
        payload_end = max(segments[i].end for i in members)
        step = chunk or end - start
        for piece in range(start, end, step):
            n = min(step, end - piece)
            reads.append(PlannedRead(shard, piece, n, slot_offset + piece - start, min(n, payload_end - piece)))
        for i in members:
            payload[i] = slot_offset + segments[i].offset - start
        slot_offset += end - start
    return ExpertPlan(location, tuple(reads), (payload[0], payload[1], payload[2]), slot_offset)


def _chunk_bytes(lengths: list[int], alignment: int, split_bytes: int | None, max_reads: int | None) -> int | None:
    """The chunk size (bytes, aligned) that cuts runs of ``lengths`` into at most ``max_reads`` reads."""
    if split_bytes is None:
        return None
    chunk = align_up(max(split_bytes, alignment), alignment)
    if max_reads is not None:
        while sum(-(-n // chunk) for n in lengths) > max_reads:
            chunk *= 2
    return chunk if any(n > chunk for n in lengths) else None


def max_plan_bytes(layout: ExpertLayout, alignment: int) -> int:
    """The slot size (bytes) that holds the plan of every expert of ``layout``."""
    return max(plan_expert(loc, alignment).slot_bytes for loc in layout)


def plan_all_experts(
    layout: ExpertLayout, alignment: int, split_bytes: int | None = None, max_reads: int | None = None
) -> dict[tuple[int, int], ExpertPlan]:
    """:func:`plan_expert` for every expert of ``layout``: ``{(layer, expert): plan}``."""
    return {(loc.layer, loc.expert): plan_expert(loc, alignment, split_bytes, max_reads) for loc in layout}
