"""The ``WEEPF001`` expert map: a small binary index of every expert's byte ranges (docs/notes/FORMATS.md section 3).

Layout (little-endian)::

    char[8] magic "WEEPF001"
    u64 model file size (bytes), u64 st_dev, u64 st_ino, u64 st_mtime (ns)
    u32 n_layers                          record i describes block i
    per layer: u32 n_experts (1..512), then per expert 3 x (u64 offset, u64 length) for gate, up, down

The format has no layer numbers: record ``i`` is block ``i`` of the model, because the prefetcher
that consumes these maps looks a record up by the block number ``N`` of llama.cpp's
``ffn_moe_topk-N`` tensor, and a record cannot have zero experts. A model whose MoE blocks are not
exactly ``0..n-1`` (leading dense blocks as in glm4moe and deepseek2, interleaved dense blocks as in
ernie4_5-moe and llama4) cannot be described: :func:`write_expert_map` and
:func:`check_map_matches_layout` refuse it with :class:`~aioexperts._errors.ConfigError` rather than
shift the records. NextN / MTP blocks at the end are not in the layout (llama.cpp never runs them),
so a model whose other MoE blocks are ``0..n-1`` gets ``n`` records and no record for them. The
format has no shard field either, so it describes single-file models only; a split set is refused.
"""

from __future__ import annotations

import os
import shlex
import struct
import tempfile
from dataclasses import dataclass

from .._errors import ConfigError, FormatError, StaleMapError
from .filemode import new_file_mode
from .layout import ExpertLayout
from .model import GGUFModel, ShardInfo, check_regular_file
from .staleness import IDENTITY_FIELDS, file_change

__all__ = ("EXPERT_MAP_MAGIC", "ExpertMap", "check_map_matches_layout", "read_expert_map", "write_expert_map")

EXPERT_MAP_MAGIC = b"WEEPF001"
MAX_EXPERTS_PER_LAYER = 512
MAX_RANGE_BYTES = 8 << 20
MAX_LAYERS = 4096
_HEADER = struct.Struct("<8sQQQQI")
_COUNT = struct.Struct("<I")
_RANGE_BYTES = 16
_EXPERT_BYTES = 3 * _RANGE_BYTES
_MAX_FILE = _HEADER.size + MAX_LAYERS * (4 + MAX_EXPERTS_PER_LAYER * _EXPERT_BYTES)

Range = tuple[int, int]
ExpertRanges = tuple[Range, Range, Range]


@dataclass(frozen=True, slots=True)
class ExpertMap:
    """A parsed expert map.

    Attributes:
        model_size, dev, ino, mtime_ns: identity of the model file the map was made for.
        layers: per block (record ``i`` is block ``i``), per expert, ``((offset, length) gate, up,
            down)`` in bytes.
    """

    model_size: int
    dev: int
    ino: int
    mtime_ns: int
    layers: tuple[tuple[ExpertRanges, ...], ...]

    def check_model(self, shard: ShardInfo) -> None:
        """Refuse a map made for another file or an older version of it.

        Raises:
            StaleMapError: size, device, inode or mtime differ; the message says how (local times,
                not raw numbers), the raw identities are its ``recorded`` and ``current``.
        """
        theirs = (self.model_size, self.dev, self.ino, self.mtime_ns)
        ours = (shard.size, shard.dev, shard.ino, shard.mtime_ns)
        if theirs != ours:
            reason = file_change(os.path.basename(shard.path), "the map", theirs, ours)
            raise StaleMapError(
                f"the map does not match the model {shard.path}: {reason}; write it again "
                f"(aioexperts-map write {shlex.quote(shard.path)} -o MAP)",
                recorded={k: [v] for k, v in zip(IDENTITY_FIELDS, theirs, strict=True)},
                current={k: [v] for k, v in zip(IDENTITY_FIELDS, ours, strict=True)},
            )


