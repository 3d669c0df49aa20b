"""Test-side access to the shared GGUF fixtures and their llama.cpp goldens.

Builds what the store will later provide: the GGUF metadata as a plain dict, resident tensors
dequantized with ``gguf.quants.dequantize``, and one ``ExpertView`` per routed expert made from a plain
file read of its byte run (``[data_offset + e*B, +B)``, docs/notes/FORMATS.md section 1), with mixed-tier banks
``ffn_*_exps_tierN`` numbered by global id = bank start + local id (section 2).
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
from conftest import shared_fixtures_dir
from gguf import GGMLQuantizationType, GGUFReader

from aioexperts._format.views import ExpertView, ProjectionView

__all__ = (
    "expert_views",
    "fixture_paths",
    "fixtures_dir",
    "golden",
    "metadata",
    "reader",
    "tensor_getter",
)

_PROJS = ("gate", "up", "down")
_MAX_TIERS = 3


def fixtures_dir() -> Path | None:
    """The shared fixtures folder (``tests/conftest.py``: ``$AIOEXPERTS_FIXTURES`` or ``../shared/fixtures``)."""
    return shared_fixtures_dir()


def fixture_paths() -> list[Path]:
    """Every ``*.gguf`` fixture that has a ``*.golden.npz`` next to it, sorted by name."""
    root = fixtures_dir()
    if root is None:
        return []
    return sorted(p for p in root.rglob("*.gguf") if p.with_suffix(".golden.npz").exists())


@functools.cache
def reader(path: Path) -> GGUFReader:
    """A cached ``GGUFReader`` of ``path``."""
    return GGUFReader(path)


def metadata(path: Path) -> dict[str, object]:
    """The GGUF metadata of ``path`` as ``{key: python value}``."""
    return {key: field.contents() for key, field in reader(path).fields.items()}


@functools.cache
def golden(path: Path) -> dict[str, np.ndarray]:
    """The llama.cpp goldens of a fixture, every array loaded."""
    with np.load(path.with_suffix(".golden.npz")) as z:
        return {key: z[key] for key in z.files}


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader(path).tensors}


def tensor_getter(path: Path):
    """``tensor(name) -> float32 array in numpy order | None``, dequantized by ``gguf.quants``."""
    by_name = _tensors(path)

    def get(name: str) -> np.ndarray | None:
        t = by_name.get(name)
        if t is None:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        values = gguf.quants.dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    return get


def type_getter(path: Path):
    """``tensor_type(name) -> the tensor's ggml type | None`` (``ResidentLayer.from_tensors``)."""
    by_name = _tensors(path)

    def get(name: str) -> GGMLQuantizationType | None:
        t = by_name.get(name)
        return None if t is None else GGMLQuantizationType(t.tensor_type)

    return get


def _row_bytes(ggml_type: GGMLQuantizationType, ne0: int) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    assert ne0 % block == 0, (ggml_type, ne0)
    return ne0 // block * type_size


def _banks(path: Path, layer: int) -> list[dict[str, gguf.ReaderTensor]]:
    by_name = _tensors(path)
    banks = []
    for bank in range(_MAX_TIERS + 1):
        suffix = "" if bank == 0 else f"_tier{bank}"
        merged = by_name.get(f"blk.{layer}.ffn_gate_up_exps{suffix}.weight")
        down = by_name.get(f"blk.{layer}.ffn_down_exps{suffix}.weight")
        if merged is not None and down is not None:
            banks.append({"gate_up": merged, "down": down})
            continue
        found = {p: by_name.get(f"blk.{layer}.ffn_{p}_exps{suffix}.weight") for p in _PROJS}
        if all(t is not None for t in found.values()):
            banks.append(found)
        elif bank > 0:
            break
    return banks


def expert_views(path: Path, layer: int) -> dict[int, ExpertView]:
    """Every routed expert of ``layer`` as an ``ExpertView`` read from the file with plain reads."""
    views: dict[int, ExpertView] = {}
    start = 0
    with open(path, "rb") as f:

        def read(off: int, n: int) -> memoryview:
            f.seek(off)
            data = f.read(n)
            assert len(data) == n
            return memoryview(data).toreadonly()

        for bank, tensors in enumerate(_banks(path, layer)):
            n_experts = int(next(iter(tensors.values())).shape[2])
            for local in range(n_experts):
                projs: dict[str, ProjectionView] = {}
                for name, t in tensors.items():
                    qtype = GGMLQuantizationType(t.tensor_type)
                    ne0, ne1 = int(t.shape[0]), int(t.shape[1])
                    row = _row_bytes(qtype, ne0)
                    span = row * ne1
                    off = int(t.data_offset) + local * span
                    if name == "gate_up":  # gate rows first, then up rows
                        half = ne1 // 2
                        projs["gate"] = ProjectionView(read(off, row * half), qtype, (half, ne0))
                        projs["up"] = ProjectionView(read(off + row * half, row * half), qtype, (half, ne0))
                    else:
                        projs[name] = ProjectionView(read(off, span), qtype, (ne1, ne0))
                gid = start + local
                views[gid] = ExpertView(layer=layer, expert=gid, bank=bank, **projs)
            start += n_experts
    return views
