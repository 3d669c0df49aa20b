"""Open a GGUF model (one file or a split set) and describe every tensor, checking it as untrusted input.

The header is read by :mod:`aioexperts._format.header`, a reader bounded by the file size that
uses only the ``gguf`` package's public constants (value and tensor types, quant block sizes). On
top of it this module checks what a streaming reader needs: every tensor's relative offset is a
multiple of ``general.alignment``, its data lies inside its file (computed with Python ints, so it
cannot overflow), its type is known and its rows are whole blocks, and the shards of a split set
are all present and agree. Only plain Python values are kept; no file stays open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .._errors import FormatError, MissingShardError, UnsupportedTypeError
from .header import MAX_DECODED_ITEMS, MAX_DIMS, GGUFHeader, LossyStr, SkippedValue, read_header

__all__ = ("GGUFModel", "LossyStr", "ShardInfo", "SkippedValue", "TensorInfo", "open_model", "split_shard_paths")

#: Arrays longer than this (tokenizer vocabularies) are not copied out of the header: their key
#: maps to a :class:`SkippedValue` (``len()`` works, the items stay in the file).
MAX_METADATA_ARRAY = MAX_DECODED_ITEMS
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One file of the model and the identity it had when it was parsed.

    Attributes:
        path: absolute path of the file.
        index: 0-based shard number (``split.no``); 0 for a single file.
        size: file size in bytes.
        dev, ino: ``st_dev`` and ``st_ino``.
        mtime_ns: ``st_mtime_ns``.
    """

    path: str
    index: int
    size: int
    dev: int
    ino: int
    mtime_ns: int

    def matches(self, st: os.stat_result) -> bool:
        """True when ``st`` (an ``os.fstat`` of an open file) is this exact file, unchanged."""
        return (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns) == (
            self.size,
            self.dev,
            self.ino,
            self.mtime_ns,
        )


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's data is.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.3.ffn_up_exps.weight``.
        shard: index into :attr:`GGUFModel.shards`.
        data_offset: absolute byte offset of the first byte in that shard's file.
        n_bytes: size of the data in bytes.
        ggml_type: ggml type of the data.
        dims: ggml dims, fastest-varying first (``ne0, ne1, ...``), as GGUF stores them.
    """

    name: str
    shard: int
    data_offset: int
    n_bytes: int
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Numpy order shape (``dims`` reversed)."""
        return tuple(reversed(self.dims))


