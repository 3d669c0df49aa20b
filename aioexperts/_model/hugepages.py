"""Buffers on transparent huge pages for the resident dense weights (attention, head, dense FFNs).

A decode token streams every resident dense matrix from memory once (on the 48-layer built-in model
about a gigabyte of Q8_0 attention weights). On 4 KiB pages that is a TLB miss per page and the
hardware prefetchers stop at every page boundary; the expert slab is on 2 MiB pages already
(:class:`aioexperts._io.slab.Slab`). With THP in ``madvise`` mode (a common default) anonymous
memory gets huge pages only when advised: :func:`huge_empty` maps, aligns and advises. The
one-token Q8_0 and Q4_K products streamed from such memory ran 8-12 % faster than from ``malloc``'d
pages (one thread, AMD EPYC Zen 4; ``bench/model_speed.py`` measures the whole token).
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

from aioexperts._io.slab import HUGE_PAGE_SIZE

log = logging.getLogger(__name__)

#: buffers of fewer bytes come from numpy (a huge page would be mostly empty)
MIN_BYTES = HUGE_PAGE_SIZE


def huge_empty(n_bytes: int) -> np.ndarray:
    """A writable ``(n_bytes,)`` uint8 array, uninitialised (zero pages until written).

    From ``MIN_BYTES`` on it starts on a 2 MiB boundary of an anonymous private mapping whose whole
    2 MiB pages are advised ``MADV_HUGEPAGE`` (the last part page stays on 4 KiB pages: the
    resident size is the tensor's); the mapping lives as long as the array or a view of it. Below
    that, or where the kernel has no THP advice, it is ``np.empty``. The advice is a hint: a kernel
    out of huge pages backs the memory with small ones and nothing else changes.

    Raises:
        MemoryError: the mapping failed (out of address space or memory).
    """
    if n_bytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(n_bytes, dtype=np.uint8)
    mapped = n_bytes + HUGE_PAGE_SIZE  # room to start on a boundary; untouched pages cost nothing
    try:
        mm = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise MemoryError(f"cannot map {mapped} bytes for resident weights: {exc}") from exc
    whole = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive
    start = -whole.ctypes.data % HUGE_PAGE_SIZE
    try:
        # whole huge pages only: the tail stays on small pages, so no memory is added to the weights
        mm.madvise(mmap.MADV_HUGEPAGE, start, n_bytes // HUGE_PAGE_SIZE * HUGE_PAGE_SIZE)
    except OSError as exc:  # an older kernel: only a missed optimisation
        log.debug("MADV_HUGEPAGE on resident weights failed: %s", exc)
    return whole[start : start + n_bytes]