def _require_blocks_from_zero(layout: ExpertLayout, what: str) -> None:
    """Refuse a layout whose MoE blocks are not ``0..n-1``: record ``i`` must describe block ``i``."""
    blocks = list(layout.layers)
    if blocks != list(range(len(blocks))):
        raise ConfigError(
            f"{what}: WEEPF001 record i describes block i (docs/notes/FORMATS.md section 3) and a record cannot "
            f"have zero experts, but this model's MoE blocks are {_blocks(blocks)} (leading or interleaved dense "
            "blocks): the format cannot describe it, so no map is written or used for it"
        )


def _blocks(blocks: list[int]) -> str:
    if blocks and blocks == list(range(blocks[0], blocks[-1] + 1)):
        return f"{blocks[0]}..{blocks[-1]}"
    return str(blocks)


def _layout_ranges(layout: ExpertLayout) -> list[list[ExpertRanges]]:
    out: list[list[ExpertRanges]] = []
    for moe in layout.layers.values():
        rows: list[ExpertRanges] = []
        for e in range(moe.n_experts):
            loc = moe.locate(e)
            g, u, d = loc.gate, loc.up, loc.down
            rows.append(((g.offset, g.n_bytes), (u.offset, u.n_bytes), (d.offset, d.n_bytes)))
        out.append(rows)
    return out