class GGUFModel:
    """A parsed GGUF model: metadata and the location of every tensor. Holds no open files.

    Attributes:
        path: the path the model was opened from (any shard of a split set).
        shards: every file of the model, in ``split.no`` order.
        architecture: ``general.architecture`` (``qwen3moe``, ``glm4moe``, ...).
        metadata: key -> value from the first shard: ``int``, ``float``, ``bool``, ``str``, ``list``
            (nested lists for arrays of arrays, each inner list with its own item type). A string
            that is not valid UTF-8 is a :class:`LossyStr` (U+FFFD replacements; ``.raw`` has the
            bytes). An array of more than ``MAX_METADATA_ARRAY`` items (a vocabulary) or a string
            over 64 MiB is a :class:`SkippedValue`: ``len()`` gives its length, its items stay in
            the file; its key is also in ``skipped_arrays``.
        value_types: key -> the ``gguf.GGUFValueType`` the first shard stores the value as.
        skipped_arrays: the keys whose value is a :class:`SkippedValue`.
        tensors: name -> :class:`TensorInfo`, for all shards.
        alignment: ``general.alignment`` in bytes (32 when absent).
    """

    def __init__(
        self,
        path: str,
        shards: tuple[ShardInfo, ...],
        metadata: dict[str, Any],
        skipped_arrays: frozenset[str],
        tensors: dict[str, TensorInfo],
        alignment: int,
        value_types: Mapping[str, GGUFValueType] | None = None,
    ) -> None:
        self.path = path
        self.shards = shards
        self.metadata: Mapping[str, Any] = metadata
        self.value_types: Mapping[str, GGUFValueType] = dict(value_types or {})
        self.skipped_arrays = skipped_arrays
        self.tensors: Mapping[str, TensorInfo] = tensors
        self.alignment = alignment
        arch = metadata.get("general.architecture")
        if isinstance(arch, LossyStr):
            raise FormatError(f"{path}: general.architecture is not valid UTF-8 ({arch.raw!r})")
        if not isinstance(arch, str) or not arch:
            raise FormatError(f"{path}: general.architecture is missing or not a string")
        self.architecture: str = arch

    def key(self, name: str, default: Any = None) -> Any:
        """Metadata value of ``{architecture}.{name}``, or ``default``."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def tensor(self, name: str) -> TensorInfo:
        """The tensor called ``name``.

        Raises:
            FormatError: no such tensor.
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: tensor {name!r} is missing") from None

    def read_tensor_bytes(self, name: str) -> bytes:
        """The raw bytes of a (small, resident) tensor, read with a plain ``pread``.

        Blocking: call it from a worker thread when an event loop is running.

        Raises:
            FormatError: no such tensor, the file at this path is no longer the parsed one
                (replaced or modified), or it is shorter than it was at open.
        """
        info = self.tensor(name)
        with self._checked_shard(info) as fd:
            data = os.pread(fd, info.n_bytes, info.data_offset)
        self._check_read(info, len(data))
        return data

    def read_tensor_into(self, name: str, out: bytearray | np.ndarray) -> None:
        """Read the raw bytes of tensor ``name`` into ``out`` (a writable buffer of exactly its
        ``n_bytes``; e.g. memory on huge pages), with ``preadv`` (no copy through a bytes object).

        Blocking: call it from a worker thread when an event loop is running.

        Raises:
            FormatError: as :meth:`read_tensor_bytes`.
            ValueError: ``out`` is not a writable buffer of the tensor's size.
        """
        info = self.tensor(name)
        view = (out.data if isinstance(out, np.ndarray) else memoryview(out)).cast("B")
        if view.readonly or view.nbytes != info.n_bytes:
            raise ValueError(f"tensor {name!r}: needs a writable buffer of {info.n_bytes} bytes, got {view.nbytes}")
        got = 0
        with self._checked_shard(info) as fd:
            while got < info.n_bytes:  # a large read may come back in parts (2 GiB at most per call)
                n = os.preadv(fd, [view[got:]], info.data_offset + got)
                if n <= 0:
                    break
                got += n
        self._check_read(info, got)

    @contextlib.contextmanager
    def _checked_shard(self, info: TensorInfo) -> Iterator[int]:
        """The open file descriptor of ``info``'s shard, checked to be the parsed file (FormatError)."""
        shard = self.shards[info.shard]
        with open(shard.path, "rb", buffering=0) as f:
            if not shard.matches(os.fstat(f.fileno())):
                raise FormatError(
                    f"{shard.path} changed since it was parsed (size, inode or mtime): it is not the model "
                    "whose experts are being read; reopen the model"
                )
            yield f.fileno()

    def _check_read(self, info: TensorInfo, got: int) -> None:
        """FormatError when a read of ``info`` gave ``got`` bytes, not all of them."""
        if got != info.n_bytes:
            raise FormatError(
                f"{self.shards[info.shard].path}: tensor {info.name!r} needs {info.n_bytes} bytes at offset "
                f"{info.data_offset}, the file gave {got} (truncated since it was opened?)"
            )

    def __repr__(self) -> str:
        return (
            f"GGUFModel({self.path!r}, architecture={self.architecture!r}, "
            f"shards={len(self.shards)}, tensors={len(self.tensors)})"
        )


