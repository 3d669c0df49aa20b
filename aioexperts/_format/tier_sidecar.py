"""The miss tier's sidecar GGUF: every routed expert of a model re-quantized to a smaller ggml type.

A GGUF file of its own (``general.architecture = "aioexperts-miss-tier"``) holding every routed
expert of a model in one low type (Q2_K, Q3_K or IQ4_XS). Version 2 (written now): per MoE block
``L``, bank ``b`` and expert ``e`` of the bank, one ``I8`` tensor ``blk.L.tier_expert.b.e`` of
the expert's gate, up and down bytes one after another (the bank's own matrix shapes, each
quantized to the low type; a merged ``gate_up`` bank is written as separate gate and up), so an
expert is one contiguous range and one read (three reads of a third the size run a disk at a
lower rate: docs/miss-tier.md). Version 1 (still read): per block and bank, three
stacked tensors ``blk.L.tier_gate.b``, ``blk.L.tier_up.b`` and ``blk.L.tier_down.b`` (numpy shape
``(n_experts_in_bank, rows, cols)``) in the low type. It is keyed to the model like the ``WEEPF001`` map
(docs/notes/FORMATS.md section 3): the size, device, inode and mtime of every shard of the model
it was made from, so a sidecar of another model, or of an older version of this one, is refused.
Written by :func:`aioexperts.write_miss_tier` (``aioexperts-tier``).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._errors import FormatError, StaleMapError
from .layout import Bank, ExpertLayout, ExpertLocation, Segment
from .model import GGUFModel, ShardInfo, open_model
from .staleness import IDENTITY_FIELDS, file_change

__all__ = (
    "TIER_ARCH",
    "TIER_KEYS",
    "TIER_VERSION",
    "TierSidecar",
    "read_tier_sidecar",
    "tier_expert_name",
    "tier_tensor_name",
)

TIER_ARCH = "aioexperts-miss-tier"
TIER_VERSION = 2
#: the versions this module reads (1: three stacked tensors per bank; 2: one tensor per expert)
READ_VERSIONS = (1, 2)
#: metadata keys of the sidecar
TIER_KEYS = {
    "version": "aioexperts.miss_tier.version",
    "type": "aioexperts.miss_tier.type",
    "sizes": "aioexperts.miss_tier.model.sizes",
    "devs": "aioexperts.miss_tier.model.devs",
    "inos": "aioexperts.miss_tier.model.inos",
    "mtimes": "aioexperts.miss_tier.model.mtimes_ns",
}
#: the ggml types a sidecar may hold (our quantizers: aioexperts._quant)
LOW_TYPES = (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ4_XS)


def tier_tensor_name(layer: int, projection: str, bank: int) -> str:
    """``blk.L.tier_{gate,up,down}.b`` (version 1)."""
    return f"blk.{layer}.tier_{projection}.{bank}"


def tier_expert_name(layer: int, bank: int, local: int) -> str:
    """``blk.L.tier_expert.b.e``: expert ``local`` of bank ``bank`` (version 2)."""
    return f"blk.{layer}.tier_expert.{bank}.{local}"


def expert_bytes(bank: Bank, ggml_type: GGMLQuantizationType) -> dict[str, int]:
    """Bytes of one expert's gate, up and down of ``bank`` in ``ggml_type`` (rows of whole blocks)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    return {p: cols // block * type_size * rows for p, (rows, cols) in bank_shapes(bank).items()}


def bank_shapes(bank: Bank) -> dict[str, tuple[int, int]]:
    """Numpy ``(rows, cols)`` of one expert's gate, up and down in ``bank``."""
    return {
        "gate": (bank.n_ff_exp, bank.n_embd),
        "up": (bank.n_ff_exp, bank.n_embd),
        "down": (bank.n_embd, bank.n_ff_down),
    }


@dataclass(frozen=True, slots=True)
class TierSidecar:
    """A sidecar checked against its model.

    Attributes:
        path: the sidecar file.
        shard: its identity when it was parsed (a read checks the open descriptor against it).
        ggml_type: the low type of every expert in it.
        segments: ``(layer, expert) -> (gate, up, down)`` byte ranges in the sidecar (their
            ``shard`` field is 0: the reader sets the index it opens the file as).
    """

    path: str
    shard: ShardInfo
    ggml_type: GGMLQuantizationType
    segments: dict[tuple[int, int], tuple[Segment, Segment, Segment]]

    def location(self, full: ExpertLocation, shard: int) -> ExpertLocation:
        """The low-tier copy of the expert at ``full``, its bytes in file ``shard`` of the reader."""
        gate, up, down = (
            Segment(shard, s.offset, s.n_bytes, s.ggml_type, s.shape) for s in self.segments[full.layer, full.expert]
        )
        return ExpertLocation(full.layer, full.expert, full.bank, full.local_id, gate, up, down)

    @property
    def payload_bytes(self) -> int:
        """Bytes of every expert in the sidecar."""
        return sum(s.n_bytes for segs in self.segments.values() for s in segs)