def write_expert_map(model: GGUFModel, layout: ExpertLayout, path: str | os.PathLike[str]) -> None:
    """Write the map of ``layout`` for the single-file ``model`` to ``path`` (atomically: temp + rename).

    Record ``i`` is block ``i``; NextN blocks left out of ``layout`` get no record.

    Raises:
        ConfigError: ``path`` is the model file itself (same device and inode), ``model`` is a
            split set, its MoE blocks are not ``0..n-1`` (leading or
            interleaved dense blocks: the format indexes records by block number), or an expert or
            layer count or range length is outside what the format can hold (lengths are at most
            8 MiB).
    """
    if len(model.shards) != 1:
        raise ConfigError(f"WEEPF001 maps describe one file; {model.path} is a split set of {len(model.shards)}")
    _require_blocks_from_zero(layout, model.path)
    shard = model.shards[0]
    if (
        min(shard.size, shard.dev, shard.ino, shard.mtime_ns) < 0
        or max(shard.dev, shard.ino, shard.mtime_ns) >= 1 << 64
    ):
        raise ConfigError(
            f"{shard.path}: its identity (device {shard.dev}, inode {shard.ino}, mtime {shard.mtime_ns} ns) "
            "does not fit the map's u64 fields (an mtime before 1970?)"
        )
    layers = _layout_ranges(layout)
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ConfigError(f"WEEPF001 holds 1..{MAX_LAYERS} layers, the model has {len(layers)}")
    parts = [_HEADER.pack(EXPERT_MAP_MAGIC, shard.size, shard.dev, shard.ino, shard.mtime_ns, len(layers))]
    for rows in layers:
        if not 1 <= len(rows) <= MAX_EXPERTS_PER_LAYER:
            raise ConfigError(f"WEEPF001 holds 1..{MAX_EXPERTS_PER_LAYER} experts a layer, got {len(rows)}")
        parts.append(_COUNT.pack(len(rows)))
        for ranges in rows:
            for off, n in ranges:
                if not 1 <= n <= MAX_RANGE_BYTES:
                    raise ConfigError(f"WEEPF001 ranges are 1..{MAX_RANGE_BYTES} bytes, an expert needs {n}")
                parts.append(struct.pack("<QQ", off, n))
    try:
        target = os.stat(path)
    except OSError:
        pass
    else:
        if (target.st_dev, target.st_ino) == (shard.dev, shard.ino):
            raise ConfigError(f"{os.fspath(path)} is the model {shard.path}: a map is never written over its model")
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=".weepf-", dir=directory)
    except OSError as exc:  # name the user's path, not the temporary file's
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(parts))
        os.chmod(tmp, new_file_mode())  # mkstemp makes 0600; a map gets the mode of any new file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_expert_map(path: str | os.PathLike[str], model: ShardInfo | None = None) -> ExpertMap:
    """Read and validate a map; with ``model``, also refuse one made for another file.

    Raises:
        FormatError: not a regular file (a directory, a FIFO or a device: checked before it is
            opened) or a loop of symbolic links, wrong magic, truncated, trailing bytes, a count,
            offset or length out of range.
        StaleMapError: ``model`` differs in size, device, inode or mtime.
        OSError: ``path`` cannot be read (``FileNotFoundError``, ``PermissionError``).
    """
    path = os.fspath(path)
    check_regular_file(path, "a WEEPF001 expert map")
    with open(path, "rb") as f:
        blob = f.read(_MAX_FILE + 1)
    if len(blob) > _MAX_FILE:
        raise FormatError(f"{path}: larger than any WEEPF001 map can be ({_MAX_FILE} bytes)")
    if len(blob) < _HEADER.size:
        raise FormatError(f"{path}: truncated WEEPF001 header ({len(blob)} bytes)")
    magic, size, dev, ino, mtime_ns, n_layers = _HEADER.unpack_from(blob, 0)
    if magic != EXPERT_MAP_MAGIC:
        raise FormatError(f"{path}: magic {magic!r} is not {EXPERT_MAP_MAGIC!r}")
    if not 1 <= n_layers <= MAX_LAYERS:
        raise FormatError(f"{path}: n_layers={n_layers}, expected 1..{MAX_LAYERS}")
    pos = _HEADER.size
    layers: list[tuple[ExpertRanges, ...]] = []
    for li in range(n_layers):
        if pos + 4 > len(blob):
            raise FormatError(f"{path}: truncated at layer {li} of {n_layers}")
        (n_experts,) = _COUNT.unpack_from(blob, pos)
        pos += 4
        if not 1 <= n_experts <= MAX_EXPERTS_PER_LAYER:
            raise FormatError(f"{path}: layer {li} has n_experts={n_experts}, expected 1..{MAX_EXPERTS_PER_LAYER}")
        end = pos + n_experts * _EXPERT_BYTES
        if end > len(blob):
            raise FormatError(f"{path}: truncated in layer {li} ({n_experts} experts need {end} bytes)")
        values = struct.unpack_from(f"<{n_experts * 6}Q", blob, pos)
        pos = end
        rows: list[ExpertRanges] = []
        for e in range(n_experts):
            v = values[6 * e : 6 * e + 6]
            ranges = ((v[0], v[1]), (v[2], v[3]), (v[4], v[5]))
            for off, n in ranges:
                if not 1 <= n <= MAX_RANGE_BYTES or off + n > size:
                    raise FormatError(
                        f"{path}: layer {li} expert {e}: range offset={off} length={n} is outside "
                        f"1..{MAX_RANGE_BYTES} bytes within a {size}-byte model"
                    )
            rows.append(ranges)
        layers.append(tuple(rows))
    if pos != len(blob):
        raise FormatError(f"{path}: {len(blob) - pos} trailing bytes after the last layer")
    emap = ExpertMap(size, dev, ino, mtime_ns, tuple(layers))
    if model is not None:
        emap.check_model(model)
    return emap


def check_map_matches_layout(emap: ExpertMap, layout: ExpertLayout, where: str = "expert map") -> None:
    """Refuse a map whose ranges are not the ones the model's header gives.

    Record ``i`` is compared with block ``i`` of ``layout``.

    Raises:
        ConfigError: the layout's MoE blocks are not ``0..n-1``, which no WEEPF001 map can describe.
        StaleMapError: a different layer or expert count, or any range differs.
    """
    _require_blocks_from_zero(layout, where)
    ours = _layout_ranges(layout)
    if len(ours) != len(emap.layers):
        raise StaleMapError(f"{where}: {len(emap.layers)} layers, the model has {len(ours)} MoE layers; regenerate it")
    for li, (a, b) in enumerate(zip(emap.layers, ours, strict=True)):
        if list(a) != b:
            raise StaleMapError(f"{where}: MoE layer record {li} differs from the model (block {li}); regenerate it")
