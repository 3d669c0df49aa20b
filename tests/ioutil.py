"""Test helpers for the I/O path: small GGUF files, plain-pread references, segment reads."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
from gguf import GGMLQuantizationType

from aioexperts._cache.scheduler import Load, Priority, ReadScheduler
from aioexperts._cache.stats import Counters
from aioexperts._format.layout import ExpertLocation, Segment
from aioexperts._format.model import GGUFModel
from aioexperts._io.files import ShardFiles
from aioexperts._io.loop import current_loop
from aioexperts._io.plan import plan_expert
from aioexperts._io.select import create_backend
from aioexperts._io.slab import Slab

F32 = GGMLQuantizationType.F32


def pread_segment(model: GGUFModel, seg: Segment) -> bytes:
    """The reference: a plain buffered ``pread`` of the segment."""
    with open(model.shards[seg.shard].path, "rb", buffering=0) as f:
        return os.pread(f.fileno(), seg.n_bytes, seg.offset)


def open_files(paths: Sequence[Path | str], direct: bool, alignment: int | None = None) -> ShardFiles:
    """Open files like ``open_shards`` does, without a parsed model."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fds = tuple(os.open(p, flags) for p in paths)
    sizes = tuple(os.fstat(fd).st_size for fd in fds)
    return ShardFiles(fds, sizes, direct, alignment or 4096, None if direct else "test")


async def read_segments(
    paths: Sequence[Path | str],
    segments: Sequence[tuple[int, int, int]],
    *,
    backend: str = "threads",
    direct: bool = True,
    alignment: int | None = None,
) -> tuple[list[bytes], Counters, ShardFiles]:
    """Read three ``(shard, offset, n_bytes)`` segments as one "expert" through plan, scheduler and backend.

    Returns the payload bytes per segment, the counters, and the (closed) files.
    """
    assert len(segments) == 3
    files = open_files(paths, direct, alignment)
    segs = [Segment(s, off, n, F32, (1, n)) for s, off, n in segments]
    loc = ExpertLocation(0, 0, 0, 0, *segs)
    plan = plan_expert(loc, files.alignment)
    slab = Slab(1, plan.slot_bytes)
    loop = current_loop()
    backend_obj, _ = create_backend(backend, files, slab, loop, 8)
    counters = Counters()
    scheduler = ReadScheduler(backend_obj, loop, counters, files.sizes, files.dio_alignment, 1 << 30)
    done = anyio.Event()
    load = Load(plan, 0, Priority.DEMAND, lambda _load: done.set())
    try:
        scheduler.enqueue(load)
        with anyio.fail_after(10):
            await done.wait()
        if load.error is not None:
            raise load.error
        out = [bytes(slab.view(0, off, seg.n_bytes)) for off, seg in zip(plan.payload_offsets, segs, strict=True)]
    finally:
        with anyio.CancelScope(shield=True):
            await scheduler.wait_no_reads_in_flight()
        backend_obj.close()
        files.close()
        slab.close()
    return out, counters, files


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(path: Path | str, offset: int, n_bytes: int) -> int:
    """How many pages of ``[offset, offset + n_bytes)`` of ``path`` are in the page cache (``mincore``)."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    length = offset + n_bytes - start
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        addr = view.ctypes.data + start
        del view
        n_pages = -(-length // page)
        vec = (ctypes.c_ubyte * n_pages)()
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
    finally:
        mm.close()


def drop_cache(path: Path | str) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_shifted_moe(path: Path | str, target_mod: int = 1152, page: int = 4096) -> Path:
    """A tiny F32 MoE GGUF whose first gate expert starts ``target_mod`` bytes past a ``page`` boundary.

    Written twice with ``gguf.GGUFWriter``: the second time a padding tensor shifts the experts.
    """
    import gguf

    from aioexperts._format.model import open_model

    def write(pad_floats: int) -> int:
        w = gguf.GGUFWriter(os.fspath(path), "qwen3moe")
        w.add_block_count(1)
        w.add_embedding_length(256)
        w.add_expert_count(2)
        w.add_expert_used_count(1)
        w.add_expert_feed_forward_length(256)
        rng = np.random.default_rng(1)
        if pad_floats:
            w.add_tensor("pad.weight", np.zeros(pad_floats, dtype=np.float32))
        w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((2, 256), dtype=np.float32))
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", rng.standard_normal((2, 256, 256), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return open_model(path).tensor("blk.0.ffn_gate_exps.weight").data_offset

    offset = write(8)  # with the padding tensor's info in the header; its size moves only the data
    offset = write(8 + (target_mod - offset) % page // 4)
    assert offset % page == target_mod, offset
    return Path(path)


def fd_flags_of(path: str | os.PathLike[str]) -> list[int]:
    """The open-file flags of every descriptor this process holds on ``path`` (``/proc/self/fdinfo``)."""
    target = os.path.realpath(path)
    flags = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != target:
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                flags.extend(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
        except OSError:  # closed meanwhile
            continue
    return flags