def split_shard_paths(path: str | os.PathLike[str]) -> list[str] | None:
    """The paths of all shards of the split set ``path`` would belong to, or None for a plain name.

    A split set is named ``NAME-0000k-of-0000n.gguf`` (llama.cpp's ``llama_split_path``). The name
    alone does not make a split set: :func:`open_model` follows it only when the file's metadata
    says ``split.count`` > 1.

    Raises:
        FormatError: the name says shard 0 or a shard number above the count.
    """
    path = os.fspath(path)
    directory, base = os.path.split(os.path.abspath(path))
    m = _SPLIT_RE.match(base)
    if m is None:
        return None
    no, count = int(m["no"]), int(m["count"])
    if count < 1 or not 1 <= no <= count:
        raise FormatError(f"{path}: split name says shard {no} of {count}")
    return [os.path.join(directory, f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def open_model(path: str | os.PathLike[str]) -> GGUFModel:
    """Parse a GGUF file, or the whole split set that ``path`` belongs to, and check it.

    As llama.cpp does, the metadata decides: a file whose ``split.count`` is absent or 1 is a
    single file, whatever its name (a complete model copied to ``NAME-00001-of-00002.gguf`` opens
    alone). A file with ``split.count`` > 1 is a shard of a split set, whose other shards are found
    by the name (``NAME-0000k-of-0000n.gguf``) and must all be present and agree with it.

    Blocking (reads the headers): run it in a worker thread under an event loop.

    Args:
        path: a ``.gguf`` file; for a split set any one of its shards.

    Returns:
        The parsed model.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        MissingShardError: a shard of the split set is missing; its path is in ``.path``.
        FormatError: not a GGUF file, truncated, an unsupported version or byte order, a count or
            length larger than the file, an empty or duplicate metadata key, an unknown value
            type, arrays nested too deep, bad alignment, a tensor outside its file,
            ``general.architecture`` missing or not valid UTF-8, ``split.count`` or ``split.no``
            not an integer, ``split.count`` > 1 in a file not named as a shard (or named as
            another set), shards that disagree. The message names the file, the key or tensor,
            and the byte offset where it helps.
        UnsupportedTypeError: a tensor type unknown to the ``gguf`` package.
        PermissionError: a file, or a directory on its path, may not be read (searched).
        OSError: a file cannot be read.
    """
    path = os.fspath(path)
    _stat(path)  # FileNotFoundError, or PermissionError where a directory on the way cannot be searched
    given = os.path.abspath(path)
    check_regular_file(given)
    head = _parse_file(given, 0)
    count = _split_int(head, "split.count")
    if count is None or count <= 1:
        return _combine(path, [given], [head])  # a single file (a count below 1 is refused there)
    # split.count > 1: a shard, the name finds the other shards
    shard_paths = split_shard_paths(path)
    if shard_paths is None:
        return _combine(path, [given], [head])  # refused there: split metadata, but not a shard's name
    for p in shard_paths:
        try:
            _stat(p)
        except FileNotFoundError:
            raise MissingShardError(
                f"{path}: shard {os.path.basename(p)} of the split set is missing (expected at {p}); "
                f"{os.path.basename(given)} says split.count={count}",
                p,
            ) from None
        check_regular_file(p)
    parsed = [_reindexed(head, k) if p == given else _parse_file(p, k) for k, p in enumerate(shard_paths)]
    return _combine(path, shard_paths, parsed)


def _stat(path: str) -> os.stat_result:
    """``os.stat``, with a symbolic link loop (``ELOOP``) as the malformed input it is."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path}: a loop of symbolic links, not a file") from None
        raise


def check_regular_file(path: str, what: str = "") -> None:
    """Refuse a directory, FIFO or device before anything reads it (a FIFO would block the read).

    Raises:
        FormatError: ``path`` is not a regular file (``what`` names the kind of file expected), or
            a loop of symbolic links.
        OSError: ``path`` cannot be looked up (``FileNotFoundError``, ``PermissionError``).
    """
    if not stat.S_ISREG(_stat(path).st_mode):
        raise FormatError(f"{path} is not a regular file{what and ', not ' + what}")


@dataclass(slots=True)
class _ParsedFile:
    shard: ShardInfo
    metadata: dict[str, Any]
    value_types: dict[str, GGUFValueType]
    tensors: list[TensorInfo]
    alignment: int


def _parse_file(path: str, index: int) -> _ParsedFile:
    st = os.stat(path)
    if st.st_size == 0:
        raise FormatError(f"{path}: empty file, not GGUF")
    header = read_header(path)
    tensors = _tensor_infos(path, index, header, st.st_size)
    shard = ShardInfo(path, index, st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)
    return _ParsedFile(shard, header.metadata, header.value_types, tensors, header.alignment)


def _reindexed(pf: _ParsedFile, index: int) -> _ParsedFile:
    """``pf`` as shard ``index`` of its set (it was parsed as shard 0 before its set was known)."""
    if index == pf.shard.index:
        return pf
    return _ParsedFile(
        dataclasses.replace(pf.shard, index=index),
        pf.metadata,
        pf.value_types,
        [dataclasses.replace(t, shard=index) for t in pf.tensors],
        pf.alignment,
    )


def _split_int(pf: _ParsedFile, key: str) -> int | None:
    """The integer value of ``split.count`` or ``split.no`` in ``pf``, None when absent.

    Raises:
        FormatError: the value is not an integer (a bool, string, float or array).
    """
    value = pf.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{pf.shard.path}: {key} is {value!r}, not an integer")
    return value


def _tensor_infos(path: str, shard: int, header: GGUFHeader, file_size: int) -> list[TensorInfo]:
    data_start, alignment = header.data_start, header.alignment
    # Without tensors the data section is empty and its aligned start may lie past the end of the
    # file (llama.cpp's vocabulary-only files): nothing is read there, so nothing is refused.
    if header.tensors and data_start > file_size:
        raise FormatError(f"{path}: tensor data would start at byte {data_start}, past the end ({file_size})")
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    expected = 0  # llama.cpp's rule: each tensor's data follows the previous one's, padded (gguf.cpp)
    for raw in header.tensors:
        name, dims = raw.name, raw.dims
        if name in seen:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        if any(d < 1 for d in dims):
            raise FormatError(f"{path}: tensor {name!r} has dims {list(dims)} (1..{MAX_DIMS} dims, each >= 1)")
        try:
            ggml_type = GGMLQuantizationType(raw.ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise UnsupportedTypeError(f"{path}: tensor {name!r} has unknown ggml type {raw.ggml_type}") from None
        if dims[0] % block_size:
            raise FormatError(
                f"{path}: tensor {name!r} ({ggml_type.name}) has ne0={dims[0]}, "
                f"not a multiple of the block size {block_size}"
            )
        n_bytes = math.prod(dims) // block_size * type_size
        rel = raw.offset
        if rel % alignment:
            raise FormatError(
                f"{path}: tensor {name!r} offset {rel} is not a multiple of general.alignment={alignment}"
            )
        start = data_start + rel
        if start > file_size or n_bytes > file_size - start:
            raise FormatError(
                f"{path}: tensor {name!r} needs bytes [{start}, {start + n_bytes}) but the file has "
                f"{file_size} bytes (truncated or corrupt)"
            )
        if rel != expected:  # overlapping, aliased or out-of-order data: llama.cpp refuses the file
            raise FormatError(
                f"{path}: tensor {name!r} has data offset {rel}, expected {expected} (each tensor's data "
                f"follows the previous one's, padded to general.alignment={alignment}, as llama.cpp requires)"
            )
        expected = rel + -(-n_bytes // alignment) * alignment
        infos.append(TensorInfo(name, shard, start, n_bytes, ggml_type, dims))
    return infos


def _combine(path: str, shard_paths: list[str], parsed: list[_ParsedFile]) -> GGUFModel:
    n = len(parsed)
    first = parsed[0]
    tensors: dict[str, TensorInfo] = {}
    declared_total = first.metadata.get("split.tensors.count")
    for k, pf in enumerate(parsed):
        count, no = _split_int(pf, "split.count"), _split_int(pf, "split.no")
        if n == 1:
            _check_single(pf.shard.path, count, no)
        elif count != n or no != k:
            raise FormatError(
                f"{pf.shard.path}: split.count={count}, split.no={no}, but the file name says shard "
                f"{k + 1} of {n} (split.no is 0-based)"
            )
        if n > 1 and pf.metadata.get("split.tensors.count") != declared_total:
            raise FormatError(
                f"{pf.shard.path}: split.tensors.count={pf.metadata.get('split.tensors.count')} "
                f"disagrees with the first shard's {declared_total}"
            )
        for info in pf.tensors:
            if info.name in tensors:
                raise FormatError(f"{pf.shard.path}: tensor {info.name!r} is also in another shard")
            tensors[info.name] = info
    if n > 1 and declared_total != len(tensors):
        raise FormatError(
            f"{path}: split.tensors.count says {declared_total} tensors, the {n} shards hold {len(tensors)}"
        )
    return GGUFModel(
        path=os.fspath(path),
        shards=tuple(pf.shard for pf in parsed),
        metadata=first.metadata,
        skipped_arrays=frozenset(k for k, v in first.metadata.items() if isinstance(v, SkippedValue)),
        tensors=tensors,
        alignment=first.alignment,
        value_types=first.value_types,
    )


def _check_single(path: str, count: int | None, no: int | None) -> None:
    """Refuse split metadata in a file opened alone: ``split.count`` absent or 1, ``split.no`` absent or 0."""
    if count is not None and count > 1:
        raise FormatError(
            f"{path}: split.count={count}, split.no={no}: a shard of a split set, but the file name is not "
            "a shard's (NAME-0000k-of-0000n.gguf), so the other shards cannot be found"
        )
    if count is not None and count < 1:
        raise FormatError(f"{path}: split.count={count} (a file is split in 1 or more shards)")
    if no is not None and no != 0:
        raise FormatError(f"{path}: split.no={no} in a file that is not split (split.count absent or 1)")
