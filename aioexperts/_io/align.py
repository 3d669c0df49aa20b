"""The direct-I/O alignment rule and the widening of byte ranges to it.

With ``O_DIRECT`` the file offset, the length and the memory address of a read must be multiples
of the device's direct-I/O alignment. Linux reports it through ``statx`` with ``STATX_DIOALIGN``
(``stx_dio_mem_align``, ``stx_dio_offset_align``, Linux >= 6.1). Python 3.11 has no ``os.statx``,
so it is called through ctypes. When the call or the field is unavailable, 4096 is used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass

__all__ = ("DEFAULT_ALIGNMENT", "DirectIOAlignment", "align_down", "align_up", "probe_alignment", "widen")

DEFAULT_ALIGNMENT = 4096
STATX_DIOALIGN = 0x00002000
_AT_FDCWD = -100
_STATX_BUF = 256
_DIO_OFFSETS = struct.Struct("<II")  # stx_dio_mem_align, stx_dio_offset_align at byte 152


@dataclass(frozen=True, slots=True)
class DirectIOAlignment:
    """How reads of one file must be aligned.

    Attributes:
        memory: required buffer address alignment in bytes.
        offset: required file offset and length alignment in bytes.
        source: ``"statx"`` when the kernel reported it, ``"default"`` when 4096 was assumed.
        direct_io_supported: False when statx says this file system has no real direct I/O
            (``tmpfs``: the DIOALIGN bit comes back clear); then reads should be buffered.
    """

    memory: int
    offset: int
    source: str
    direct_io_supported: bool

    @property
    def unit(self) -> int:
        """One alignment that satisfies both rules (bytes, a power of two)."""
        return max(self.memory, self.offset)


def _libc_statx() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_STATX = _libc_statx()


def probe_alignment(path: str | os.PathLike[str]) -> DirectIOAlignment:
    """Ask the kernel for the direct-I/O alignment of ``path``.

    Blocking (one ``statx``). Never raises for a missing ``statx``: falls back to 4096.

    Raises:
        OSError: ``path`` cannot be stat'ed (for example it does not exist).
    """
    if _STATX is None:
        return DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "default", True)
    buf = ctypes.create_string_buffer(_STATX_BUF)
    rc = _STATX(_AT_FDCWD, os.fsencode(path), 0, STATX_DIOALIGN, buf)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (38, 22):  # ENOSYS, EINVAL: an old kernel
            return DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "default", True)
        raise OSError(err, os.strerror(err), os.fspath(path))
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    if not mask & STATX_DIOALIGN:
        return DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "default", False)
    mem, off = _DIO_OFFSETS.unpack_from(buf.raw, 152)
    if mem == 0 or off == 0:  # the file system reports no direct-I/O support for this file
        return DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "statx", False)
    if mem & (mem - 1) or off & (off - 1):
        return DirectIOAlignment(DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT, "default", True)
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
