"""Helpers shared by the tests under tests/format: fixture discovery, small GGUF writers, byte patching.

Imported by the test modules as a plain module (pytest puts this directory on ``sys.path``).
Everything here works on copies in a temporary directory; the shared fixtures are never modified.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import shared_fixtures_dir
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from aioexperts.testing import SyntheticSpec

Q = GGMLQuantizationType

#: The small geometry the tests use for synthetic models (about 1.8 MB per file, Q4_K).
SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)
#: An even smaller one for the fuzzers and the map tests (F32, a few tens of KB).
TINY = SyntheticSpec(n_layer=2, n_embd=32, n_ff_exp=32, n_expert=4, n_expert_used=2, expert_type=Q.F32)


FIXTURES = shared_fixtures_dir()
#: Every fixture, subfolders included (``more-archs/...``), as a path relative to the fixtures folder.
FIXTURE_NAMES: list[str] = (
    sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*.gguf")) if FIXTURES else []
)


def fixture_path(name: str) -> Path:
    """Path of a shared fixture (read-only!), or skip the test when the fixtures are not here."""
    if FIXTURES is None or not (FIXTURES / name).exists():
        pytest.skip(f"fixture {name} not found (set AIOEXPERTS_FIXTURES)")
    return FIXTURES / name


def copy_fixture(name: str, dest_dir: Path) -> Path:
    """A writable copy of a fixture in ``dest_dir``."""
    dst = dest_dir / Path(name).name
    shutil.copyfile(fixture_path(name), dst)
    os.chmod(dst, 0o644)
    return dst


# --------------------------------------------------------------------------------------------------
# byte patching


def patch(path: str | os.PathLike[str], offset: int, data: bytes) -> None:
    """Overwrite ``data`` at ``offset`` in place (the file keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def patch_u16(path: str | os.PathLike[str], offset: int, value: int) -> None:
    patch(path, offset, struct.pack("<H", value))


def patch_u32(path: str | os.PathLike[str], offset: int, value: int) -> None:
    patch(path, offset, struct.pack("<I", value))


def patch_u64(path: str | os.PathLike[str], offset: int, value: int) -> None:
    patch(path, offset, struct.pack("<Q", value))


def truncate_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str], size: int) -> Path:
    """``dst`` = the first ``size`` bytes of ``src``."""
    with open(src, "rb") as f:
        data = f.read(size)
    Path(dst).write_bytes(data)
    return Path(dst)


def kv_value_offset(path: str | os.PathLike[str], key: str) -> int:
    """Absolute file offset of the value of metadata key ``key`` (after its key string and type)."""
    reader = GGUFReader(path)
    field = reader.fields[key]
    # parts: key length (u64), key bytes, value type (u32), then the value parts
    return field.offset + sum(int(p.nbytes) for p in field.parts[:3])


def array_length_offset(path: str | os.PathLike[str], key: str) -> int:
    """Absolute file offset of the u64 item count of array key ``key``."""
    return kv_value_offset(path, key) + 4  # after the u32 item type


def tensor_info_offsets(path: str | os.PathLike[str], name: str) -> dict[str, int]:
    """Absolute file offsets of the parts of tensor ``name``'s info record.

    Keys: ``name_len``, ``name``, ``n_dims``, ``dims``, ``type``, ``offset``.
    """
    reader = GGUFReader(path)
    for t in reader.tensors:
        if t.name == name:
            out: dict[str, int] = {}
            pos = t.field.offset
            for key, part in zip(("name_len", "name", "n_dims", "dims", "type", "offset"), t.field.parts, strict=True):
                out[key] = pos
                pos += int(part.nbytes)
            return out
    raise KeyError(name)


def reader_tensors(path: str | os.PathLike[str]) -> dict[str, gguf.ReaderTensor]:
    """``gguf.GGUFReader``'s view of every tensor (the reference the tests compare against)."""
    return {t.name: t for t in GGUFReader(path).tensors}


def reader_tensor_bytes(t: gguf.ReaderTensor) -> bytes:
    """The raw bytes of a reader tensor's data."""
    return np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).tobytes()


