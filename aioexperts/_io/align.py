"""The direct-I/O alignment rule and the widening of byte ranges to it.

With ``O_DIRECT`` the file offset, the length and the memory address of a read must be multiples
of the device's direct-I/O alignment. Linux reports it through ``statx`` with ``STATX_DIOALIGN``
(``stx_dio_mem_align``, ``stx_dio_offset_align``, Linux >= 6.1). Python 3.11 has no ``os.statx``,
so it is called through ctypes. Kernels before 6.1 simply leave the bit clear: then 4096 is
assumed and the caller finds out with an ``O_DIRECT`` open and one aligned read whether direct
I/O works. File systems that accept ``O_DIRECT`` but serve it from the page cache (tmpfs, ramfs)
are recognised by their ``statfs`` type, whatever the kernel reports.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from dataclasses import dataclass

__all__ = (
    "DEFAULT_ALIGNMENT",
    "PAGE_CACHE_FILESYSTEMS",
    "DirectIOAlignment",
    "align_down",
    "align_up",
    "filesystem_type",
    "probe_alignment",
    "widen",
)

DEFAULT_ALIGNMENT = 4096
STATX_DIOALIGN = 0x00002000
TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6
#: ``statfs`` ``f_type`` of file systems where ``O_DIRECT`` is accepted but reads still go
#: through the page cache, by name.
PAGE_CACHE_FILESYSTEMS = {TMPFS_MAGIC: "tmpfs", RAMFS_MAGIC: "ramfs"}
_AT_FDCWD = -100
_STATX_BUF = 256
_STATFS_BUF = 256  # struct statfs is 120 bytes on x86-64 and arm64; f_type comes first
_DIO_OFFSETS = struct.Struct("<II")  # stx_dio_mem_align, stx_dio_offset_align at byte 152


@dataclass(frozen=True, slots=True)
class DirectIOAlignment:
    """How reads of one file must be aligned.

    Attributes:
        memory: required buffer address alignment in bytes.
        offset: required file offset and length alignment in bytes.
        source: ``"statx"`` when the kernel reported it, ``"default"`` when 4096 was assumed
            (kernels before 6.1 do not report it).
        direct_io_supported: False when this file system has no real direct I/O (tmpfs and ramfs,
            known by their ``statfs`` type, or a file statx reports no direct-I/O support for);
            then reads should be buffered. True means "worth trying": the open and a probe read
            decide.
        reason: why direct I/O is not supported, else None.
    """

    memory: int
    offset: int
    source: str
    direct_io_supported: bool
    reason: str | None = None

    @property
    def unit(self) -> int:
        """One alignment that satisfies both rules (bytes, a power of two)."""
        return max(self.memory, self.offset)


def _libc_function(name: str, argtypes: list[type]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_STATX = _libc_function("statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p])
_STATFS = _libc_function("statfs", [ctypes.c_char_p, ctypes.c_void_p])


def statx_dioalign(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """``(stx_mask, stx_dio_mem_align, stx_dio_offset_align)`` of ``path``, or None without ``statx``.

    The alignments are meaningful only when ``stx_mask`` has ``STATX_DIOALIGN`` (Linux >= 6.1).

    Raises:
        OSError: ``path`` cannot be stat'ed.
    """
    if _STATX is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_BUF)
    if _STATX(_AT_FDCWD, os.fsencode(path), 0, STATX_DIOALIGN, buf) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL):  # a kernel without statx, or without this mask
            return None
        raise OSError(err, os.strerror(err), os.fspath(path))
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    mem, off = _DIO_OFFSETS.unpack_from(buf.raw, 152)
    return mask, mem, off


def filesystem_type(path: str | os.PathLike[str]) -> int | None:
    """The ``statfs`` ``f_type`` magic of the file system holding ``path``, or None if unknown."""
    if _STATFS is None:
        return None
    buf = ctypes.create_string_buffer(_STATFS_BUF)
    if _STATFS(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def probe_alignment(path: str | os.PathLike[str]) -> DirectIOAlignment:
    """Ask the kernel for the direct-I/O alignment of ``path``.

    Blocking (one ``statfs`` and one ``statx``). Without ``statx`` or without ``STATX_DIOALIGN``
    (Linux < 6.1) the alignment is 4096 and direct I/O is still worth trying, unless the file
    system is one that serves ``O_DIRECT`` from the page cache.

    Raises:
        OSError: ``path`` cannot be stat'ed (for example it does not exist).
    """
    default = DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "default", True)
    answer = statx_dioalign(path)
    fs_type = filesystem_type(path)
    if fs_type in PAGE_CACHE_FILESYSTEMS:
        name = PAGE_CACHE_FILESYSTEMS[fs_type]
        return DirectIOAlignment(
            DEFAULT_ALIGNMENT,
            DEFAULT_ALIGNMENT,
            "default",
            False,
            f"the file is on {name} (statfs f_type {fs_type:#010x}), where O_DIRECT reads still use the page cache",
        )
    if answer is None:
        return default
    mask, mem, off = answer
    if not mask & STATX_DIOALIGN:  # Linux < 6.1 (or a file system that does not say): try it
        return default
    if mem == 0 or off == 0:
        return DirectIOAlignment(
            DEFAULT_ALIGNMENT,
            DEFAULT_ALIGNMENT,
            "statx",
            False,
            "statx reports no direct-I/O support for this file (STATX_DIOALIGN with zero alignment)",
        )
    if mem & (mem - 1) or off & (off - 1):
        return default
    return DirectIOAlignment(mem, off, "statx", True)


def align_down(value: int, alignment: int) -> int:
    """``value`` rounded down to a multiple of ``alignment`` (a power of two)."""
    return value & ~(alignment - 1)


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def widen(offset: int, n_bytes: int, alignment: int) -> tuple[int, int, int]:
    """Widen the byte range ``[offset, offset + n_bytes)`` to aligned bounds.

    Args:
        offset: first byte of the payload in the file.
        n_bytes: payload length in bytes (>= 0).
        alignment: a power of two, in bytes.

    Returns:
        ``(aligned_offset, aligned_length, payload_start)``: read ``aligned_length`` bytes at
        ``aligned_offset``; the payload starts ``payload_start`` bytes into what was read.
    """
    start = align_down(offset, alignment)
    return start, align_up(offset + n_bytes, alignment) - start, offset - start