def model_identity(model: GGUFModel) -> dict[str, list[int]]:
    """The identity arrays a sidecar of ``model`` records (one entry per shard)."""
    shards = model.shards
    return {
        "sizes": [s.size for s in shards],
        "devs": [s.dev for s in shards],
        "inos": [s.ino for s in shards],
        "mtimes": [s.mtime_ns for s in shards],
    }


def _identity(recorded: dict[str, object], n: int) -> dict[str, list[int]] | None:
    """``recorded`` (the sidecar's identity metadata) if it is ``n`` ints per field, else None."""
    if all(isinstance(v, list) and len(v) == n and all(isinstance(x, int) for x in v) for v in recorded.values()):
        return {k: list(v) for k, v in recorded.items() if isinstance(v, list)}
    return None


def _stale_reason(rec: dict[str, list[int]], ours: dict[str, list[int]], model: GGUFModel) -> str:
    """Why a sidecar's recorded identity ``rec`` differs from the model's (``ours``), in words: for
    each model file whose identity changed, another file or another version of it (mtimes, sizes)."""
    reasons = (
        file_change(
            os.path.basename(shard.path),
            "the sidecar",
            [rec[f][i] for f in IDENTITY_FIELDS],
            [ours[f][i] for f in IDENTITY_FIELDS],
        )
        for i, shard in enumerate(model.shards)
    )
    return "; ".join(r for r in reasons if r)


