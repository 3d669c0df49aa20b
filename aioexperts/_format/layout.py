"""The expert layout: for each MoE layer its router, its banks, and where every expert's bytes are.

Follows docs/notes/FORMATS.md sections 1 and 2; NextN / MTP blocks are left out unless asked for (see
:func:`build_layout`). A layer's experts live in up to four banks (``ffn_*_exps``
and ``ffn_*_exps_tier1..3``), each a stacked tensor triple (or a merged ``ffn_gate_up_exps`` plus
``ffn_down_exps``) with its own ggml type. Global expert id ``g`` (the router's output index) is in
the bank whose range contains it, at local id ``g - bank.first_expert``. Expert ``e`` of a stacked
tensor is the byte run ``[data_offset + e*B, data_offset + (e+1)*B)``,
``B = row_bytes(type, ne0) * ne1``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._errors import InvalidRequestError, LayoutError
from .keys import not_an_moe_model
from .model import GGUFModel, TensorInfo

__all__ = ("Bank", "ExpertLayout", "ExpertLocation", "MoELayer", "Segment", "build_layout")

MAX_BANKS = 4
# Canonical names only (llama.cpp writes ``blk.%d.``): no leading zeros, ASCII digits, at most 6.
_LAYER = r"(0|[1-9][0-9]{0,5})"
_EXPERT_TENSOR_RE = re.compile(rf"^blk\.{_LAYER}\.ffn_(gate|up|down|gate_up)_exps(?:_tier([1-9]))?\.weight$")
_ROUTER_RE = re.compile(rf"^blk\.{_LAYER}\.ffn_gate_inp\.weight$")
_LOOKS_LIKE_MOE_RE = re.compile(r"^blk\.[^.]*\.ffn_(?:(?:gate|up|down|gate_up)_exps(?:_tier[^.]*)?|gate_inp)\.weight$")


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous byte range of an expert in a model file.

    Attributes:
        shard: index of the file in ``GGUFModel.shards``.
        offset: absolute byte offset in that file (not aligned).
        n_bytes: length in bytes.
        ggml_type: type of the bytes.
        shape: numpy ``(rows, cols)`` of the matrix these bytes hold.
    """

    shard: int
    offset: int
    n_bytes: int
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.n_bytes


@dataclass(frozen=True, slots=True)
class ExpertLocation:
    """Where one expert's gate, up and down bytes are.

    For a merged ``ffn_gate_up_exps`` bank, ``gate`` and ``up`` are adjacent halves of one run.
    """

    layer: int
    expert: int
    bank: int
    local_id: int
    gate: Segment
    up: Segment
    down: Segment

    @property
    def segments(self) -> tuple[Segment, Segment, Segment]:
        """``(gate, up, down)``."""
        return (self.gate, self.up, self.down)

    @property
    def n_bytes(self) -> int:
        """Payload bytes of the three projections."""
        return self.gate.n_bytes + self.up.n_bytes + self.down.n_bytes


