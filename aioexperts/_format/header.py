"""A bounded reader of the GGUF header: metadata and tensor infos, every read checked against the file size.

The file is untrusted input. This module reads it with plain ``pread`` calls through a small window
(no ``mmap``, so a file truncated while it is parsed raises :class:`~aioexperts._errors.FormatError`
instead of ``SIGBUS``), checks every count and length against the bytes that are left before it
reads or loops, and keeps only plain Python values. The ``gguf`` package supplies the format's
constants (``GGUFValueType``); no private part of it is used, so its reader may change between the
versions ``pyproject.toml`` allows without changing what is accepted here.

The rules follow llama.cpp's own reader, ``gguf_init_from_reader`` in ``ggml/src/gguf.cpp``:
magic ``GGUF``, version 2 or 3 (1 is refused, a version whose low 16 bits are 0 is a file of the
other byte order), ``u64`` tensor and key/value counts, a non-empty key that appears once, strings
as ``u64`` length + bytes, arrays as ``u32`` item type + ``u64`` count + items, ``general.alignment``
of type ``u32`` and a power of two, tensor data starting at the first aligned offset after the
tensor infos. Where this reader is more lenient than llama.cpp it says so:

- **Nested arrays** (an array whose items are arrays, as ``gguf-py``'s writer can produce) are read
  as nested lists, each inner array with its own item type (its first inner array may be empty).
  llama.cpp refuses such a file ("invalid GGUF type"); the experts of a file it cannot run can
  still be streamed. Nesting deeper than :data:`MAX_ARRAY_DEPTH` is refused.
- **Strings that are not valid UTF-8** are kept: llama.cpp stores metadata strings as raw bytes.
  They decode with U+FFFD replacements into a :class:`LossyStr`, whose ``raw`` attribute holds the
  bytes; only the values aioexperts reads (``general.architecture`` and the MoE keys) must decode,
  and those raise :class:`~aioexperts._errors.FormatError` naming the key.
- **Large values** (arrays of more than :data:`MAX_DECODED_ITEMS` items, strings longer than
  :data:`MAX_DECODED_STRING`) are not copied out of the file: their key maps to a
  :class:`SkippedValue` that records the item type, the length (``len()`` works) and where the
  bytes are, so that defaults that depend on, say, the vocabulary size
  (``len(tokenizer.ggml.tokens)``) can still see it.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

from .._errors import FormatError

__all__ = (
    "MAX_ARRAY_DEPTH",
    "MAX_DECODED_ITEMS",
    "MAX_DECODED_STRING",
    "GGUFHeader",
    "LossyStr",
    "RawTensorInfo",
    "SkippedValue",
    "read_header",
)

GGUF_MAGIC = b"GGUF"
#: GGUF versions read (llama.cpp: version 1 is "no longer supported", above 3 is too new).
SUPPORTED_VERSIONS = (2, 3)
#: Arrays with more items than this (counting the leaves of nested arrays) stay in the file.
MAX_DECODED_ITEMS = 4096
#: Strings longer than this many bytes stay in the file.
MAX_DECODED_STRING = 64 << 20
#: Nesting depth of arrays of arrays (1 = a plain array).
MAX_ARRAY_DEPTH = 8
#: ggml's ``GGML_MAX_DIMS``.
MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
_WINDOW = 1 << 20

# scalar value types: struct format (little-endian) and numpy dtype for arrays of them
_SCALARS: dict[GGUFValueType, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<b", "<i1"),  # one byte; llama.cpp reads it as int8 and tests != 0
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class LossyStr(str):
    """A metadata string that is not valid UTF-8: the text with U+FFFD replacements.

    It is a ``str`` (so code that only displays metadata keeps working); ``raw`` holds the bytes
    exactly as the file has them, which is what llama.cpp keeps.
    """

    __slots__ = ("raw",)
    raw: bytes

    def __new__(cls, raw: bytes) -> LossyStr:
        self = super().__new__(cls, raw.decode("utf-8", errors="replace"))
        self.raw = bytes(raw)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (LossyStr, (self.raw,))


@dataclass(frozen=True, slots=True)
class SkippedValue:
    """A large metadata value left in the file (a vocabulary, a merge list, a huge string).

    ``len()`` gives its length without reading it.

    Attributes:
        key: the metadata key.
        value_type: ``GGUFValueType.ARRAY`` or ``GGUFValueType.STRING``.
        item_type: for an array, the type of its items (``ARRAY`` for an array of arrays); None
            for a string.
        length: items of the (outer) array, or bytes of the string.
        offset: absolute file offset of the first item (of the first string byte).
        n_bytes: bytes the items occupy from ``offset``.
    """

    key: str
    value_type: GGUFValueType
    item_type: GGUFValueType | None
    length: int
    offset: int
    n_bytes: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class RawTensorInfo:
    """One tensor info record as the file has it (checked against the file by ``model.py``).

    Attributes:
        name: tensor name.
        dims: ggml dims, fastest first.
        ggml_type: the raw ggml type number.
        offset: the offset relative to the start of the tensor data.
        record_offset: absolute offset of the record (for messages).
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    record_offset: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """The parsed header of one GGUF file.

    Attributes:
        version: GGUF version (2 or 3).
        metadata: key -> ``int``, ``float``, ``bool``, ``str`` (:class:`LossyStr` when not UTF-8),
            ``list`` (nested for arrays of arrays) or :class:`SkippedValue`, in file order.
        value_types: key -> the value's ``GGUFValueType`` as stored (``ARRAY`` for arrays).
        tensors: the tensor info records, in file order.
        alignment: ``general.alignment`` (32 when absent).
        data_start: absolute offset of the tensor data (aligned); it may lie past the end of a
            truncated file, the caller checks.
    """

    version: int
    metadata: dict[str, Any]
    value_types: dict[str, GGUFValueType]
    tensors: list[RawTensorInfo]
    alignment: int
    data_start: int