def read_tier_sidecar(path: str | os.PathLike[str], model: GGUFModel, layout: ExpertLayout) -> TierSidecar:
    """Parse the sidecar at ``path`` and check it against ``model`` and its ``layout``.

    Blocking (parses the header): call it from a worker thread under an event loop.

    Raises:
        StaleMapError: the sidecar was written for another model or an older version of it
            (a shard's size, device, inode or mtime differ); the message names the model files
            that changed and the ``aioexperts-tier`` command that writes it again; the raw
            identities are its ``recorded`` and ``current``.
        FormatError: not a sidecar, another version, a tensor missing or of the wrong type,
            shape or size.
        FileNotFoundError: no such file.
    """
    side = open_model(path)
    where = side.path
    if side.architecture != TIER_ARCH:
        raise FormatError(f"{where} is not a miss-tier sidecar (general.architecture {side.architecture!r})")
    if len(side.shards) != 1:
        raise FormatError(f"{where}: a miss-tier sidecar is one file, not a split set")
    version = side.metadata.get(TIER_KEYS["version"])
    if isinstance(version, bool) or not isinstance(version, int) or version not in READ_VERSIONS:
        raise FormatError(
            f"{where}: miss-tier sidecar version {version!r}; this aioexperts reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    raw_type = side.metadata.get(TIER_KEYS["type"])
    try:
        ggml_type = GGMLQuantizationType(int(raw_type) if isinstance(raw_type, int) else -1)
    except ValueError:
        raise FormatError(f"{where}: unknown ggml type {raw_type!r}") from None
    if ggml_type not in LOW_TYPES:
        raise FormatError(f"{where}: type {ggml_type.name} is not a miss-tier type (Q2_K, Q3_K, IQ4_XS)")
    ours = model_identity(model)
    rec = _identity({name: side.metadata.get(TIER_KEYS[name]) for name in ours}, len(model.shards))
    if rec != ours:
        if rec is None:
            reason = f"the sidecar was not written for a model of {len(model.shards)} file(s)"
        else:
            reason = _stale_reason(rec, ours, model)
        type_flag = "" if ggml_type == GGMLQuantizationType.Q3_K else f" --type {ggml_type.name}"  # Q3_K: the default
        again = f"aioexperts-tier {shlex.quote(model.path)} -o {shlex.quote(where)}{type_flag}"
        raise StaleMapError(
            f"the miss-tier sidecar {where} does not match the model {model.path}: {reason}; write it again "
            f"with {again}",
            recorded=rec,
            current=ours,
        )
    read = _segments_v1 if version == 1 else _segments_v2
    # the NextN blocks are left out of a sidecar (as of the default layout): their experts, when a
    # layout keeps them, have no low copy and are read in full
    main = layout if not layout.include_nextn else _without_nextn(layout)
    segments = read(side, where, main, ggml_type)
    return TierSidecar(where, side.shards[0], ggml_type, segments)


def _without_nextn(layout: ExpertLayout) -> ExpertLayout:
    """``layout`` without its NextN blocks (the layers a sidecar holds)."""
    kept = {i: m for i, m in layout.layers.items() if i not in layout.nextn_layers}
    return ExpertLayout(kept, layout.n_expert_used, layout.n_embd, layout.nextn_layers, include_nextn=False)


Segments = dict[tuple[int, int], tuple[Segment, Segment, Segment]]


def _checked_sizes(bank: Bank, ggml_type: GGMLQuantizationType, where: str) -> dict[str, int]:
    """:func:`expert_bytes`, or FormatError when a row of ``bank`` is not whole blocks of the type."""
    if any(cols % GGML_QUANT_SIZES[ggml_type][0] for _, cols in bank_shapes(bank).values()):
        raise FormatError(f"{where}: the model's expert rows are not whole {ggml_type.name} blocks")
    return expert_bytes(bank, ggml_type)


def _segments_v2(side: GGUFModel, where: str, layout: ExpertLayout, ggml_type: GGMLQuantizationType) -> Segments:
    """Version 2: each expert's tensor, checked, cut into its gate, up and down."""
    segments: Segments = {}
    for moe in layout.layers.values():
        for bank in moe.banks:
            sizes = _checked_sizes(bank, ggml_type, where)
            shapes = bank_shapes(bank)
            total = sum(sizes.values())
            for local in range(bank.n_experts):
                name = tier_expert_name(moe.index, bank.index, local)
                info = side.tensors.get(name)
                if info is None:
                    raise FormatError(
                        f"{where}: tensor {name!r} is missing (layer {moe.index}, bank {bank.index}, expert {local})"
                    )
                if info.ggml_type != GGMLQuantizationType.I8 or info.dims != (total,) or info.n_bytes != total:
                    raise FormatError(
                        f"{where}: {name} is {info.ggml_type.name} {list(info.dims)}, the model needs I8 [{total}] "
                        f"({ggml_type.name} gate, up and down)"
                    )
                offset = info.data_offset
                parts = []
                for p in ("gate", "up", "down"):
                    parts.append(Segment(0, offset, sizes[p], ggml_type, shapes[p]))
                    offset += sizes[p]
                segments[moe.index, bank.first_expert + local] = (parts[0], parts[1], parts[2])
    return segments


def _segments_v1(side: GGUFModel, where: str, layout: ExpertLayout, ggml_type: GGMLQuantizationType) -> Segments:
    """Version 1: three stacked tensors per bank, checked, cut into experts."""
    segments: Segments = {}
    for moe in layout.layers.values():
        for bank in moe.banks:
            sizes = _checked_sizes(bank, ggml_type, where)
            found: dict[str, int] = {}  # projection -> data offset
            for projection, (rows, cols) in bank_shapes(bank).items():
                name = tier_tensor_name(moe.index, projection, bank.index)
                info = side.tensors.get(name)
                if info is None:
                    raise FormatError(f"{where}: tensor {name!r} is missing (layer {moe.index}, bank {bank.index})")
                want = (cols, rows, bank.n_experts)
                if info.ggml_type != ggml_type or info.dims != want:
                    raise FormatError(
                        f"{where}: {name} is {info.ggml_type.name} {list(info.dims)}, the model needs "
                        f"{ggml_type.name} {list(want)}"
                    )
                if info.n_bytes != sizes[projection] * bank.n_experts:
                    raise FormatError(f"{where}: {name} holds {info.n_bytes} bytes, not {bank.n_experts} experts")
                found[projection] = info.data_offset
            shapes = bank_shapes(bank)
            for local in range(bank.n_experts):
                gate, up, down = (
                    Segment(0, found[p] + local * sizes[p], sizes[p], ggml_type, shapes[p])
                    for p in ("gate", "up", "down")
                )
                segments[moe.index, bank.first_expert + local] = (gate, up, down)
    return segments
