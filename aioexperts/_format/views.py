"""What a host receives for one pinned expert: zero-copy views of its raw ggml bytes and their layout."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

__all__ = (
    "ExpertTable",
    "ExpertView",
    "ProjectionView",
    "layout_key",
    "managed_buffer",
    "projections_layout",
    "release_view",
    "warn_exported",
)


@dataclass(frozen=True, slots=True, init=False)
class ProjectionView:
    """The raw bytes of one projection (gate, up or down) of one expert.

    Attributes:
        data: read-only ``memoryview`` (format ``B``) of exactly ``n_bytes`` bytes, equal to a plain
            ``pread`` of the file range; for experts served from the slab it points into slot memory
            and is valid only while the expert is pinned.
        ggml_type: the ggml quantization type of these bytes (``Q4_K``, ``Q8_0``, ``F32``, ...).
        shape: numpy order ``(rows, cols)``, i.e. ggml ``(ne1, ne0)``: gate/up are
            ``(n_ff, n_embd)``, down is ``(n_embd, n_ff_down)``. ``cols`` is a multiple of the
            type's block size.
    """

    data: memoryview
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    _address: int = field(default=0, init=False, repr=False, compare=False)  # found on first use

    def __init__(self, data: memoryview, ggml_type: GGMLQuantizationType, shape: tuple[int, int]) -> None:
        # the fields' slot setters, not the frozen dataclass's object.__setattr__ per field: three
        # of these and one ExpertView are made per slot load on the loop thread (8 -> 3 us)
        _set_pv_data(self, data)
        _set_pv_type(self, ggml_type)
        _set_pv_shape(self, shape)
        _set_pv_address(self, 0)

    @property
    def address(self) -> int:
        """The address of the first byte of ``data`` (found once, then kept: about 2 us saved per
        use in a decode step's compiled calls); valid while ``data`` is (the expert is pinned)."""
        address = self._address
        if not address:
            address = int(np.frombuffer(self.data, dtype=np.uint8).ctypes.data)
            _set_pv_address(self, address)
        return address

    @property
    def n_bytes(self) -> int:
        """Length of ``data`` in bytes."""
        return self.data.nbytes

    def copy(self) -> ProjectionView:
        """The same projection over a private copy of its bytes, valid after the expert is unpinned."""
        return ProjectionView(memoryview(bytes(self.data)), self.ggml_type, self.shape)


@dataclass(frozen=True, slots=True, init=False)
class ExpertView:
    """One routed expert of one MoE layer, as pinned bytes.

    Attributes:
        layer: the block index ``L`` of ``blk.L.*``.
        expert: the global expert id (the router's output index).
        bank: 0 for ``ffn_*_exps``, 1..3 for ``ffn_*_exps_tier1..3``.
        gate, up, down: the three projections. For a merged ``ffn_gate_up_exps`` tensor, ``gate``
            and ``up`` are the two halves (gate rows first) of one run.
    """

    layer: int
    expert: int
    bank: int
    gate: ProjectionView
    up: ProjectionView
    down: ProjectionView

    def __init__(
        self, layer: int, expert: int, bank: int, gate: ProjectionView, up: ProjectionView, down: ProjectionView
    ) -> None:
        _set_ev_layer(self, layer)  # as ProjectionView.__init__
        _set_ev_expert(self, expert)
        _set_ev_bank(self, bank)
        _set_ev_gate(self, gate)
        _set_ev_up(self, up)
        _set_ev_down(self, down)

    def copy(self) -> ExpertView:
        """The same expert over private copies of its bytes (``gate + up + down`` bytes of memory).

        For hosts that need the bytes after the ``experts()`` block that pinned them ends.
        """
        return ExpertView(self.layer, self.expert, self.bank, self.gate.copy(), self.up.copy(), self.down.copy())

    def release(self) -> None:
        """Release the three memoryviews (they raise ``ValueError`` when used afterwards).

        A view still exported elsewhere (e.g. wrapped by ``np.frombuffer``) cannot be released: its
        memory is slot memory that may be overwritten once the expert is unpinned, so this warns
        (``ResourceWarning``) and leaves it readable. Keep bytes past the pin with :meth:`copy`.
        The slab mode's views are shared by every request pinning the expert and released by the
        store when its slot is reused: their ``release()`` does nothing.
        """
        exported = [
            name
            for name, projection in (("gate", self.gate), ("up", self.up), ("down", self.down))
            if release_view(projection.data)
        ]
        if exported:
            warn_exported(self, exported, stacklevel=3)


def _slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The ``__set__`` of field ``name``'s slot descriptor (a frozen view's fields are set once, in ``__init__``)."""
    setter: Callable[[Any, Any], None] = vars(cls)[name].__set__
    return setter


_set_pv_data, _set_pv_type, _set_pv_shape, _set_pv_address = (
    _slot_setter(ProjectionView, n) for n in ("data", "ggml_type", "shape", "_address")
)
_set_ev_layer, _set_ev_expert, _set_ev_bank, _set_ev_gate, _set_ev_up, _set_ev_down = (
    _slot_setter(ExpertView, n) for n in ("layer", "expert", "bank", "gate", "up", "down")
)


LayoutKey = tuple[tuple[GGMLQuantizationType, ...], tuple[tuple[int, int], ...], tuple[int, int, int]]


def layout_key(view: ExpertView) -> LayoutKey:
    """The ggml types, shapes and byte counts of ``view``'s gate, up and down: experts with equal
    keys are computed by the same kernels over the same byte counts."""
    return projections_layout(view.gate, view.up, view.down)


def projections_layout(gate: Any, up: Any, down: Any) -> LayoutKey:
    """:func:`layout_key` of three projections given as anything with ``ggml_type``, ``shape`` and
    ``n_bytes`` (a :class:`ProjectionView`, or the file ``Segment`` its bytes were read from)."""
    types = (gate.ggml_type, up.ggml_type, down.ggml_type)
    return types, (gate.shape, up.shape, down.shape), (gate.n_bytes, up.n_bytes, down.n_bytes)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertTable:
    """Where every expert of one MoE layer lies while a hold keeps them in place, all of one layout.

    Attributes:
        addresses: ``(3, n_experts)`` int64, read-only: the first byte of expert ``e``'s gate, up
            and down projections at ``[0, e]``, ``[1, e]``, ``[2, e]``; the experts are there only
            while the hold that gave the table lasts (their slots may take other experts after it).
        layout: the :func:`layout_key` every expert of the layer has.
        keep: what keeps the memory behind ``addresses`` mapped while the table lives (the slab's
            bytes), so a table in use when its store closes never points at unmapped memory.

    Compared by identity (an array is no key).
    """

    addresses: np.ndarray
    layout: LayoutKey
    keep: object = field(default=None, repr=False)


def warn_exported(view: ExpertView, projections: list[str], stacklevel: int) -> None:
    """The ``ResourceWarning`` for bytes of ``view`` still used (``projections``) as it is unpinned."""
    warnings.warn(
        f"layer {view.layer} expert {view.expert}: the {'/'.join(projections)} bytes are still exported "
        "(e.g. by np.frombuffer) as the expert is unpinned; its slot may be reused under them. "
        "Drop such arrays inside the experts() block, or keep a copy (ExpertView.copy())",
        ResourceWarning,
        stacklevel=stacklevel + 1,
    )


def managed_buffer(view: memoryview) -> object:
    """The managed buffer behind ``view`` (shared by every memoryview and array made from it).

    CPython's memoryview reports it as its one referent; elsewhere the exporter stands in (then
    what it tells about arrays made from the view is only as good as the exporter's reference count).
    """
    referents = gc.get_referents(view)
    return referents[0] if len(referents) == 1 else view.obj


def release_view(view: memoryview) -> bool:
    """Release ``view``; True if something derived from it still uses its memory.

    ``np.frombuffer(view)`` holds the view's buffer, not the view itself, so ``view.release()``
    succeeds; when the view's exporting object counts the references it should have (slab
    exporters do: ``held_refs`` kept by their owner, ``live_views`` made from it), that object's
    reference count tells whether the buffer lives on. Otherwise (an exporter shared by many
    views, such as the slab's read-only bytes behind the shared views of the slab mode, or a
    foreign one) the view's managed buffer tells: anything made from the view holds it.
    """
    exporter = view.obj
    live = getattr(exporter, "live_views", None)
    buffer = managed_buffer(view) if live is None else None
    try:
        view.release()
    except BufferError:  # exported through the view itself
        return True
    if buffer is not None and buffer is not exporter:
        # a managed buffer lets go of its exporter once no view or array uses it any more (and
        # then reports no referent): whoever else holds the buffer object itself does not matter
        return bool(gc.get_referents(buffer))
    if live is not None:
        live -= 1
        exporter.live_views = live  # type: ignore[attr-defined]
    # references: this name, getrefcount's argument, those the exporter's owner declared, and one
    # per other live view of the same exporter (another request pinning the same expert)
    return sys.getrefcount(exporter) > 2 + getattr(exporter, "held_refs", 0) + (live or 0)
