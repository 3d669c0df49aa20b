"""What a host receives for one pinned expert: zero-copy views of its raw ggml bytes and their layout."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

__all__ = ("ExpertView", "ProjectionView")


@dataclass(frozen=True, slots=True)
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

    @property
    def n_bytes(self) -> int:
        """Length of ``data`` in bytes."""
        return self.data.nbytes


@dataclass(frozen=True, slots=True)
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

    def release(self) -> None:
        """Release the three memoryviews (they raise ``ValueError`` when used afterwards).

        A view still exported elsewhere (e.g. wrapped by a numpy array) cannot be released; it is
        left as it is and stays readable, but its slot may be reused once the expert is unpinned.
        """
        for projection in (self.gate, self.up, self.down):
            try:
                projection.data.release()
            except BufferError:
                pass