class _Cursor:
    """Sequential reads from an open file, each checked against the size the file had at open."""

    __slots__ = ("_buf", "_buf_start", "_fd", "_path", "pos", "size")

    def __init__(self, fd: int, size: int, path: str) -> None:
        self._fd = fd
        self._path = path
        self.size = size
        self.pos = 0
        self._buf = b""
        self._buf_start = 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise FormatError(
                f"{self._path}: {what} at byte {self.pos} needs {n} bytes, but the file ends at byte "
                f"{self.size}: truncated or corrupt (runs past the end of the file)"
            )

    def _window(self, n: int) -> int:
        """Make ``[pos, pos+n)`` available in ``_buf`` and return its start index there."""
        start = self.pos - self._buf_start
        if 0 <= start and start + n <= len(self._buf):
            return start
        want = min(max(n, _WINDOW), self.size - self.pos)
        data = os.pread(self._fd, want, self.pos)
        if len(data) < n:
            raise FormatError(
                f"{self._path}: the file is shorter than when it was opened ({self.pos + len(data)} "
                f"bytes readable, {self.size} expected): truncated while it was parsed"
            )
        self._buf, self._buf_start = data, self.pos
        return 0

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        if n > _WINDOW:  # a big string: one read, not through the window
            data = os.pread(self._fd, n, self.pos)
            if len(data) != n:
                raise FormatError(f"{self._path}: short read of {what} at byte {self.pos} (truncated?)")
            self.pos += n
            return data
        i = self._window(n)
        self.pos += n
        return self._buf[i : i + n]

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def u32(self, what: str) -> int:
        self.need(4, what)
        i = self._window(4)
        self.pos += 4
        return int(_U32.unpack_from(self._buf, i)[0])

    def u64(self, what: str) -> int:
        self.need(8, what)
        i = self._window(8)
        self.pos += 8
        return int(_U64.unpack_from(self._buf, i)[0])

    def skip_strings(self, n: int, what: str) -> None:
        """Skip ``n`` strings (``u64`` length + bytes each) without copying them."""
        for _ in range(n):
            self.need(8, what)
            i = self._window(8)
            length = int(_U64.unpack_from(self._buf, i)[0])
            self.pos += 8
            self.need(length, what)
            self.pos += length


