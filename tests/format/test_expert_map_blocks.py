"""WEEPF001 records are indexed by block number (docs/notes/FORMATS.md section 3: record ``i`` describes block ``i``).

Written maps are parsed here by a reader written from docs/notes/FORMATS.md alone, and each record ``i`` is
compared with the byte ranges of block ``i``'s experts as ``gguf.GGUFReader`` places the stacked
tensors; neither side uses ``aioexperts``' layout code. Models whose MoE blocks are not ``0..n-1``
(a leading dense block as in glm4moe and deepseek2, interleaved dense blocks) are refused.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import format_testkit as kit
import gguf_bytes as gb
import pytest
from gguf import GGUFReader, GGUFValueType
from moe_session import moe_session

from aioexperts._errors import ConfigError
from aioexperts._format.expert_map import check_map_matches_layout, read_expert_map, write_expert_map
from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts.testing import write_synthetic_model

T = GGUFValueType


def read_weepf(path: Path) -> tuple[tuple[int, int, int, int], list[list[tuple[tuple[int, int], ...]]]]:
    """docs/notes/FORMATS.md section 3, read independently: identity, then per record per expert 3 (offset, length)."""
    data = path.read_bytes()
    magic, size, dev, ino, mtime, n_layers = struct.unpack_from("<8sQQQQI", data, 0)
    assert magic == b"WEEPF001"
    pos = 44
    records = []
    for _ in range(n_layers):
        (n_experts,) = struct.unpack_from("<I", data, pos)
        pos += 4
        assert 1 <= n_experts <= 512
        experts = []
        for _ in range(n_experts):
            v = struct.unpack_from("<6Q", data, pos)
            pos += 48
            experts.append(((v[0], v[1]), (v[2], v[3]), (v[4], v[5])))
        records.append(experts)
    assert pos == len(data), "trailing bytes"
    return (size, dev, ino, mtime), records


def block_ranges(path: Path, block: int) -> list[tuple[tuple[int, int], ...]]:
    """Each expert's (offset, length) of gate, up, down in block ``block``, from gguf.GGUFReader."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    per_proj = []
    for proj in ("gate", "up", "down"):
        t = tensors[f"blk.{block}.ffn_{proj}_exps.weight"]
        n_experts = int(t.shape[2])
        size = int(t.n_bytes) // n_experts
        per_proj.append([(int(t.data_offset) + e * size, size) for e in range(n_experts)])
    return [tuple(p[e] for p in per_proj) for e in range(len(per_proj[0]))]


def _write_and_read(tmp_path: Path, path: Path) -> list[list[tuple[tuple[int, int], ...]]]:
    model = open_model(path)
    write_expert_map(model, build_layout(model), tmp_path / "m.weepf")
    identity, records = read_weepf(tmp_path / "m.weepf")
    st = os.stat(path)
    assert identity == (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)
    return records


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m.gguf", "qwen2moe-f32.gguf", "more-archs/olmoe-f32.gguf"])
def test_record_i_is_block_i_on_fixtures(tmp_path: Path, name: str) -> None:
    path = kit.copy_fixture(name, tmp_path)
    records = _write_and_read(tmp_path, path)
    assert len(records) == 3
    for block, record in enumerate(records):
        assert record == block_ranges(path, block), f"record {block}"


def test_record_i_is_block_i_on_a_synthetic_model(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "s.gguf", kit.TINY.with_(n_layer=3))[0]
    records = _write_and_read(tmp_path, path)
    assert [len(r) for r in records] == [4, 4, 4]
    for block, record in enumerate(records):
        assert record == block_ranges(path, block)


def _model(path: Path, moe_blocks: tuple[int, ...], block_count: int, nextn: int = 0) -> Path:
    return gb.glm4moe_experts(path, moe_blocks, block_count, nextn=nextn)


def test_nextn_block_at_the_end_gets_no_record(tmp_path: Path) -> None:
    path = _model(tmp_path / "n.gguf", (0, 1, 2), block_count=3, nextn=1)
    records = _write_and_read(tmp_path, path)
    assert len(records) == 2  # blocks 0 and 1; block 2 is the NextN block llama.cpp never runs
    for block, record in enumerate(records):
        assert record == block_ranges(path, block)


@pytest.mark.parametrize(
    ("moe_blocks", "block_count", "shown"),
    [((1, 2), 3, r"1\.\.2"), ((1, 3), 4, r"\[1, 3\]"), ((0, 2), 3, r"\[0, 2\]")],
    ids=["leading-dense", "interleaved", "gap"],
)
def test_blocks_not_from_zero_are_refused(
    tmp_path: Path, moe_blocks: tuple[int, ...], block_count: int, shown: str
) -> None:
    path = _model(tmp_path / "d.gguf", moe_blocks, block_count)
    model = open_model(path)
    layout = build_layout(model)
    with pytest.raises(ConfigError, match=rf"record i describes block i .* MoE blocks are {shown}"):
        write_expert_map(model, layout, tmp_path / "m.weepf")
    assert not (tmp_path / "m.weepf").exists()
    # a map made elsewhere (here: the records in layout order, what the old writer produced) is not used
    other = _model(tmp_path / "z.gguf", (0, 1), 2)
    write_expert_map(open_model(other), build_layout(open_model(other)), tmp_path / "z.weepf")
    with pytest.raises(ConfigError, match="record i describes block i"):
        check_map_matches_layout(read_expert_map(tmp_path / "z.weepf"), layout)


def test_glm4moe_fixture_is_refused(tmp_path: Path) -> None:
    path = kit.copy_fixture("glm4moe-q4_k_m.gguf", tmp_path)
    model = open_model(path)
    with pytest.raises(ConfigError, match=r"MoE blocks are 1\.\.2"):
        write_expert_map(model, build_layout(model), tmp_path / "m.weepf")


def _old_style_map(path: Path, blocks: list[int]) -> bytes:
    """What the earlier writer produced: one record per MoE layer in layout order, bound to ``path``."""
    st = os.stat(path)
    out = struct.pack("<8sQQQQI", b"WEEPF001", st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, len(blocks))
    for block in blocks:
        experts = block_ranges(path, block)
        out += struct.pack("<I", len(experts))
        for ranges in experts:
            out += b"".join(struct.pack("<QQ", off, n) for off, n in ranges)
    return out


@pytest.mark.anyio
async def test_the_store_refuses_a_map_for_a_model_with_a_dense_lead(tmp_path: Path, anyio_backend: object) -> None:
    path = _model(tmp_path / "d.gguf", (1, 2), 3)
    shifted = tmp_path / "shifted.weepf"
    shifted.write_bytes(_old_style_map(path, [1, 2]))  # record 0 would be applied to block 0
    read_expert_map(shifted, open_model(path).shards[0])  # a well-formed map of this very file
    with pytest.raises(ConfigError, match=r"record i describes block i .* MoE blocks are 1\.\.2"):
        async with moe_session(path, expert_map=shifted):
            pass