def pread(path: str | os.PathLike[str], offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    assert len(data) == n, (path, offset, n, len(data))
    return data


def row_bytes(ggml_type: GGMLQuantizationType, ne0: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return ne0 // block * size


# --------------------------------------------------------------------------------------------------
# hand-made GGUF files

#: ``(name, ggml dims fastest first, type)``
TensorSpec = tuple[str, Sequence[int], GGMLQuantizationType]


def tensor_nbytes(dims: Sequence[int], ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(dims)) // block * size


def write_gguf(
    path: str | os.PathLike[str],
    tensors: Iterable[TensorSpec],
    *,
    arch: str = "qwen3moe",
    kv: Mapping[str, tuple[object, GGUFValueType]] | None = None,
    alignment: int | None = None,
    fill: str = "random",
    seed: int = 0,
) -> Path:
    """Write a GGUF with the given tensors (random or zero bytes) and extra metadata ``kv``.

    ``kv`` maps full key names to ``(value, GGUFValueType)``; arrays use ``GGUFValueType.ARRAY``.
    """
    rng = np.random.default_rng(seed)
    tensors = list(tensors)
    writer = GGUFWriter(os.fspath(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype) in (kv or {}).items():
        writer.add_key_value(key, value, vtype)
    for name, dims, ggml_type in tensors:
        shape = tuple(reversed([int(d) for d in dims]))
        writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(dims, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, dims, ggml_type in tensors:
        n = tensor_nbytes(dims, ggml_type)
        data = rng.bytes(n) if fill == "random" else bytes(n)
        writer.write_tensor_data(np.frombuffer(data, dtype=np.uint8))
    writer.close()
    return Path(path)


def moe_kv(
    arch: str = "qwen3moe",
    *,
    n_expert: int = 8,
    n_used: int = 2,
    n_embd: int = 32,
    n_ff: int | None = 32,
) -> dict[str, tuple[object, GGUFValueType]]:
    """The metadata ``build_layout`` reads."""
    kv: dict[str, tuple[object, GGUFValueType]] = {
        f"{arch}.block_count": (4, GGUFValueType.UINT32),
        f"{arch}.embedding_length": (n_embd, GGUFValueType.UINT32),
        f"{arch}.expert_count": (n_expert, GGUFValueType.UINT32),
        f"{arch}.expert_used_count": (n_used, GGUFValueType.UINT32),
    }
    if n_ff is not None:
        kv[f"{arch}.expert_feed_forward_length"] = (n_ff, GGUFValueType.UINT32)
    return kv


def moe_layer(
    layer: int,
    *,
    n_embd: int = 32,
    n_ff: int = 32,
    banks: Sequence[tuple[int, GGMLQuantizationType]] = ((8, Q.F32),),
    router_outputs: int | None = None,
    merged: bool = False,
    n_ff_down: int | None = None,
) -> dict[str, tuple[list[int], GGMLQuantizationType]]:
    """Tensors of one valid MoE layer (name -> (ggml dims, type)); mutate the dict to break a rule."""
    total = sum(n for n, _ in banks)
    out: dict[str, tuple[list[int], GGMLQuantizationType]] = {
        f"blk.{layer}.ffn_gate_inp.weight": (
            [n_embd, router_outputs if router_outputs is not None else total],
            Q.F32,
        )
    }
    for tier, (n, t) in enumerate(banks):
        sfx = f"_tier{tier}" if tier else ""
        if merged:
            out[f"blk.{layer}.ffn_gate_up_exps{sfx}.weight"] = ([n_embd, 2 * n_ff, n], t)
        else:
            out[f"blk.{layer}.ffn_gate_exps{sfx}.weight"] = ([n_embd, n_ff, n], t)
            out[f"blk.{layer}.ffn_up_exps{sfx}.weight"] = ([n_embd, n_ff, n], t)
        out[f"blk.{layer}.ffn_down_exps{sfx}.weight"] = ([n_ff_down or n_ff, n_embd, n], t)
    return out


def as_specs(tensors: Mapping[str, tuple[Sequence[int], GGMLQuantizationType]]) -> list[TensorSpec]:
    return [(name, dims, t) for name, (dims, t) in tensors.items()]
