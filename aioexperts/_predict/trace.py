"""Routing traces: which experts the router selected, per token and MoE layer.

A trace is the input of cache simulations (:mod:`aioexperts._predict.simulate`) and of predictor
scoring. A runner records one with :class:`TraceRecorder` while it routes; benchmarks generate
synthetic ones with :func:`uniform_random_trace` and :func:`skewed_random_trace`. Traces are saved as
``.npz`` files without pickle; the format is described in ``docs/trace-format.md`` and in
:meth:`RoutingTrace.save`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import AioExpertsError, ConfigError, FormatError, InvalidRequestError
from .._format.filemode import new_file_mode

__all__ = (
    "TRACE_FORMAT_VERSION",
    "RoutingTrace",
    "TraceRecorder",
    "skewed_random_trace",
    "uniform_random_trace",
)

TRACE_FORMAT_VERSION = 1
"""The value of the ``version`` key written by :meth:`RoutingTrace.save`; the only one accepted."""

_KEYS = frozenset({"version", "ids", "layers", "n_experts", "metadata"})
_ID_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))
MAX_EXPERTS_PER_LAYER = 1 << 16
"""The most routed experts a layer of a trace may declare (llama.cpp's ``LLAMA_MAX_EXPERTS`` is 1024)."""
MAX_EXPERTS_TOTAL = 1 << 20
"""The most ``(layer, expert)`` keys a trace may declare: what the analyses hold per expert is bounded."""
_DEFLATE_MAX_RATIO = 1032
"""Deflate expands at most this much (RFC 1951: a 258-byte match per 2 bits): what a zip member may declare."""
_UNREADABLE = (ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)


def _ids_dtype_for(n_experts: Iterable[int]) -> np.dtype[Any]:
    """int16 when every id (and -1) fits, else int32."""
    return _ID_DTYPES[0] if max(n_experts, default=0) <= np.iinfo(np.int16).max + 1 else _ID_DTYPES[1]


def _layer_tuple(layers: Iterable[int], error: type[AioExpertsError]) -> tuple[int, ...]:
    """``layers`` as a tuple of Python ints."""
    array = np.asarray(layers if isinstance(layers, np.ndarray) else list(layers))
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise error(f"layers must be a 1-d sequence of integers, got dtype {array.dtype} shape {array.shape}")
    return tuple(int(v) for v in array)


def _as_int_tuple(values: int | Iterable[int], n: int, what: str, error: type[AioExpertsError]) -> tuple[int, ...]:
    """``values`` as a tuple of ``n`` Python ints; a bare int is repeated ``n`` times."""
    if isinstance(values, (int, np.integer)):
        if isinstance(values, bool):
            raise error(f"{what} must be an int or a sequence of ints, got {values!r}")
        return (int(values),) * n
    array = np.asarray(values if isinstance(values, np.ndarray) else list(values))
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise error(f"{what} must be a 1-d sequence of integers, got dtype {array.dtype} shape {array.shape}")
    if array.shape[0] != n:
        raise error(f"{what} has {array.shape[0]} entries, expected {n} (one per MoE layer)")
    return tuple(int(v) for v in array)


def _check_parts(
    ids: np.ndarray,
    layers: tuple[int, ...],
    n_experts: tuple[int, ...],
    metadata: Mapping[str, str],
    error: type[AioExpertsError],
) -> None:
    """The validation rules of a trace but the ids dtype (docs/trace-format.md); raises ``error``."""
    if ids.ndim != 3:
        raise error(f"ids must have 3 dimensions (n_tokens, n_layers, k), got shape {ids.shape}")
    n_tokens, n_layers, k = ids.shape
    if n_layers < 1 or k < 1:
        raise error(f"ids needs at least one layer and one slot per step, got shape {ids.shape}")
    if len(layers) != n_layers:
        raise error(f"layers has {len(layers)} entries but ids has {n_layers} layers (shape {ids.shape})")
    if len(n_experts) != n_layers:
        raise error(f"n_experts has {len(n_experts)} entries but ids has {n_layers} layers (shape {ids.shape})")
    if layers[0] < 0 or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        raise error(f"layers must be non-negative and strictly increasing, got {list(layers)}")
    for layer, n in zip(layers, n_experts, strict=True):
        if not 1 <= n <= MAX_EXPERTS_PER_LAYER:
            raise error(f"n_experts of layer {layer} is {n}, must be in [1, {MAX_EXPERTS_PER_LAYER}]")
        if k > n:
            raise error(f"k={k} slots per step exceed the {n} experts of layer {layer}")
    if sum(n_experts) > MAX_EXPERTS_TOTAL:
        raise error(
            f"the layers declare {sum(n_experts)} experts in all, more than the {MAX_EXPERTS_TOTAL} a trace holds"
        )
    if n_tokens:
        low = ids.min(axis=(0, 2))
        high = ids.max(axis=(0, 2))
        for i, (layer, n) in enumerate(zip(layers, n_experts, strict=True)):
            if low[i] < -1 or high[i] >= n:
                bad = ids[:, i, :]
                token = int(np.flatnonzero(((bad < -1) | (bad >= n)).any(axis=1))[0])
                raise error(
                    f"ids of layer {layer} must be in [-1, {n}), got {int(low[i])}..{int(high[i])}"
                    f" (first at token {token}: {bad[token].tolist()})"
                )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise error(f"metadata must map str to str, got {key!r}: {value!r}")


_ZIP_MAGIC = b"PK\x03\x04"  # every .npz (a zip archive) starts with a local file header


def _check_member_sizes(name: str, f: Any) -> None:
    """Refuse an archive whose members declare more bytes than the file can hold, before any is read.

    A member's uncompressed size is bounded by its compressed bytes (stored: equal; deflated: at most
    :data:`_DEFLATE_MAX_RATIO` times), and the array its ``.npy`` header declares must fill exactly
    the member: numpy allocates by that header, so memory grows with the file, not with a number in it.
    """
    file_size = os.fstat(f.fileno()).st_size
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            limit = info.compress_size * (1 if info.compress_type == zipfile.ZIP_STORED else _DEFLATE_MAX_RATIO)
            if info.compress_size > file_size or info.file_size > limit:
                raise FormatError(
                    f"{name}: member {info.filename} declares {info.file_size} bytes, more than its "
                    f"{info.compress_size} stored bytes can hold"
                )
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version not in ((1, 0), (2, 0)):
                    raise FormatError(f"{name}: {info.filename} is a .npy of version {version}, not 1.0 or 2.0")
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(member)  # the header only
                declared = math.prod(shape) * dtype.itemsize
                if declared > info.file_size - member.tell():
                    raise FormatError(
                        f"{name}: {info.filename} declares a {shape} {dtype} array ({declared} bytes) but holds "
                        f"{info.file_size - member.tell()} bytes"
                    )


@dataclass(frozen=True, eq=False, slots=True)
class RoutingTrace:
    """The experts selected per token and MoE layer; immutable (``ids`` is a read-only array).

    Args and attributes:
        ids: ``(n_tokens, n_layers, k)`` int16 or int32; ``ids[t, i]`` are the expert ids the router
            selected for token ``t`` at MoE layer ``layers[i]``, in router order. ``-1`` marks an
            inactive slot (fewer active experts, or a step that was not recorded). Ids need not be
            unique within a step (a consumer dedupes). Other integer dtypes are converted: to int16
            when every layer has at most 32768 experts, else int32. The array is copied.
        layers: the block indices ``L`` of ``blk.L.*`` of the MoE layers, non-negative and strictly
            increasing (glm4moe's first MoE layer is 1, its dense block 0 is not in the trace).
        n_experts: the number of routed experts of each layer, ``>= k``; an int applies to every layer.
        metadata: free-form ``str -> str`` pairs (model name, seed, generator); copied and read-only.

    Raises:
        ConfigError: if a rule of ``docs/trace-format.md`` ("Validation") is broken.
    """

    ids: np.ndarray
    layers: tuple[int, ...]
    n_experts: tuple[int, ...]
    metadata: Mapping[str, str]

    def __init__(
        self,
        ids: np.ndarray,
        layers: Iterable[int],
        n_experts: int | Iterable[int],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._init(ids, layers, n_experts, metadata, ConfigError)

    def _init(
        self,
        ids: Any,
        layers: Any,
        n_experts: Any,
        metadata: Mapping[str, str] | None,
        error: type[AioExpertsError],
    ) -> None:
        array = np.asarray(ids)
        if array.dtype.kind not in "iu":
            raise error(f"ids must be integers (stored as int16 or int32), got dtype {array.dtype}")
        if array.ndim != 3:
            raise error(f"ids must have 3 dimensions (n_tokens, n_layers, k), got shape {array.shape}")
        layer_tuple = _layer_tuple(layers, error)
        experts_tuple = _as_int_tuple(n_experts, array.shape[1], "n_experts", error)
        meta = dict(metadata or {})
        _check_parts(array, layer_tuple, experts_tuple, meta, error)
        if array.dtype.kind == "i" and array.dtype.itemsize in (2, 4):
            target = array.dtype.newbyteorder("=")  # keep int16 / int32, in native byte order
        else:
            target = _ids_dtype_for(experts_tuple)
        array = np.array(array, dtype=target, copy=True)  # our own copy, made read-only
        array.flags.writeable = False
        object.__setattr__(self, "ids", array)
        object.__setattr__(self, "layers", layer_tuple)
        object.__setattr__(self, "n_experts", experts_tuple)
        object.__setattr__(self, "metadata", MappingProxyType(meta))

    @property
    def n_tokens(self) -> int:
        """The number of tokens (``ids.shape[0]``)."""
        return int(self.ids.shape[0])

    @property
    def n_layers(self) -> int:
        """The number of MoE layers (``ids.shape[1]``)."""
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        """Expert slots per token and layer (``ids.shape[2]``), the router's top-k."""
        return int(self.ids.shape[2])

    @property
    def n_experts_total(self) -> int:
        """The number of distinct ``(layer, expert)`` keys of the model: ``sum(n_experts)``."""
        return sum(self.n_experts)

    def layer_index(self, layer: int) -> int:
        """The position in ``layers`` (axis 1 of ``ids``) of block index ``layer``.

        Raises:
            InvalidRequestError: if ``layer`` is not a MoE layer of this trace.
        """
        try:
            return self.layers.index(layer)
        except ValueError:
            raise InvalidRequestError(f"layer {layer} is not in the trace's MoE layers {list(self.layers)}") from None

    def __len__(self) -> int:
        return self.n_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return (
            self.layers == other.layers
            and self.n_experts == other.n_experts
            and dict(self.metadata) == dict(other.metadata)
            and self.ids.shape == other.ids.shape
            and bool(np.array_equal(self.ids, other.ids))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(n_tokens={self.n_tokens}, layers={list(self.layers)}, k={self.k},"
            f" n_experts={list(self.n_experts)}, dtype={self.ids.dtype}, metadata={dict(self.metadata)})"
        )

    def save(self, path: str | os.PathLike[str], *, compress: bool = False) -> None:
        """Write the trace to ``path`` (exactly that name; no ``.npz`` is appended), atomically.

        The file is a numpy ``.npz`` archive (``numpy.savez``, or ``numpy.savez_compressed`` when
        ``compress``) with no pickled data. Version 1 holds exactly these arrays:

        - ``version``: 0-d int64, ``1``;
        - ``ids``: ``(n_tokens, n_layers, k)`` int16 or int32, ids in ``[-1, n_experts[i])``;
        - ``layers``: ``(n_layers,)`` int64, block indices, non-negative, strictly increasing;
        - ``n_experts``: ``(n_layers,)`` int64, each in ``[k, 65536]``, at most ``2**20`` in all;
        - ``metadata``: 0-d unicode string, a JSON object mapping str to str.

        The file is written to a temporary name in the same directory and renamed over ``path``; it
        gets the mode of any new file under the process's umask (0644 under umask 022).

        Raises:
            OSError: if the file cannot be written (a trace that cannot be created, in a missing or
                read-only folder, is named as ``path``, never as the temporary file beside it).
        """
        target = os.path.expanduser(os.fspath(path))
        if os.path.isdir(target):
            raise IsADirectoryError(errno.EISDIR, "a routing trace is a file; name one inside the directory", target)
        directory = os.path.dirname(os.path.abspath(target))
        arrays = {
            "version": np.array(TRACE_FORMAT_VERSION, dtype=np.int64),
            "ids": self.ids,
            "layers": np.array(self.layers, dtype=np.int64),
            "n_experts": np.array(self.n_experts, dtype=np.int64),
            "metadata": np.array(json.dumps(dict(self.metadata), sort_keys=True, allow_nan=False)),
        }
        try:
            fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".npz.tmp", dir=directory)
        except OSError as exc:  # name the user's path, not the temporary file's
            raise OSError(exc.errno, exc.strerror, target) from None
        try:
            with os.fdopen(fd, "wb") as f:
                (np.savez_compressed if compress else np.savez)(f, allow_pickle=False, **arrays)
            os.chmod(tmp, new_file_mode())  # mkstemp makes 0600; a trace gets the mode of any new file
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by :meth:`save`, checking every rule of ``docs/trace-format.md``.

        Nothing in the file is trusted: pickled data is refused, and the version, key set, dtypes,
        shapes, layers, expert counts, id ranges and metadata are all checked.

        Raises:
            FormatError: if the file is not a valid version-1 trace; the message names the file and
                the broken rule.
            OSError: if the file cannot be opened or read.
        """
        name = os.path.expanduser(os.fspath(path))
        try:
            # Opened here, not by np.load, so the file is closed even when numpy fails half-way.
            with open(name, "rb") as f:
                if f.read(4) != _ZIP_MAGIC:
                    raise FormatError(f"{name}: not a routing trace (a trace is an .npz archive, written by save())")
                f.seek(0)
                _check_member_sizes(name, f)
                f.seek(0)
                archive = np.load(f, allow_pickle=False)
                if not isinstance(archive, np.lib.npyio.NpzFile):
                    raise FormatError(f"{name}: not an .npz archive (a single .npy array?)")
                with archive:
                    ids, layers, n_experts, metadata = cls._read_arrays(name, archive)
        except FormatError:
            raise
        except _UNREADABLE as exc:
            # ValueError: pickled data refused, a bad .npy header or short data; BadZipFile, EOFError,
            # zlib.error: a truncated or corrupt archive.
            raise FormatError(f"{name}: not a readable routing trace: {exc}") from exc
        trace = cls.__new__(cls)
        try:
            trace._init(ids, layers, n_experts, metadata, FormatError)
        except FormatError as exc:
            raise FormatError(f"{name}: {exc}") from None
        return trace

    @staticmethod
    def _read_arrays(name: str, archive: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, str]]:
        keys = set(archive.files)
        if keys != _KEYS:
            missing, extra = sorted(_KEYS - keys), sorted(keys - _KEYS)
            raise FormatError(f"{name}: wrong keys for a routing trace: missing {missing}, unexpected {extra}")
        version = archive["version"]
        if version.shape != () or version.dtype.kind not in "iu" or int(version) != TRACE_FORMAT_VERSION:
            raise FormatError(
                f"{name}: unsupported trace version {version.tolist()!r} (dtype {version.dtype},"
                f" shape {version.shape}); this aioexperts reads version {TRACE_FORMAT_VERSION}"
            )
        ids = archive["ids"]
        if ids.dtype.kind != "i" or ids.dtype.itemsize not in (2, 4):
            raise FormatError(f"{name}: ids must have dtype int16 or int32, got {ids.dtype}")
        vectors = []
        for key in ("layers", "n_experts"):
            array = archive[key]
            if array.dtype.kind not in "iu" or array.ndim != 1:
                raise FormatError(f"{name}: {key} must be a 1-d integer array, got {array.dtype} {array.shape}")
            vectors.append(array)
        raw = archive["metadata"]
        if raw.shape != () or raw.dtype.kind != "U":
            raise FormatError(f"{name}: metadata must be a 0-d unicode string, got {raw.dtype} {raw.shape}")
        try:
            metadata = json.loads(raw.item())
        except json.JSONDecodeError as exc:
            raise FormatError(f"{name}: metadata is not valid JSON: {exc}") from None
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise FormatError(f"{name}: metadata must be a JSON object mapping str to str")
        return ids, vectors[0], vectors[1], metadata


class TraceRecorder:
    """Collects the routing decisions of a run into a :class:`RoutingTrace`.

    The runner calls :meth:`record` each time it routes a MoE layer. Without ``token_index`` the
    tokens are appended: each layer has its own cursor, so routing layer by layer for a batch, then
    the next batch, fills the rows in order. Steps never recorded read as ``-1`` (inactive).
    Recording a step twice overwrites it. Not thread-safe: record from one thread.

    Args:
        layers: the block indices of the MoE layers, strictly increasing.
        n_experts: routed experts per layer (an int for all layers).
        k: expert slots per token and layer (the router's top-k).
        metadata: free-form ``str -> str`` pairs stored with the trace.
        max_tokens: a bound on the number of recorded tokens (memory is
            ``max_tokens * n_layers * k * 2`` bytes for int16 ids), or ``None`` for no bound.
        keep_last: what happens past ``max_tokens``: False raises ``ConfigError``; True drops the
            oldest tokens (a ring, for long-running recorders; at least a quarter of ``max_tokens``
            at a time, so the copy is amortised); :attr:`dropped_tokens` counts them.

    Raises:
        ConfigError: for inconsistent arguments.
    """

    def __init__(
        self,
        layers: Iterable[int],
        n_experts: int | Iterable[int],
        k: int,
        *,
        metadata: Mapping[str, str] | None = None,
        max_tokens: int | None = None,
        keep_last: bool = False,
    ) -> None:
        layer_tuple = _layer_tuple(layers, ConfigError)
        experts_tuple = _as_int_tuple(n_experts, len(layer_tuple), "n_experts", ConfigError)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive int, got {k!r}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0
        ):
            raise ConfigError(f"max_tokens must be a non-negative int or None, got {max_tokens!r}")
        if keep_last and not max_tokens:
            raise ConfigError("keep_last needs a positive max_tokens")
        dtype = _ids_dtype_for(experts_tuple)
        # Validates layers, n_experts, k and metadata once, on an empty trace.
        RoutingTrace(np.empty((0, len(layer_tuple), k), dtype), layer_tuple, experts_tuple, metadata)
        self._layers = layer_tuple
        self._index = {layer: i for i, layer in enumerate(layer_tuple)}
        self._n_experts = experts_tuple
        self._k = k
        self._metadata = dict(metadata or {})
        self._max_tokens = max_tokens
        self._keep_last = keep_last
        self.dropped_tokens = 0
        self._buffer = np.full((0, len(layer_tuple), k), -1, dtype=dtype)
        self._cursor = [0] * len(layer_tuple)  # per layer: the next row for an append
        self._n_tokens = 0

    def __len__(self) -> int:
        """The number of tokens recorded so far (one past the highest row written)."""
        return self._n_tokens

    def record(self, layer: int, ids: npt.ArrayLike, token_index: int | None = None) -> None:
        """Record the ids selected at MoE layer ``layer`` for one token or a batch of tokens.

        Args:
            layer: the block index of the MoE layer.
            ids: ``(k,)`` for one token or ``(n, k)`` for ``n`` consecutive tokens, integers in
                ``[-1, n_experts)``.
            token_index: the row of the first token, or ``None`` to append at this layer's cursor.

        Raises:
            InvalidRequestError: if ``layer`` is not a MoE layer of the recorder or an id is out of range.
            ConfigError: if ``ids`` has the wrong shape, or ``max_tokens`` would be exceeded.
        """
        i = self._index.get(layer)
        if i is None:
            raise InvalidRequestError(f"layer {layer} is not one of the recorded MoE layers {list(self._layers)}")
        if (
            token_index is None
            and type(ids) is np.ndarray  # not a subclass (np.matrix, a masked array)
            and ids.shape == (1, self._k)
            and ids.dtype.kind in "iu"
            and (self._max_tokens is None or self._cursor[i] < self._max_tokens)
        ):  # a decode row appended with room for it (the router's, each layer of a token): fewer numpy calls
            row = ids[0]
            values = row.tolist()
            if min(values) < -1 or max(values) >= self._n_experts[i]:
                raise InvalidRequestError(
                    f"ids of layer {layer} must be in [-1, {self._n_experts[i]}), got {min(values)}..{max(values)}"
                )
            start = self._cursor[i]
            if start >= self._buffer.shape[0]:
                self._make_room(start + 1)
            self._buffer[start, i] = row
            self._cursor[i] = start + 1
            if start >= self._n_tokens:
                self._n_tokens = start + 1
            return
        rows = np.asarray(ids)
        if rows.ndim == 1:
            rows = rows[None, :]
        if rows.ndim != 2 or rows.shape[1] != self._k or (rows.size and rows.dtype.kind not in "iu"):
            raise ConfigError(
                f"ids must be integers of shape (k,) or (n, k) with k={self._k}, got {rows.dtype} {rows.shape}"
            )
        n = self._n_experts[i]
        if rows.size and (rows.min() < -1 or rows.max() >= n):
            raise InvalidRequestError(f"ids of layer {layer} must be in [-1, {n}), got {rows.min()}..{rows.max()}")
        start = self._cursor[i] if token_index is None else int(token_index)
        if start < 0:
            raise ConfigError(f"token_index must be non-negative, got {token_index}")
        stop = start + rows.shape[0]
        if self._max_tokens is not None and stop > self._max_tokens:
            if not self._keep_last or rows.shape[0] > self._max_tokens:
                raise ConfigError(f"recording tokens up to {stop} exceeds max_tokens={self._max_tokens}")
            if start < self._drop_for(stop):
                raise ConfigError(f"token {start} was dropped already (max_tokens={self._max_tokens}, keep_last)")
        dropped = self._make_room(stop)
        start, stop = start - dropped, stop - dropped
        self._buffer[start:stop, i, :] = rows
        self._cursor[i] = max(self._cursor[i], stop)
        self._n_tokens = max(self._n_tokens, stop)

    def reserve(self, n_tokens: int) -> int:
        """Set aside the next ``n_tokens`` rows for one batch of tokens; returns its first token's number.

        For callers that record a batch layer by layer while others record too (several token
        streams sharing one recorder): :meth:`record_token` with that number puts every layer's ids of
        the batch in its own rows, whatever was recorded in between. Token numbers count from the
        first token ever recorded (dropped ones included).
        """
        first = self._n_tokens + self.dropped_tokens
        stop = self._n_tokens + n_tokens
        stop -= self._make_room(stop)
        self._n_tokens = max(self._n_tokens, stop)
        self._cursor = [max(c, stop) for c in self._cursor]
        return first

    def _drop_for(self, stop: int) -> int:
        """Tokens ``keep_last`` drops so that rows up to ``stop`` fit (a quarter of the ring at least)."""
        if self._max_tokens is None or stop <= self._max_tokens or not self._keep_last:
            return 0
        return min(max(stop - self._max_tokens, self._max_tokens // 4), self._n_tokens)

    def _make_room(self, stop: int) -> int:
        """Drop the oldest tokens if ``keep_last`` needs to, grow the buffer to rows up to ``stop``;
        returns how many tokens were dropped (row numbers shift down by as many)."""
        drop = self._drop_for(stop)
        if drop:
            self._drop_oldest(drop)
        stop -= drop
        if stop > self._buffer.shape[0]:
            capacity = max(stop, 2 * self._buffer.shape[0], 64)
            if self._max_tokens is not None:
                capacity = min(capacity, self._max_tokens)
            grown = np.full((capacity, *self._buffer.shape[1:]), -1, dtype=self._buffer.dtype)
            grown[: self._n_tokens] = self._buffer[: self._n_tokens]
            self._buffer = grown
        return drop

    def record_token(self, layer: int, ids: npt.ArrayLike, token: int) -> None:
        """Record ``ids`` of layer ``layer`` in the rows :meth:`reserve` set aside, from token number ``token``.

        Rows dropped meanwhile (``keep_last``) are skipped.

        Raises:
            As :meth:`record`.
        """
        start = token - self.dropped_tokens
        rows = np.asarray(ids)
        n = 1 if rows.ndim == 1 else len(rows)
        if start + n <= 0:
            return
        if start < 0:
            rows, start = (rows[None, :] if rows.ndim == 1 else rows)[-start:], 0
        self.record(layer, rows, token_index=start)

    def _drop_oldest(self, n: int) -> None:
        kept = self._n_tokens - n
        self._buffer[:kept] = self._buffer[n : self._n_tokens]
        self._buffer[kept : self._n_tokens] = -1
        self._cursor = [max(c - n, 0) for c in self._cursor]
        self._n_tokens = kept
        self.dropped_tokens += n

    def trace(self) -> RoutingTrace:
        """A :class:`RoutingTrace` of everything recorded so far (a copy; recording may go on).

        With ``keep_last``, the oldest kept token is row 0 and the metadata's ``dropped_tokens``
        says how many came before it.
        """
        metadata = {**self._metadata, "dropped_tokens": str(self.dropped_tokens)} if self._keep_last else self._metadata
        return RoutingTrace(self._buffer[: self._n_tokens], self._layers, self._n_experts, metadata)

    def clear(self) -> None:
        """Forget every recorded token (keeps the layers, expert counts and metadata)."""
        self._buffer = self._buffer[:0]
        self._cursor = [0] * len(self._layers)
        self._n_tokens = 0


def _normalize_generator_args(
    n_tokens: int, layers: Iterable[int], n_experts: int | Iterable[int], k: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ConfigError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k must be a positive int, got {k!r}")
    layer_tuple = _layer_tuple(layers, ConfigError)
    if not layer_tuple:
        raise ConfigError("layers must name at least one MoE layer")
    experts_tuple = _as_int_tuple(n_experts, len(layer_tuple), "n_experts", ConfigError)
    if k > min(experts_tuple):
        raise ConfigError(f"k={k} exceeds the {min(experts_tuple)} experts of a layer")
    return layer_tuple, experts_tuple


def _meta(metadata: Mapping[str, str] | None, **generated: object) -> dict[str, str]:
    out = {key: str(value) for key, value in generated.items()}
    out.update(metadata or {})
    return out


def uniform_random_trace(
    n_tokens: int,
    layers: Iterable[int],
    n_experts: int | Iterable[int],
    k: int,
    seed: int,
    *,
    metadata: Mapping[str, str] | None = None,
) -> RoutingTrace:
    """A trace where every step selects ``k`` distinct experts uniformly at random, independently.

    The worst case for any cache: no popularity, no locality. Deterministic for a given ``seed``
    (``numpy.random.default_rng``). The metadata records the generator and its arguments; entries of
    ``metadata`` are added on top.

    Raises:
        ConfigError: if ``k`` exceeds the experts of a layer, or an argument is out of range.
    """
    layer_tuple, experts_tuple = _normalize_generator_args(n_tokens, layers, n_experts, k)
    rng = np.random.default_rng(seed)
    dtype = _ids_dtype_for(experts_tuple)
    ids = np.empty((n_tokens, len(layer_tuple), k), dtype=dtype)
    chunk = max(1, (1 << 22) // max(experts_tuple))  # bounds the scratch to ~32 MiB of float64
    for i, n in enumerate(experts_tuple):
        for start in range(0, n_tokens, chunk):
            stop = min(n_tokens, start + chunk)
            keys = rng.random((stop - start, n))
            ids[start:stop, i, :] = np.argpartition(keys, k - 1, axis=1)[:, :k]
    meta = _meta(metadata, generator="uniform_random_trace", seed=seed)
    return RoutingTrace(ids, layer_tuple, experts_tuple, meta)


def skewed_random_trace(
    n_tokens: int,
    layers: Iterable[int],
    n_experts: int | Iterable[int],
    k: int,
    seed: int,
    *,
    zipf_exponent: float = 1.0,
    locality: float = 0.5,
    metadata: Mapping[str, str] | None = None,
) -> RoutingTrace:
    """A trace with per-layer popularity skew and token-to-token locality, for cache benchmarks.

    The model, per MoE layer ``i`` with ``n = n_experts[i]``:

    - *Popularity*: a random permutation (drawn once per layer, so each layer has its own hot
      experts) gives every expert a rank ``r`` in ``0..n-1``; its weight is ``(r + 1) ** -zipf_exponent``
      (Zipf-like; ``0`` is uniform, ``1`` puts about ``1 / H(n)`` of the mass on the hottest expert).
    - *Locality*: for token ``t > 0``, each of the ``k`` experts selected at token ``t - 1`` in the
      same layer is kept, independently, with probability ``locality`` (so ``Binomial(k, locality)``
      experts are reused).
    - The remaining slots are filled by weighted sampling without replacement from the popularity
      weights, excluding the kept experts (Gumbel-top-k, i.e. successive draws proportional to
      weight). Ids within a step are distinct; there are no ``-1`` slots.

    Deterministic for a given ``seed``. The metadata records the generator and its parameters;
    entries of ``metadata`` are added on top.

    Args:
        zipf_exponent: popularity skew ``s >= 0``.
        locality: probability in ``[0, 1]`` that an expert of the previous token is kept.

    Raises:
        ConfigError: if ``k`` exceeds the experts of a layer, or a parameter is out of range.
    """
    layer_tuple, experts_tuple = _normalize_generator_args(n_tokens, layers, n_experts, k)
    if not (np.isfinite(zipf_exponent) and zipf_exponent >= 0):
        raise ConfigError(f"zipf_exponent must be finite and >= 0, got {zipf_exponent!r}")
    if not 0.0 <= locality <= 1.0:
        raise ConfigError(f"locality must be in [0, 1], got {locality!r}")
    rng = np.random.default_rng(seed)
    n_layers, width = len(layer_tuple), max(experts_tuple)
    log_weight = np.full((n_layers, width), -np.inf)
    for i, n in enumerate(experts_tuple):
        ranks = rng.permutation(n)
        log_weight[i, :n] = -zipf_exponent * np.log1p(ranks)
    dtype = _ids_dtype_for(experts_tuple)
    ids = np.empty((n_tokens, n_layers, k), dtype=dtype)
    rows = np.arange(n_layers)[:, None]
    previous: np.ndarray | None = None
    for t in range(n_tokens):
        keys = log_weight + rng.gumbel(size=(n_layers, width))
        if previous is not None:
            keep = rng.random((n_layers, k)) < locality
            keys[np.broadcast_to(rows, keep.shape)[keep], previous[keep]] = np.inf
        chosen = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        ids[t] = chosen
        previous = chosen
    meta = _meta(
        metadata,
        generator="skewed_random_trace",
        seed=seed,
        zipf_exponent=zipf_exponent,
        locality=locality,
    )
    return RoutingTrace(ids, layer_tuple, experts_tuple, meta)
