"""Rows of a 2-D tensor read a few at a time: row windows and their aligned reads.

Some models keep tables too large to hold in memory that are read a few rows per token (token
embeddings of large vocabularies, per-layer embedding or n-gram tables; docs/notes/FORMATS.md section 4).
Rows are grouped into *windows*, each read with one aligned read and cached as a unit, so rows
that share a window are read once. For rows smaller than the alignment unit ``A`` (a ``Q2_K`` row
of 256 values is 84 bytes), window ``2p`` is page ``p`` of the file and serves every row that lies
wholly inside it (one ``A``-byte read); the few rows that cross from page ``p`` into page ``p + 1``
are served by window ``2p + 1``, which reads both pages. A row of ``A`` bytes or more is a window of
its own. Either way a row is one contiguous run of slot memory: a zero-copy view.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._errors import InvalidRequestError, UnsupportedTypeError
from .._format.model import TensorInfo
from .align import align_up, widen
from .plan import PlannedRead

__all__ = ("RowTable", "RowWindowPlan")


@dataclass(frozen=True, slots=True)
class RowWindowPlan:
    """The read of one window of rows (a :class:`~aioexperts._io.plan.LoadPlan`).

    Attributes:
        key: ``(table, window)``: the table's index in the store and the window's.
        reads: the one aligned read of the window.
        file_offset: where that read starts in the file (bytes): a row starting at byte ``b``
            of the file is at slot offset ``b - file_offset``.
        payload_bytes: bytes of the rows the window serves.
        table_name: the tensor's name, for messages.
    """

    key: tuple[int, int]
    reads: tuple[PlannedRead, ...]
    file_offset: int
    payload_bytes: int
    table_name: str

    @property
    def read_bytes(self) -> int:
        """Bytes the read requests."""
        return sum(r.n_bytes for r in self.reads)

    @property
    def what(self) -> str:
        """What the plan loads, for messages."""
        return f"window {self.key[1]} of {self.table_name}"


@dataclass(frozen=True, slots=True)
class RowTable:
    """A 2-D tensor read by rows.

    Attributes:
        index: the table's number in the store (the first half of its window keys).
        tensor: the tensor (numpy shape ``(n_rows, n_cols)``).
        row_bytes: bytes of one row (``n_cols / block_size * type_size``).
        alignment: bytes every read is aligned to (``A``).
        file_size: the size of the tensor's shard (reads are clipped to it).
    """

    index: int
    tensor: TensorInfo
    row_bytes: int
    alignment: int
    file_size: int

    @classmethod
    def of(cls, index: int, tensor: TensorInfo, alignment: int, file_size: int) -> RowTable:
        """The row geometry of ``tensor``.

        Raises:
            InvalidRequestError: the tensor is not 2-D.
            UnsupportedTypeError: its ggml type has no known block layout.
        """
        if len(tensor.shape) != 2:
            raise InvalidRequestError(f"{tensor.name} has shape {tensor.shape}: rows are read from 2-D tensors only")
        qtype = GGMLQuantizationType(tensor.ggml_type)
        if qtype not in GGML_QUANT_SIZES:
            raise UnsupportedTypeError(f"{tensor.name}: ggml type {qtype.name} has no known block layout")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        return cls(index, tensor, tensor.shape[1] // block_size * type_size, alignment, file_size)

    @property
    def n_rows(self) -> int:
        """Rows of the table."""
        return int(self.tensor.shape[0])

    @property
    def small_rows(self) -> bool:
        """Rows shorter than the alignment unit: windows are pages."""
        return self.row_bytes < self.alignment

    @property
    def slot_bytes(self) -> int:
        """A slot that holds any window of this table, aligned."""
        if self.small_rows:
            return 2 * self.alignment
        return align_up(self.row_bytes, self.alignment) + self.alignment

    def row_offset(self, row: int) -> int:
        """Where ``row`` starts in the file (bytes)."""
        return self.tensor.data_offset + row * self.row_bytes

    def window_of(self, row: int) -> int:
        """The window that serves ``row``."""
        if not self.small_rows:
            return row
        start = self.row_offset(row)
        page = start // self.alignment
        return 2 * page + (1 if (start + self.row_bytes - 1) // self.alignment != page else 0)

    def plan(self, window: int) -> RowWindowPlan:
        """The aligned read of ``window``."""
        a = self.alignment
        if self.small_rows:
            page, crossing = divmod(window, 2)
            start, end = page * a, (page + 1 + crossing) * a
            first_byte = max(start, self.tensor.data_offset)
            last_byte = min(end, self.tensor.data_offset + self.tensor.n_bytes)
            useful = last_byte - first_byte if not crossing else self.row_bytes
        else:
            first_byte = self.row_offset(window)
            last_byte = first_byte + self.row_bytes
            start, length, _ = widen(first_byte, self.row_bytes, a)
            end = start + length
            useful = self.row_bytes
        end = min(end, align_up(self.file_size, a))
        read = PlannedRead(self.tensor.shard, start, end - start, 0, last_byte - start)
        return RowWindowPlan((self.index, window), (read,), start, useful, self.tensor.name)