@dataclass(frozen=True, slots=True)
class Bank:
    """One bank of a layer: a stacked tensor triple (or merged gate_up + down) of one type set.

    Attributes:
        index: 0 for ``ffn_*_exps``, 1..3 for ``_tier1..3``.
        first_expert: global id of local expert 0.
        n_experts: experts in this bank (ggml ``ne2``).
        gate, up: the stacked tensors; for a merged bank both are the ``gate_up`` tensor.
        down: the stacked down tensor.
        merged: True for ``ffn_gate_up_exps``.
        n_embd, n_ff_exp: matrix sizes (gate/up are ``(n_ff_exp, n_embd)``).
        n_ff_down: the down matrix input width (``>= n_ff_exp``, zero-padded activations).
    """

    index: int
    first_expert: int
    n_experts: int
    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo
    merged: bool
    n_embd: int
    n_ff_exp: int
    n_ff_down: int

    @property
    def gate_bytes(self) -> int:
        """Bytes of one expert's gate (for a merged bank: half of its gate_up run)."""
        return _row_bytes(self.gate) * self.n_ff_exp

    @property
    def up_bytes(self) -> int:
        """Bytes of one expert's up."""
        return _row_bytes(self.up) * self.n_ff_exp

    @property
    def down_bytes(self) -> int:
        """Bytes of one expert's down."""
        return _row_bytes(self.down) * self.n_embd

    def locate(self, layer: int, local_id: int) -> ExpertLocation:
        """Location of local expert ``local_id`` (assumed in range)."""
        g, u, d = self.gate, self.up, self.down
        if self.merged:
            run = g.data_offset + local_id * (self.gate_bytes + self.up_bytes)
            gate = Segment(g.shard, run, self.gate_bytes, g.ggml_type, (self.n_ff_exp, self.n_embd))
            up = Segment(u.shard, run + self.gate_bytes, self.up_bytes, u.ggml_type, (self.n_ff_exp, self.n_embd))
        else:
            gate = Segment(
                g.shard,
                g.data_offset + local_id * self.gate_bytes,
                self.gate_bytes,
                g.ggml_type,
                (self.n_ff_exp, self.n_embd),
            )
            up = Segment(
                u.shard,
                u.data_offset + local_id * self.up_bytes,
                self.up_bytes,
                u.ggml_type,
                (self.n_ff_exp, self.n_embd),
            )
        down = Segment(
            d.shard,
            d.data_offset + local_id * self.down_bytes,
            self.down_bytes,
            d.ggml_type,
            (self.n_embd, self.n_ff_down),
        )
        return ExpertLocation(layer, self.first_expert + local_id, self.index, local_id, gate, up, down)


@dataclass(frozen=True, slots=True)
class MoELayer:
    """One MoE block.

    Attributes:
        index: block index ``L``.
        router: ``blk.L.ffn_gate_inp.weight``, ggml dims ``[n_embd, n_experts]``.
        banks: banks in order; their id ranges tile ``[0, n_experts)``.
        n_experts: experts of this layer (router outputs).
        mixed_tier: the layer has tier banks or fewer experts than ``expert_count``.
    """

    index: int
    router: TensorInfo
    banks: tuple[Bank, ...]
    n_experts: int
    mixed_tier: bool

    def bank_of(self, expert: int) -> Bank:
        """The bank holding global id ``expert`` (assumed in range)."""
        for bank in self.banks:
            if expert < bank.first_expert + bank.n_experts:
                return bank
        raise AssertionError("unreachable: expert id checked by the caller")

    def locate(self, expert: int) -> ExpertLocation:
        """Location of global id ``expert``.

        Raises:
            InvalidRequestError: ``expert`` is not in ``[0, n_experts)``.
        """
        try:
            expert = operator.index(expert)
        except TypeError:
            raise InvalidRequestError(f"expert ids must be ints, got {expert!r}") from None
        if not 0 <= expert < self.n_experts:
            raise InvalidRequestError(
                f"layer {self.index} has experts 0..{self.n_experts - 1}; expert {expert} does not exist"
            )
        bank = self.bank_of(expert)
        return bank.locate(self.index, expert - bank.first_expert)


