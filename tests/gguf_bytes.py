"""A byte-level GGUF builder for tests, written from the format description (not from gguf-py's writer).

It can write what a well-behaved writer never would: empty keys, strings that are not UTF-8, arrays
of arrays with different item types, counts that lie. Layout (little-endian): ``b"GGUF"``, ``u32``
version, ``u64`` tensor count, ``u64`` key/value count; per key/value a string key (``u64`` length +
bytes), a ``u32`` value type and the value; per tensor a string name, ``u32`` n_dims, ``u64`` dims,
``u32`` ggml type, ``u64`` offset relative to the data section; padding to the alignment; the data.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

T = GGUFValueType

_FMT = {
    T.UINT8: "<B",
    T.INT8: "<b",
    T.UINT16: "<H",
    T.INT16: "<h",
    T.UINT32: "<I",
    T.INT32: "<i",
    T.FLOAT32: "<f",
    T.BOOL: "<?",
    T.UINT64: "<Q",
    T.INT64: "<q",
    T.FLOAT64: "<d",
}


def string(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def scalar(vtype: GGUFValueType, value: object) -> bytes:
    """A value of a scalar type (without its type tag)."""
    return struct.pack(_FMT[vtype], value)


@dataclass(frozen=True)
class Arr:
    """An array value: ``item_type`` and items (``Arr`` items for an array of arrays).

    ``count`` overrides the item count written to the file (to make it lie).
    """

    item_type: GGUFValueType
    items: Sequence[object]
    count: int | None = None

    def payload(self) -> bytes:
        n = len(self.items) if self.count is None else self.count
        out = [struct.pack("<IQ", int(self.item_type), n)]
        for item in self.items:
            if self.item_type == T.ARRAY:
                assert isinstance(item, Arr)
                out.append(item.payload())
            elif self.item_type == T.STRING:
                assert isinstance(item, str | bytes)
                out.append(string(item))
            else:
                out.append(scalar(self.item_type, item))
        return b"".join(out)


def kv(key: str | bytes, vtype: GGUFValueType, value: object) -> bytes:
    """One key/value record."""
    if vtype == T.STRING:
        assert isinstance(value, str | bytes)
        body = string(value)
    elif vtype == T.ARRAY:
        assert isinstance(value, Arr)
        body = value.payload()
    else:
        body = scalar(vtype, value)
    return string(key) + struct.pack("<I", int(vtype)) + body


@dataclass
class Tensor:
    name: str
    dims: Sequence[int]  # ggml order, fastest first
    ggml_type: GGMLQuantizationType = GGMLQuantizationType.F32
    data: bytes | None = None  # default: zeros of the right size

    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        n = 1
        for d in self.dims:
            n *= d
        return n // block * size


@dataclass
class GGUFBytes:
    """A GGUF file under construction; :meth:`build` returns its bytes."""

    kvs: list[bytes] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32
    version: int = 3

    def add(self, key: str | bytes, vtype: GGUFValueType, value: object) -> GGUFBytes:
        self.kvs.append(kv(key, vtype, value))
        return self

    def build(self) -> bytes:
        head = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs)), *self.kvs]
        offset = 0
        datas: list[bytes] = []
        for t in self.tensors:
            head.append(string(t.name))
            head.append(struct.pack("<I", len(t.dims)))
            head.append(b"".join(struct.pack("<Q", d) for d in t.dims))
            head.append(struct.pack("<IQ", int(t.ggml_type), offset))
            data = t.data if t.data is not None else bytes(t.n_bytes())
            assert len(data) == t.n_bytes(), t.name
            pad = -len(data) % self.alignment
            datas.append(data + bytes(pad))
            offset += len(data) + pad
        blob = b"".join(head)
        blob += bytes(-len(blob) % self.alignment)
        return blob + b"".join(datas)


def glm4moe_experts(
    path: Path, moe_blocks: Sequence[int], block_count: int, *, nextn: int = 0, width: int = 32
) -> Path:
    """A ``glm4moe`` file of routed experts only (4 per block, top-2, F32 ``width x width``
    matrices of Gaussian values, seed 0) in ``moe_blocks``; its last ``nextn`` blocks are NextN."""
    rng = np.random.default_rng(0)
    f = GGUFBytes()
    f.add("general.architecture", GGUFValueType.STRING, "glm4moe")
    for key, value in (
        ("block_count", block_count),
        ("embedding_length", width),
        ("expert_count", 4),
        ("expert_used_count", 2),
        ("expert_feed_forward_length", width),
        ("expert_shared_count", 0),
        ("nextn_predict_layers", nextn),
    ):
        f.add(f"glm4moe.{key}", GGUFValueType.UINT32, value)
    for b in moe_blocks:
        f.tensors.append(Tensor(f"blk.{b}.ffn_gate_inp.weight", [width, 4]))
        for proj in ("gate", "up", "down"):
            data = rng.standard_normal(width * width * 4).astype(np.float32).tobytes()
            f.tensors.append(Tensor(f"blk.{b}.ffn_{proj}_exps.weight", [width, width, 4], data=data))
    path.write_bytes(f.build())
    return path
