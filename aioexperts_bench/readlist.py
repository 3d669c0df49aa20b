"""The list of reads the store issued: one source of work for every method of the read bench.

A :class:`ReadList` holds ``(shard, aligned offset, length)`` rows in submission order, as
recorded from the store's backend during a cold pass. fio replays it through an iolog
(:meth:`ReadList.write_fio_iolog`), the thread pool, buffered ``pread`` and mmap baselines
replay it in Python, so every method reads exactly the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ("ReadList", "expert_read_list")


@dataclass(frozen=True)
class ReadList:
    """Reads in submission order.

    Attributes:
        paths: the files, indexed by the ``shard`` column.
        reads: int64 ``(n, 3)``: shard, file offset (bytes), length (bytes).
    """

    paths: tuple[str, ...]
    reads: np.ndarray

    def __len__(self) -> int:
        return len(self.reads)

    @property
    def total_bytes(self) -> int:
        """Bytes requested by all reads (a read at end of file may return fewer)."""
        return int(self.reads[:, 2].sum()) if len(self.reads) else 0

    @property
    def max_len(self) -> int:
        """The longest read in bytes."""
        return int(self.reads[:, 2].max()) if len(self.reads) else 0

    @property
    def median_len(self) -> int:
        """The median read length in bytes."""
        return int(np.median(self.reads[:, 2])) if len(self.reads) else 0

    def expected_bytes(self) -> int:
        """Bytes the reads return: each clipped at the end of its file."""
        sizes = np.array([os.path.getsize(p) for p in self.paths], dtype=np.int64)
        ends = np.minimum(self.reads[:, 1] + self.reads[:, 2], sizes[self.reads[:, 0]])
        return int(np.maximum(ends - self.reads[:, 1], 0).sum())

    def destinations(self) -> np.ndarray:
        """Byte offset of each read in a buffer holding them all side by side (int64 ``(n,)``)."""
        return np.concatenate(([0], np.cumsum(self.reads[:-1, 2]))).astype(np.int64) if len(self.reads) else self.reads

    def same_reads(self, other: ReadList) -> bool:
        """True when both lists hold the same reads (in any order)."""
        if self.paths != other.paths or len(self) != len(other):
            return False
        key = np.lexsort(self.reads.T[::-1])
        other_key = np.lexsort(other.reads.T[::-1])
        return bool(np.array_equal(self.reads[key], other.reads[other_key]))

    def write_fio_iolog(self, path: str | os.PathLike[str]) -> None:
        """Write a fio ``read_iolog`` file (version 2): ``add`` and ``open`` each file, then the reads.

        File names with whitespace cannot be written in this format.

        Raises:
            ValueError: a file name contains whitespace.
        """
        for p in self.paths:
            if any(c.isspace() for c in p):
                raise ValueError(f"fio's iolog cannot name a file with whitespace: {p!r}")
        lines = ["fio version 2 iolog"]
        lines += [f"{p} add" for p in self.paths]
        lines += [f"{p} open" for p in self.paths]
        names = self.paths
        lines += [f"{names[s]} read {off} {n}" for s, off, n in self.reads.tolist()]
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def resized(self, n_bytes: int) -> ReadList:
        """The same byte ranges cut into reads of at most ``n_bytes`` (a multiple of 4096).

        Consecutive reads are not merged: with ``n_bytes`` above every read's length the list
        is unchanged.
        """
        if n_bytes < 4096 or n_bytes % 4096:
            raise ValueError(f"read size must be a positive multiple of 4096, got {n_bytes}")
        rows: list[tuple[int, int, int]] = []
        for shard, off, n in self.reads.tolist():
            rows.extend((shard, off + start, min(n_bytes, n - start)) for start in range(0, n, n_bytes))
        return ReadList(self.paths, np.asarray(rows, dtype=np.int64).reshape(-1, 3))

    @classmethod
    def from_rows(cls, paths: Sequence[str], rows: Sequence[Sequence[int]]) -> ReadList:
        """From ``(shard, offset, length)`` rows."""
        return cls(tuple(paths), np.asarray(rows, dtype=np.int64).reshape(-1, 3))


def expert_read_list(model: Any, layout: Any, n_bytes: int, *, seed: int, alignment: int = 4096) -> ReadList:
    """Aligned reads of random experts of ``model`` (a token's worth per layer at a time), about ``n_bytes``.

    Experts are drawn without replacement over the whole model (no expert twice, so a replay is cold
    after a page-cache drop), in groups of ``n_expert_used`` of one layer, planned as the store plans
    them (:func:`aioexperts._io.plan.plan_expert`); stops at ``n_bytes`` or when every expert is used.
    """
    from aioexperts._io.plan import plan_expert

    rng = np.random.default_rng(seed)
    keys = [(layer, e) for layer in layout.layers for e in range(layout.layers[layer].n_experts)]
    rows: list[tuple[int, int, int]] = []
    total = 0
    for i in rng.permutation(len(keys)):
        if total >= n_bytes:
            break
        for r in plan_expert(layout.locate(*keys[i]), alignment).reads:
            rows.append((r.shard, r.file_offset, r.n_bytes))
            total += r.n_bytes
    return ReadList(tuple(s.path for s in model.shards), np.asarray(rows, dtype=np.int64).reshape(-1, 3))
