"""Does an ``O_DIRECT`` read really bypass the page cache? The file system's type and a residency probe.

An ``O_DIRECT`` open and an aligned read that succeed do not prove it: tmpfs and ramfs accept
``O_DIRECT`` (Linux 6.6 and later) and serve the read from the page cache, where their files live;
overlayfs hands ``O_DIRECT`` on to the file of its upper or lower layer, so an overlay over tmpfs
does the same while ``statfs`` says only "overlayfs"; and a file system may quietly turn an
``O_DIRECT`` read into a buffered one. Reporting ``direct_io=True`` there would be false (the reads
come from memory, and the cold-read figures with them). So, besides the alignment probe
(:func:`aioexperts._io.align.probe_alignment`, which names tmpfs and ramfs by their type):

- an overlayfs file's layers are looked up in ``/proc/self/mountinfo`` (``upperdir``, ``lowerdir``,
  ``lowerdir+``, ``datadir+``) and their ``statfs`` types taken;
- one page of the file is dropped from the page cache (``POSIX_FADV_DONTNEED``), its residency
  taken with ``mincore`` on a shared mapping, the page read with ``O_DIRECT``, and its residency
  taken again. A page that a real ``O_DIRECT`` read brought in means the read went through the
  cache; a page still resident after ``DONTNEED`` is one the cache cannot drop (tmpfs, ramfs) or
  one mapped or dirty elsewhere. Where ``mincore`` would not tell this process the truth
  (:func:`aioexperts._io.mapping.residency_trusted`: a file it neither owns nor may write, without
  ``CAP_FOWNER``) the probe is left out.

:func:`page_cache_reason` decides from those facts (a pure function, tested with injected
values); :func:`probe_page_cache` gathers them for an open ``O_DIRECT`` descriptor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
from dataclasses import dataclass

from .align import PAGE_CACHE_FILESYSTEMS, align_down, filesystem_type
from .mapping import residency_facts, residency_trusted

__all__ = (
    "OVERLAYFS_MAGIC",
    "CacheFacts",
    "overlay_layers",
    "page_cache_reason",
    "page_resident",
    "probe_page_cache",
)

#: ``statfs`` ``f_type`` of overlayfs.
OVERLAYFS_MAGIC = 0x794C7630
_MOUNTINFO = "/proc/self/mountinfo"
_LAYER_KEYS = ("upperdir", "lowerdir", "lowerdir+", "datadir+")


@dataclass(frozen=True, slots=True)
class CacheFacts:
    """What is known about one file's reads (None: not known).

    Attributes:
        fs_type: ``statfs`` ``f_type`` of the file's file system.
        layer_types: for overlayfs, the ``statfs`` types of its layers (upper first).
        resident_before: the probed page was in the page cache after ``POSIX_FADV_DONTNEED``.
        resident_after: it was in the page cache after the ``O_DIRECT`` read of it.
    """

    fs_type: int | None
    layer_types: tuple[int | None, ...] | None = None
    resident_before: bool | None = None
    resident_after: bool | None = None


def _fs_name(fs_type: int | None) -> str:
    if fs_type is None:
        return "an unknown file system"
    return PAGE_CACHE_FILESYSTEMS.get(fs_type, f"statfs f_type {fs_type:#010x}")


def page_cache_reason(facts: CacheFacts) -> str | None:
    """Why ``O_DIRECT`` reads of the file would still be served by the page cache, or None.

    - the file system is tmpfs or ramfs: always;
    - the ``O_DIRECT`` read brought the probed page into the cache: always (a buffered fallback);
    - overlayfs: when every layer is tmpfs or ramfs; when none is, never; otherwise (mixed or
      unknown layers) when the probed page is resident before or after the read, and, without a
      probe, when a layer is tmpfs or ramfs.
    """
    if facts.fs_type in PAGE_CACHE_FILESYSTEMS:
        return f"the file is on {_fs_name(facts.fs_type)}, where O_DIRECT reads still use the page cache"
    if facts.resident_before is False and facts.resident_after is True:
        return "an O_DIRECT read of the file filled the page cache (the file system serves O_DIRECT reads from it)"
    if facts.fs_type != OVERLAYFS_MAGIC:
        return None
    layers = facts.layer_types
    cached = [t for t in layers or () if t in PAGE_CACHE_FILESYSTEMS]
    if layers and len(cached) == len(layers):
        names = ", ".join(sorted({_fs_name(t) for t in cached}))
        return f"the file is on overlayfs over {names}, where O_DIRECT reads still use the page cache"
    if layers and all(t is not None for t in layers) and not cached:
        return None
    if facts.resident_before or facts.resident_after:
        return (
            "the file is on overlayfs and the page an O_DIRECT read probed stays in the page cache "
            "(a tmpfs or ramfs layer holds it)"
        )
    if facts.resident_before is None and cached:
        return "the file is on overlayfs with a tmpfs or ramfs layer, and the page cache could not be probed"
    return None


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space, ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), text)


def _split_layers(value: str) -> list[str]:
    return [_unescape(p.replace("\\:", ":")) for p in re.split(r"(?<!\\):", value) if p]


def overlay_layers(path: str | os.PathLike[str], mountinfo: str | None = None) -> list[str] | None:
    """The layer folders (upper first, then the lower ones) of the overlayfs mount holding ``path``.

    Args:
        path: a file.
        mountinfo: the text of ``/proc/self/mountinfo`` (read when None).

    Returns:
        The folders, or None when ``path`` is not on an overlayfs mount or its options cannot be read.
    """
    try:
        real = os.path.realpath(path)
        if mountinfo is None:
            with open(_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
    except OSError:
        return None
    best: tuple[int, str, str] | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            tail = right.split(" ")
            if len(tail) >= 3:
                best = (len(point), tail[0], tail[2])
    if best is None or best[1] != "overlay":
        return None
    layers: dict[str, list[str]] = {k: [] for k in _LAYER_KEYS}
    for option in best[2].split(","):
        key, eq, value = option.partition("=")
        if eq and key in layers:
            layers[key].extend(_split_layers(value))
    found = [*layers["upperdir"], *layers["lowerdir"], *layers["lowerdir+"], *layers["datadir+"]]
    return found or None


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_resident(fd: int, offset: int) -> bool | None:
    """Whether the page of ``fd`` at ``offset`` (a multiple of the page size) is in the page cache.

    ``mincore`` on a one-page shared read-only mapping; None when that cannot be done.
    """
    if _LIBC is None:
        return None
    page = mmap.PAGESIZE
    addr = _LIBC.mmap(None, page, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = (ctypes.c_ubyte * 1)()
        if _LIBC.mincore(addr, page, vec) != 0:
            return None
        return bool(vec[0] & 1)
    finally:
        _LIBC.munmap(addr, page)


def probe_page_cache(fd: int, path: str, size: int, unit: int) -> CacheFacts:
    """The facts :func:`page_cache_reason` decides on, for ``fd`` opened with ``O_DIRECT``.

    Blocking: one ``statfs`` (and, on overlayfs, mountinfo and one ``statfs`` per layer), the
    facts of :func:`aioexperts._io.mapping.residency_facts`, one ``POSIX_FADV_DONTNEED`` and one
    ``O_DIRECT`` read of ``unit`` bytes at the file's last ``unit``-aligned offset (tensor data,
    which the header parse has not read), two ``mincore``.

    Raises:
        OSError: the ``O_DIRECT`` read fails.
    """
    fs_type = filesystem_type(path)
    layer_types: tuple[int | None, ...] | None = None
    if fs_type == OVERLAYFS_MAGIC:
        layers = overlay_layers(path)
        if layers is not None:
            layer_types = tuple(filesystem_type(p) for p in layers)
    if size <= 0 or not residency_trusted(residency_facts(fd, path)):
        return CacheFacts(fs_type, layer_types)  # mincore would say "resident" of every page
    offset = align_down(size - 1, max(unit, mmap.PAGESIZE))
    try:
        os.posix_fadvise(fd, offset, unit, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # then "resident before" may be true of a disk file too: only overlayfs looks at it
    before = page_resident(fd, offset)
    buf = mmap.mmap(-1, max(unit, mmap.PAGESIZE))
    try:
        with memoryview(buf) as view:
            os.preadv(fd, [view[:unit]], offset)
    finally:
        buf.close()
    after = page_resident(fd, offset)
    return CacheFacts(fs_type, layer_types, before, after)