class ExpertLayout:
    """Every MoE layer of a model and where each of its experts is.

    Attributes:
        layers: block index -> :class:`MoELayer`, in increasing order. NextN / MTP blocks are left
            out unless the layout was built with ``include_nextn=True``.
        n_expert_used: experts chosen per token (``expert_used_count``).
        n_embd: embedding width.
        nextn_layers: the NextN / multi-token-prediction blocks of the model that have experts
            (the last ``nextn_predict_layers`` blocks), whether or not they are in ``layers``.
        include_nextn: whether ``layers`` holds the NextN blocks too.
    """

    def __init__(
        self,
        layers: Mapping[int, MoELayer],
        n_expert_used: int,
        n_embd: int,
        nextn_layers: tuple[int, ...] = (),
        include_nextn: bool = False,
    ) -> None:
        self.layers: Mapping[int, MoELayer] = dict(sorted(layers.items()))
        self.n_expert_used = n_expert_used
        self.n_embd = n_embd
        self.nextn_layers = nextn_layers
        self.include_nextn = include_nextn

    def layer(self, layer: int) -> MoELayer:
        """The MoE layer with block index ``layer``.

        Raises:
            InvalidRequestError: the model has no MoE layer ``layer``.
        """
        if not isinstance(layer, bool):  # True == 1 as a dict key: refuse bools
            try:
                layer = operator.index(layer)  # numpy ints are fine, 1.0 is not
            except TypeError:
                pass
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.layers:
            hint = ""
            if layer in self.nextn_layers:
                hint = " (a NextN/MTP block, left out as llama.cpp does; build_layout(include_nextn=True) keeps it)"
            raise InvalidRequestError(f"no MoE layer {layer!r}; MoE layers are {_ranges(list(self.layers))}{hint}")
        return self.layers[layer]

    def locate(self, layer: int, expert: int) -> ExpertLocation:
        """Location of ``expert`` (global id) of ``layer`` (block index).

        Raises:
            InvalidRequestError: no such layer or expert.
        """
        return self.layer(layer).locate(expert)

    def __iter__(self) -> Iterator[ExpertLocation]:
        """Every expert of every layer, in layer then id order."""
        for moe in self.layers.values():
            for e in range(moe.n_experts):
                yield moe.locate(e)

    @property
    def n_experts_total(self) -> int:
        """Experts summed over layers."""
        return sum(m.n_experts for m in self.layers.values())

    @property
    def max_expert_bytes(self) -> int:
        """Largest payload (gate + up + down bytes) of any expert."""
        return max(b.gate_bytes + b.up_bytes + b.down_bytes for m in self.layers.values() for b in m.banks)

    def __repr__(self) -> str:
        return f"ExpertLayout(layers={_ranges(list(self.layers))}, experts={self.n_experts_total})"


def _row_bytes(t: TensorInfo) -> int:
    block_size, type_size = GGML_QUANT_SIZES[t.ggml_type]
    return t.dims[0] // block_size * type_size


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)


def build_layout(model: GGUFModel, *, include_nextn: bool = False) -> ExpertLayout:
    """Find every MoE layer of ``model`` and check it against docs/notes/FORMATS.md's rules.

    A block is an MoE layer when it has a router and expert tensors. The last
    ``{arch}.nextn_predict_layers`` blocks (counted in ``block_count``) are NextN / MTP blocks:
    llama.cpp loads their tensors with ``TENSOR_SKIP`` and its graph stops before them
    (``for (il = 0; il < n_layer; ...)`` with ``n_layer = n_layer_all - n_layer_nextn``; e.g.
    ``src/models/glm4-moe.cpp``, ``bailingmoe2.cpp``). They are left out of ``layers`` (so the
    runner never prefetches or runs them) unless ``include_nextn`` is set, for hosts that run MTP.

    Args:
        model: the parsed model.
        include_nextn: keep the NextN blocks in ``layers`` (they are still listed in
            ``nextn_layers`` either way).

    Raises:
        LayoutError: a rule is broken (missing projection, mismatched dims or counts, a bank gap,
            router size out of range, a tensor size that is not ``n_experts * B``, expert or
            router tensors of a block at or past ``block_count``), or ``nextn_predict_layers`` is
            not an integer in ``0..block_count-1``.
        FormatError: a required metadata key (``expert_count``, ``expert_used_count``,
            ``embedding_length``) is missing.
    """
    n_expert = _required_int(model, "expert_count")
    n_used = _required_int(model, "expert_used_count")
    n_embd = _required_int(model, "embedding_length")
    # the expert width the metadata allows: expert_feed_forward_length, or feed_forward_length for the
    # archs whose loader creates the expert tensors n_ff wide (llama, olmoe, dbrx, hunyuan-moe, ...)
    n_ff_key = model.key("expert_feed_forward_length")
    n_ff_dense = model.key("feed_forward_length")
    first_nextn = _first_nextn_block(model)
    by_layer: dict[int, dict[tuple[str, int], TensorInfo]] = {}
    for name, info in model.tensors.items():
        m = _EXPERT_TENSOR_RE.match(name)
        if m is None:
            if _LOOKS_LIKE_MOE_RE.match(name) and not _ROUTER_RE.match(name):
                raise LayoutError(
                    f"tensor {name[:80]!r} looks like an expert or router tensor but its layer or tier "
                    "number is not canonical (blk.N. with N in 0..999999 without leading zeros, _tier1.._tier3)"
                )
            continue
        tier = int(m[3]) if m[3] is not None else 0
        if m[3] is not None and not 1 <= tier < MAX_BANKS:
            raise LayoutError(f"{name}: tier {tier} is out of range (1..{MAX_BANKS - 1})")
        by_layer.setdefault(int(m[1]), {})[(m[2], tier)] = info
    routers = {int(m[1]): info for name, info in model.tensors.items() if (m := _ROUTER_RE.match(name))}
    layers: dict[int, MoELayer] = {}
    nextn: list[int] = []
    n_blocks = model.key("block_count")
    if isinstance(n_blocks, int) and not isinstance(n_blocks, bool) and n_blocks >= 0:  # absent: unknown
        beyond = sorted(i for i in set(by_layer) | set(routers) if i >= n_blocks)
        if beyond:  # llama.cpp refuses the file too ("wrong number of tensors")
            raise LayoutError(
                f"{model.path}: expert or router tensors of block {beyond[0]}, but "
                f"{model.architecture}.block_count={n_blocks}"
                + (f" (blocks 0..{n_blocks - 1})" if n_blocks else " (no blocks)")
            )
    for index in sorted(set(by_layer) | set(routers)):
        if first_nextn is not None and index >= first_nextn:
            nextn.append(index)
            if not include_nextn:
                continue
        if index not in routers:
            raise LayoutError(f"layer {index} has expert tensors but no router blk.{index}.ffn_gate_inp.weight")
        if index not in by_layer:
            raise LayoutError(f"layer {index} has a router but no expert tensors")
        layers[index] = _build_layer(
            index, routers[index], by_layer[index], n_expert, n_used, n_embd, n_ff_key, n_ff_dense
        )
    if not layers:
        raise LayoutError(f"{model.path}: no MoE layers (no blk.N.ffn_*_exps tensors)")
    return ExpertLayout(layers, n_used, n_embd, tuple(nextn), include_nextn)


