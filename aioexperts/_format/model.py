"""Open a GGUF model (one file or a split set) and describe every tensor, checking it as untrusted input.

Parsing is done by the ``gguf`` package (llama.cpp's reader). Around it this module adds what a
streaming reader needs and ``GGUFReader`` does not check: every read of the header stays inside
the file, array lengths are bounded by the bytes left, every tensor's relative offset is a
multiple of ``general.alignment`` and its data lies inside its file (computed with Python ints, so
it cannot overflow), and the shards of a split set are all present and agree. The reader's
``np.memmap`` is dropped once the header is parsed: only plain Python values are kept.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .._errors import AioExpertsError, FormatError, MissingShardError, UnsupportedTypeError

__all__ = ("GGUFModel", "ShardInfo", "TensorInfo", "open_model", "split_shard_paths")

#: Arrays longer than this (tokenizer vocabularies) are not copied out of the header.
MAX_METADATA_ARRAY = 4096
#: A tensor may have at most this many dimensions (ggml's GGML_MAX_DIMS).
MAX_DIMS = 4
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


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
        metadata: key -> plain Python value (str, int, float, bool, list) from the first shard;
            arrays longer than ``MAX_METADATA_ARRAY`` are left out (their keys are in
            ``skipped_arrays``).
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
    ) -> None:
        self.path = path
        self.shards = shards
        self.metadata: Mapping[str, Any] = metadata
        self.skipped_arrays = skipped_arrays
        self.tensors: Mapping[str, TensorInfo] = tensors
        self.alignment = alignment
        arch = metadata.get("general.architecture")
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
        shard = self.shards[info.shard]
        with open(shard.path, "rb", buffering=0) as f:
            if not shard.matches(os.fstat(f.fileno())):
                raise FormatError(
                    f"{shard.path} changed since it was parsed (size, inode or mtime): it is not the model "
                    "whose experts are being read; reopen the model"
                )
            data = os.pread(f.fileno(), info.n_bytes, info.data_offset)
        if len(data) != info.n_bytes:
            raise FormatError(
                f"{shard.path}: tensor {name!r} needs {info.n_bytes} bytes at offset "
                f"{info.data_offset}, the file gave {len(data)} (truncated since it was opened?)"
            )
        return data

    def __repr__(self) -> str:
        return (
            f"GGUFModel({self.path!r}, architecture={self.architecture!r}, "
            f"shards={len(self.shards)}, tensors={len(self.tensors)})"
        )


def split_shard_paths(path: str | os.PathLike[str]) -> list[str] | None:
    """The paths of all shards of the split set ``path`` belongs to, or None for a plain name.

    A split set is named ``NAME-0000k-of-0000n.gguf`` (llama.cpp's ``llama_split_path``).

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

    Blocking (reads the headers): run it in a worker thread under an event loop.

    Args:
        path: a ``.gguf`` file; for a split set any one of its shards.

    Returns:
        The parsed model.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        MissingShardError: a shard of the split set is missing; its path is in ``.path``.
        FormatError: not a GGUF file, truncated, bad alignment, a tensor outside its file, shards
            that disagree.
        UnsupportedTypeError: a tensor type unknown to the ``gguf`` package.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    shard_paths = split_shard_paths(path) or [os.path.abspath(path)]
    for p in shard_paths:
        if not os.path.exists(p):
            raise MissingShardError(
                f"{path}: shard {os.path.basename(p)} of the split set is missing (expected at {p})", p
            )
    for p in shard_paths:
        if not os.path.isfile(p):
            raise FormatError(f"{p} is not a regular file")
    parsed = [_parse_file(p, index) for index, p in enumerate(shard_paths)]
    return _combine(path, shard_paths, parsed)


@dataclass(slots=True)
class _ParsedFile:
    shard: ShardInfo
    metadata: dict[str, Any]
    skipped: set[str]
    tensors: list[TensorInfo]
    alignment: int


class _CheckedReader(GGUFReader):
    """``GGUFReader`` that refuses reads past the end of the file and keeps raw tensor fields.

    Tensor data views are not built: the tensors are described by :func:`_tensor_infos` with
    overflow-free bounds checks instead.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        count = int(count)
        itemsize = int(np.dtype(dtype).itemsize)
        if offset < 0 or count < 0 or offset + itemsize * count > len(self.data):
            raise FormatError(
                f"header field at byte {offset} ({count} x {itemsize} bytes) runs past the end "
                f"of the file ({len(self.data)} bytes): truncated or corrupt"
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            n_items = int(self._get(orig_offs + 4, np.uint64)[0])
            try:
                gtype = GGUFValueType(item_type)
            except ValueError:
                raise FormatError(f"array at byte {orig_offs} has unknown item type {item_type}") from None
            scalar = self.gguf_scalar_to_np.get(gtype)
            min_bytes = np.dtype(scalar).itemsize if scalar is not None else _MIN_ITEM_BYTES[gtype]
            if n_items * min_bytes > len(self.data) - orig_offs - 12:
                raise FormatError(f"array at byte {orig_offs} claims {n_items} items, more than the file holds")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        # a key/value pair takes at least 8 (key length) + 4 (type) + 1 (smallest value) bytes
        if int(count) * 13 > len(self.data) - offs:
            raise FormatError(f"GGUF.kv_count={int(count)} is more than the {len(self.data)}-byte file can hold")
        return int(super()._build_fields(offs, count))

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        # a tensor info takes at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset)
        if int(count) * 32 > len(self.data) - offs:
            raise FormatError(
                f"GGUF.tensor_count={int(count)} is more tensor infos than the {len(self.data)}-byte file can hold"
            )
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self.raw_tensor_fields = fields
        self.tensor_data_start = int(start_offs)


def _parse_file(path: str, index: int) -> _ParsedFile:
    st = os.stat(path)
    if st.st_size == 0:
        raise FormatError(f"{path}: empty file, not GGUF")
    try:
        reader = _CheckedReader(path, "r")
    except AioExpertsError as exc:
        raise FormatError(f"{path}: {exc}") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not a valid GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise FormatError(
            f"{path}: a big-endian GGUF; this host is little-endian (llama.cpp refuses it too: convert the file)"
        )
    metadata, skipped = _metadata(path, reader)
    alignment = int(reader.alignment)
    if alignment <= 0 or alignment & (alignment - 1):  # gguf >= 0.18 checks this too; older ones did not
        raise FormatError(f"{path}: general.alignment={alignment} is not a positive power of two")
    tensors = _tensor_infos(path, index, reader, st.st_size, alignment)
    del reader  # only plain Python values survive, so the reader's memmap is unmapped here
    shard = ShardInfo(path, index, st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)
    return _ParsedFile(shard, metadata, skipped, tensors, alignment)


def _metadata(path: str, reader: _CheckedReader) -> tuple[dict[str, Any], set[str]]:
    metadata: dict[str, Any] = {}
    skipped: set[str] = set()
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > MAX_METADATA_ARRAY:
            skipped.add(key)
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise FormatError(f"{path}: metadata key {key!r} cannot be decoded: {exc}") from exc
        metadata[key] = _plain(value)
    return metadata, skipped


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _tensor_infos(path: str, shard: int, reader: _CheckedReader, file_size: int, alignment: int) -> list[TensorInfo]:
    fields = getattr(reader, "raw_tensor_fields", None)
    if fields is None:  # pragma: no cover - a gguf release that renamed the hook
        raise FormatError(f"{path}: unsupported gguf package version (no tensor info hook)")
    data_start = reader.tensor_data_start
    if data_start > file_size:
        raise FormatError(f"{path}: tensor data would start at byte {data_start}, past the end ({file_size})")
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    for field in fields:
        _name_len, name_data, n_dims, dims_arr, raw_dtype, offset_arr = field.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{path}: a tensor name is not valid UTF-8") from None
        if name in seen:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        dims = tuple(int(d) for d in dims_arr)
        if not 1 <= int(n_dims[0]) <= MAX_DIMS or any(d < 1 for d in dims):
            raise FormatError(f"{path}: tensor {name!r} has dims {list(dims)} (1..{MAX_DIMS} dims, each >= 1)")
        try:
            ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise UnsupportedTypeError(f"{path}: tensor {name!r} has unknown ggml type {int(raw_dtype[0])}") from None
        if dims[0] % block_size:
            raise FormatError(
                f"{path}: tensor {name!r} ({ggml_type.name}) has ne0={dims[0]}, "
                f"not a multiple of the block size {block_size}"
            )
        n_bytes = math.prod(dims) // block_size * type_size
        rel = int(offset_arr[0])
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
        infos.append(TensorInfo(name, shard, start, n_bytes, ggml_type, dims))
    return infos


def _combine(path: str, shard_paths: list[str], parsed: list[_ParsedFile]) -> GGUFModel:
    n = len(parsed)
    first = parsed[0]
    tensors: dict[str, TensorInfo] = {}
    declared_total = first.metadata.get("split.tensors.count")
    for k, pf in enumerate(parsed):
        count = pf.metadata.get("split.count", 1 if n == 1 else None)
        no = pf.metadata.get("split.no", 0 if n == 1 else None)
        if count != n or no != k:
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
        skipped_arrays=frozenset(first.skipped),
        tensors=tensors,
        alignment=first.alignment,
    )