def read_header(path: str) -> GGUFHeader:
    """Read and check the header of the GGUF file at ``path``.

    Blocking: reads the header with ``pread`` (a few MB for a large vocabulary).

    Args:
        path: the file.

    Returns:
        The header; tensor infos are not yet checked against the file size (see ``model.py``).

    Raises:
        FormatError: not a GGUF file (magic), an unsupported version or byte order, a count or
            length larger than the file can hold, a truncated record, an empty or duplicate key,
            an unknown value type, arrays nested deeper than :data:`MAX_ARRAY_DEPTH`, a
            ``general.alignment`` that is not a ``u32`` power of two, a bad tensor info. Each
            message names the key or tensor and the byte offset.
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return _parse(_Cursor(fd, size, path), path)
    finally:
        os.close(fd)


def _parse(cur: _Cursor, path: str) -> GGUFHeader:
    if cur.size < 4:
        raise FormatError(f"{path}: {cur.size} bytes: too short for a GGUF header (truncated, no magic)")
    magic = cur.take(4, "the magic")
    if magic != GGUF_MAGIC:
        raise FormatError(f"{path}: magic {magic!r} is not {GGUF_MAGIC!r}: not a GGUF file")
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise FormatError(
            f"{path}: a big-endian GGUF (version field {version:#x}); this host is little-endian "
            "(llama.cpp refuses it too: convert the file)"
        )
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are, as in llama.cpp)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the key/value count")
    # a key/value pair takes at least 8 (key length) + 1 (key) + 4 (type) + 1 (value) bytes
    if n_kv * 14 > cur.left():
        raise FormatError(f"{path}: GGUF.kv_count={n_kv} is more than the {cur.size}-byte file can hold")
    metadata: dict[str, Any] = {}
    types: dict[str, GGUFValueType] = {}
    seen: set[bytes] = set()
    for index in range(n_kv):
        key_at = cur.pos
        raw_key = _string(cur, f"key #{index}")
        if not raw_key:
            raise FormatError(f'{path}: metadata key #{index} at byte {key_at} is empty (""), which GGUF forbids')
        key = _text(raw_key)
        if raw_key in seen or key in metadata:
            raise FormatError(f"{path}: duplicate metadata key {key!r} at byte {key_at}")
        seen.add(raw_key)
        vtype = _value_type(cur, path, key)
        types[key] = vtype
        metadata[key] = _value(cur, path, key, vtype)

    alignment = _alignment(path, metadata, types)
    # a tensor info takes at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset)
    if n_tensors * 32 > cur.left():
        raise FormatError(
            f"{path}: GGUF.tensor_count={n_tensors} is more tensor infos than the {cur.size}-byte file can hold"
        )
    tensors = [_tensor_info(cur, path, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(version, metadata, types, tensors, alignment, data_start)


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return LossyStr(raw)


def _string(cur: _Cursor, what: str) -> bytes:
    n = cur.u64(f"the length of {what}")
    return cur.take(n, what)


def _value_type(cur: _Cursor, path: str, key: str, *, item: bool = False) -> GGUFValueType:
    at = cur.pos
    raw = cur.u32(f"the type of {key!r}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        kind = "array item type" if item else "value type"
        raise FormatError(f"{path}: metadata key {key!r} has unknown {kind} {raw} (at byte {at})") from None


def _value(cur: _Cursor, path: str, key: str, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        at = cur.pos
        n = cur.u64(f"the length of the value of {key!r}")
        if n > MAX_DECODED_STRING:
            cur.skip(n, f"the value of {key!r}")
            return SkippedValue(key, vtype, None, n, at + 8, n)
        return _text(cur.take(n, f"the value of {key!r}"))
    if vtype == GGUFValueType.ARRAY:
        return _array(cur, path, key)
    fmt, _ = _SCALARS[vtype]
    data = cur.take(_SCALAR_SIZE[vtype], f"the value of {key!r}")
    (value,) = struct.unpack(fmt, data)
    return bool(value) if vtype == GGUFValueType.BOOL else value


def _array(cur: _Cursor, path: str, key: str) -> Any:
    item_type = _value_type(cur, path, key, item=True)
    n = cur.u64(f"the item count of {key!r}")
    start = cur.pos
    leaves = _skip_items(cur, path, key, item_type, n, depth=1)
    if leaves > MAX_DECODED_ITEMS:
        return SkippedValue(key, GGUFValueType.ARRAY, item_type, n, start, cur.pos - start)
    end = cur.pos
    cur.pos = start
    value = _decode_items(cur, path, key, item_type, n)
    assert cur.pos == end
    return value


def _check_count(cur: _Cursor, path: str, key: str, item_type: GGUFValueType, n: int) -> None:
    # the smallest an item can be: a scalar's size, 8 bytes for a string's length, 12 for an array's
    # item type and count (llama.cpp makes the same check before it allocates)
    min_bytes = _SCALAR_SIZE.get(item_type) or (8 if item_type == GGUFValueType.STRING else 12)
    if n * min_bytes > cur.left():
        raise FormatError(
            f"{path}: array {key!r} at byte {cur.pos} claims {n} items, more than the file holds "
            f"({cur.left()} bytes left)"
        )


def _skip_items(cur: _Cursor, path: str, key: str, item_type: GGUFValueType, n: int, depth: int) -> int:
    """Advance past ``n`` items; return the number of leaf values (for the decode budget)."""
    _check_count(cur, path, key, item_type, n)
    if item_type in _SCALARS:
        cur.skip(n * _SCALAR_SIZE[item_type], f"the items of {key!r}")
        return n
    if item_type == GGUFValueType.STRING:
        cur.skip_strings(n, f"a string of {key!r}")
        return n
    if depth >= MAX_ARRAY_DEPTH:
        raise FormatError(f"{path}: metadata key {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
    leaves = 0
    for _ in range(n):
        inner_type = _value_type(cur, path, key, item=True)
        inner_n = cur.u64(f"the item count of an inner array of {key!r}")
        leaves += max(1, _skip_items(cur, path, key, inner_type, inner_n, depth + 1))
    return leaves


def _decode_items(cur: _Cursor, path: str, key: str, item_type: GGUFValueType, n: int) -> list[Any]:
    if item_type in _SCALARS:
        _, dtype = _SCALARS[item_type]
        size = _SCALAR_SIZE[item_type]
        values = np.frombuffer(cur.take(n * size, f"the items of {key!r}"), dtype=dtype, count=n)
        if item_type == GGUFValueType.BOOL:
            return [bool(v) for v in values.tolist()]
        return list(values.tolist())
    if item_type == GGUFValueType.STRING:
        return [_text(_string(cur, f"a string of {key!r}")) for _ in range(n)]
    out: list[Any] = []
    for _ in range(n):
        inner_type = _value_type(cur, path, key, item=True)
        inner_n = cur.u64(f"the item count of an inner array of {key!r}")
        out.append(_decode_items(cur, path, key, inner_type, inner_n))
    return out


def _alignment(path: str, metadata: dict[str, Any], types: dict[str, GGUFValueType]) -> int:
    """``general.alignment``: a ``u32`` power of two (gguf.cpp refuses any other type), else 32."""
    vtype = types.get("general.alignment")
    if vtype is None:
        return _DEFAULT_ALIGNMENT
    value = metadata["general.alignment"]
    if vtype != GGUFValueType.UINT32:
        raise FormatError(f"{path}: general.alignment must be of type UINT32, the file has {vtype.name} ({value!r})")
    if value <= 0 or value & (value - 1):
        raise FormatError(f"{path}: general.alignment={value} is not a positive power of two")
    return int(value)


def _tensor_info(cur: _Cursor, path: str, index: int) -> RawTensorInfo:
    at = cur.pos
    raw_name = _string(cur, f"the name of tensor #{index}")
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{path}: the name of tensor #{index} (at byte {at}) is not valid UTF-8") from None
    n_dims = cur.u32(f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise FormatError(f"{path}: tensor {name!r} has {n_dims} dims (1..{MAX_DIMS} dims, each >= 1)")
    dims = tuple(cur.u64(f"a dimension of tensor {name!r}") for _ in range(n_dims))
    ggml_type = cur.u32(f"the type of tensor {name!r}")
    offset = cur.u64(f"the data offset of tensor {name!r}")
    if math.prod(dims) >= 1 << 63:
        raise FormatError(f"{path}: tensor {name!r} has dims {list(dims)}: more than 2**63 elements")
    return RawTensorInfo(name, dims, ggml_type, offset, at)