def _first_nextn_block(model: GGUFModel) -> int | None:
    """The first NextN block (``block_count - nextn_predict_layers``), or None when there is none."""
    n_nextn = model.key("nextn_predict_layers", 0)
    if n_nextn == 0:
        return None
    n_blocks = model.key("block_count")
    arch = model.architecture
    if not isinstance(n_nextn, int) or isinstance(n_nextn, bool) or n_nextn < 0:
        raise LayoutError(f"{model.path}: {arch}.nextn_predict_layers={n_nextn!r} is not a non-negative integer")
    if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or not 0 <= n_nextn < n_blocks:
        # llama.cpp: GGML_ASSERT(n_layer_nextn < n_layer_all)
        raise LayoutError(
            f"{model.path}: {arch}.nextn_predict_layers={n_nextn} needs {arch}.block_count above it, got {n_blocks!r}"
        )
    return n_blocks - n_nextn


def _required_int(model: GGUFModel, key: str) -> int:
    value = model.key(key)
    if value is None and key == "expert_count":
        raise LayoutError(f"{model.path} {not_an_moe_model(model.architecture, model.metadata)}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{model.path}: metadata {model.architecture}.{key} is missing or not a positive int")
    return value


def _build_layer(
    index: int,
    router: TensorInfo,
    tensors: dict[tuple[str, int], TensorInfo],
    n_expert: int,
    n_used: int,
    n_embd: int,
    n_ff_key: object,
    n_ff_dense: object = None,
) -> MoELayer:
    where = f"layer {index}"
    if len(router.dims) != 2 or router.dims[0] != n_embd:
        raise LayoutError(f"{where}: router dims {list(router.dims)}, expected [{n_embd}, n_experts]")
    n_layer_experts = router.dims[1]
    banks: list[Bank] = []
    tiers = sorted({tier for _, tier in tensors})
    if tiers != list(range(len(tiers))):
        raise LayoutError(f"{where}: banks {tiers} are not consecutive from 0 (a bank is missing)")
    first = 0
    for tier in tiers:
        bank = _build_bank(where, tier, first, tensors, n_embd)
        if banks and bank.n_ff_exp != banks[0].n_ff_exp:
            raise LayoutError(f"{where}: bank {tier} has n_ff_exp={bank.n_ff_exp}, bank 0 has {banks[0].n_ff_exp}")
        banks.append(bank)
        first += bank.n_experts
    if isinstance(n_ff_key, int) and banks[0].n_ff_exp not in (n_ff_key, n_ff_dense):
        raise LayoutError(
            f"{where}: experts have n_ff_exp={banks[0].n_ff_exp}, expert_feed_forward_length={n_ff_key}"
            + (f" (feed_forward_length={n_ff_dense})" if isinstance(n_ff_dense, int) else "")
        )
    if first != n_layer_experts:
        raise LayoutError(f"{where}: banks hold {first} experts, the router has {n_layer_experts} outputs")
    if not n_used <= n_layer_experts <= n_expert:
        raise LayoutError(
            f"{where}: needs expert_used_count ({n_used}) <= experts in layer ({n_layer_experts}) "
            f"<= expert_count ({n_expert})"
        )
    mixed = len(banks) > 1 or n_layer_experts < n_expert
    return MoELayer(index, router, tuple(banks), n_layer_experts, mixed)


def _build_bank(where: str, tier: int, first: int, tensors: dict[tuple[str, int], TensorInfo], n_embd: int) -> Bank:
    label = f"{where} bank {tier}"
    gate_up = tensors.get(("gate_up", tier))
    gate, up, down = tensors.get(("gate", tier)), tensors.get(("up", tier)), tensors.get(("down", tier))
    if down is None:
        raise LayoutError(f"{label}: ffn_down_exps tensor is missing")
    if gate_up is not None:
        if gate is not None or up is not None:
            raise LayoutError(f"{label}: has both ffn_gate_up_exps and separate gate/up tensors")
        gate = up = gate_up
    elif gate is None or up is None:
        raise LayoutError(f"{label}: needs ffn_gate_exps and ffn_up_exps (or ffn_gate_up_exps)")
    for t in {gate.name: gate, up.name: up, down.name: down}.values():
        if len(t.dims) != 3:
            raise LayoutError(f"{t.name}: dims {list(t.dims)}, expected 3 (stacked experts)")
    n_in_bank = down.dims[2]
    if gate.dims[2] != n_in_bank or up.dims[2] != n_in_bank:
        raise LayoutError(f"{label}: gate/up/down stack {gate.dims[2]}/{up.dims[2]}/{n_in_bank} experts")
    if tier == 0 and n_in_bank < 1:
        raise LayoutError(f"{label}: the base bank needs at least one expert")
    if gate_up is not None:
        if gate_up.dims[1] % 2:
            raise LayoutError(f"{gate_up.name}: ne1={gate_up.dims[1]} is odd, expected 2*n_ff_exp")
        n_ff_exp = gate_up.dims[1] // 2
    else:
        n_ff_exp = gate.dims[1]
        if up.dims[1] != n_ff_exp or gate.dims[0] != up.dims[0]:
            raise LayoutError(f"{label}: gate dims {list(gate.dims)} and up dims {list(up.dims)} differ")
    if gate.dims[0] != n_embd or down.dims[1] != n_embd:
        raise LayoutError(f"{label}: gate ne0={gate.dims[0]}, down ne1={down.dims[1]}, expected n_embd={n_embd}")
    n_ff_down = down.dims[0]
    if n_ff_down < n_ff_exp:
        raise LayoutError(f"{label}: down width {n_ff_down} is smaller than n_ff_exp={n_ff_exp}")
    bank = Bank(tier, first, n_in_bank, gate, up, down, gate_up is not None, n_embd, n_ff_exp, n_ff_down)
    per_expert = {
        gate.name: bank.gate_bytes + (bank.up_bytes if bank.merged else 0),
        up.name: bank.up_bytes + (bank.gate_bytes if bank.merged else 0),
        down.name: bank.down_bytes,
    }
    for t in (gate, up, down):
        if t.n_bytes != per_expert[t.name] * n_in_bank:
            raise LayoutError(f"{t.name}: {t.n_bytes} bytes, expected {n_in_bank} experts x {per_expert[t.name]} bytes")
    return bank
