"""open_model and split_shard_paths: the fixtures, alignment, truncation, out-of-range offsets, split sets.

Every malformed input must raise the specific ``aioexperts._errors`` class with a message naming the
problem. Files are generated (or copied from the shared fixtures) into ``tmp_path`` and patched there.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
from pathlib import Path

import format_testkit as kit
import gguf
import gguf_bytes as gb
import numpy as np
import pytest
from conftest import shared_vocab_paths
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from aioexperts._errors import (
    AioExpertsError,
    ConfigError,
    FormatError,
    LayoutError,
    MissingShardError,
    UnsupportedTypeError,
)
from aioexperts._format.expert_map import write_expert_map
from aioexperts._format.layout import build_layout
from aioexperts._format.model import GGUFModel, SkippedValue, open_model, split_shard_paths
from aioexperts.testing import write_synthetic_model

Q = gguf.GGMLQuantizationType
U64 = 1 << 64


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A valid single-file synthetic model (2 MoE layers, 8 experts, Q4_K)."""
    return write_synthetic_model(tmp_path / "small.gguf", kit.SMALL)[0]


def _assert_matches_reader(model: GGUFModel, path: Path, shard: int = 0) -> None:
    """Every tensor of ``path`` is in ``model`` exactly where gguf.GGUFReader puts it."""
    size = path.stat().st_size
    ref = kit.reader_tensors(path)
    for name, t in ref.items():
        info = model.tensors[name]
        assert info.shard == shard
        assert info.data_offset == t.data_offset, name
        assert info.n_bytes == t.n_bytes, name
        assert info.ggml_type == t.tensor_type, name
        assert info.dims == tuple(int(d) for d in t.shape), name
        assert info.shape == tuple(reversed(info.dims))
        assert info.data_offset + info.n_bytes <= size, name


# --------------------------------------------------------------------------------------------------
# the fixtures


@pytest.mark.parametrize("name", kit.FIXTURE_NAMES or ["<no fixtures>"])
def test_every_fixture_parses_like_gguf_reader(name: str) -> None:
    path = kit.fixture_path(name)
    model = open_model(path)
    reader = GGUFReader(path)
    stem = Path(name).name
    assert model.architecture == reader.fields["general.architecture"].contents()
    assert stem.startswith(model.architecture + "-")  # the fixture files are named <arch>-<type>.gguf
    assert len(model.tensors) == len(reader.tensors) == int(reader.fields["GGUF.tensor_count"].contents())
    assert model.alignment == 32
    _assert_matches_reader(model, path)
    st = path.stat()
    (shard,) = model.shards
    assert (shard.path, shard.index, shard.size) == (os.path.abspath(path), 0, st.st_size)
    assert shard.matches(os.stat(path))
    # metadata: plain Python values equal to the reader's
    for key in ("expert_count", "expert_used_count", "embedding_length"):
        assert model.key(key) == reader.fields[f"{model.architecture}.{key}"].contents()
        assert type(model.key(key)) is int
    # a small tensor read back with read_tensor_bytes equals the reader's data
    router = next(n for n in model.tensors if n.endswith("ffn_gate_inp.weight"))
    assert model.read_tensor_bytes(router) == kit.reader_tensor_bytes(kit.reader_tensors(path)[router])


def test_missing_tensor_is_named(small: Path) -> None:
    model = open_model(small)
    with pytest.raises(FormatError, match=r"'blk\.9\.ffn_up_exps\.weight' is missing"):
        model.tensor("blk.9.ffn_up_exps.weight")


def test_read_tensor_bytes_after_the_file_shrank(small: Path) -> None:
    model = open_model(small)
    last = max(model.tensors.values(), key=lambda t: t.data_offset)
    os.truncate(small, last.data_offset + 10)
    with pytest.raises(FormatError, match="changed since it was parsed"):
        model.read_tensor_bytes(last.name)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_model(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------------------------------
# alignment


def test_alignment_64_is_honoured(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "a64.gguf", kit.SMALL.with_(alignment=64))[0]
    model = open_model(path)
    assert model.alignment == 64
    assert model.metadata["general.alignment"] == 64
    reader = GGUFReader(path)
    assert reader.data_offset % 64 == 0
    for info in model.tensors.values():
        assert info.data_offset % 64 == 0, info.name
        assert (info.data_offset - reader.data_offset) % 64 == 0
    _assert_matches_reader(model, path)
    build_layout(model)  # and the layout builds on it


@pytest.mark.parametrize("value", [0, 24, 48, 1 << 31 | 1])
def test_alignment_not_a_power_of_two_is_rejected(tmp_path: Path, value: int) -> None:
    path = write_synthetic_model(tmp_path / "a.gguf", kit.SMALL.with_(alignment=64))[0]
    off = kit.kv_value_offset(path, "general.alignment")
    kit.patch_u32(path, off, value)
    assert struct.unpack("<I", path.read_bytes()[off : off + 4]) == (value,)
    with pytest.raises(FormatError, match="(?i)alignment"):
        open_model(path)


def test_alignment_bigger_than_the_tensor_offsets_allow(tmp_path: Path) -> None:
    """128 is a valid alignment, but the file's relative offsets are only multiples of 64."""
    path = kit.write_gguf(
        tmp_path / "a.gguf", [("a.weight", [16, 1], Q.F32), ("b.weight", [16, 1], Q.F32)], alignment=64
    )
    reader = GGUFReader(path)
    assert [t.data_offset - reader.data_offset for t in reader.tensors] == [0, 64]
    open_model(path)
    kit.patch_u32(path, kit.kv_value_offset(path, "general.alignment"), 128)
    with pytest.raises(FormatError, match=r"'b\.weight' offset 64 is not a multiple of general.alignment=128"):
        open_model(path)


def test_alignment_of_the_wrong_type_is_rejected(tmp_path: Path) -> None:
    path = kit.write_gguf(
        tmp_path / "a.gguf",
        [("t.weight", [32, 4], Q.F32)],
        kv={"general.alignment": (64, GGUFValueType.UINT64)},
    )
    with pytest.raises(FormatError, match="alignment"):
        open_model(path)


def test_relative_offset_not_a_multiple_of_the_alignment(small: Path) -> None:
    name = "blk.1.ffn_up_exps.weight"
    off = kit.tensor_info_offsets(small, name)["offset"]
    (rel,) = struct.unpack("<Q", Path(small).read_bytes()[off : off + 8])
    kit.patch_u64(small, off, rel + 8)
    with pytest.raises(
        FormatError, match=rf"'{re.escape(name)}' offset {rel + 8} is not a multiple of general.alignment=32"
    ):
        open_model(small)


# --------------------------------------------------------------------------------------------------
# truncation, empty and foreign files


def _cut_points(path: Path) -> dict[str, int]:
    reader = GGUFReader(path)
    first_ti = reader.tensors[0].field.offset
    last = reader.tensors[-1]
    ti_end = last.field.offset + sum(int(p.nbytes) for p in last.field.parts)
    size = path.stat().st_size
    arch = reader.fields["general.architecture"]
    assert ti_end < reader.data_offset  # there is padding to cut into
    return {
        "inside the magic": 2,
        "after the magic": 4,
        "inside the version": 6,
        "inside the tensor count": 12,
        "inside the kv count": 20,
        "inside a key": arch.offset + 10,
        "inside the kv section": (24 + first_ti) // 2,
        "at the first tensor info": first_ti,
        "inside the tensor infos": (first_ti + ti_end) // 2,
        "inside the last tensor info": ti_end - 3,
        "after the tensor infos": ti_end,
        "inside the padding": reader.data_offset - 1,
        "at the data start": reader.data_offset,
        "inside the first tensor": reader.data_offset + 100,
        "half": size // 2,
        "one byte short": size - 1,
    }


def test_cut_points_are_where_they_say(small: Path) -> None:
    points = _cut_points(small)
    assert sorted(points.values()) == list(points.values())
    assert len(set(points.values())) == len(points)


@pytest.mark.parametrize(
    "where",
    [
        "inside the magic",
        "after the magic",
        "inside the version",
        "inside the tensor count",
        "inside the kv count",
        "inside a key",
        "inside the kv section",
        "at the first tensor info",
        "inside the tensor infos",
        "inside the last tensor info",
        "after the tensor infos",
        "inside the padding",
        "at the data start",
        "inside the first tensor",
        "half",
        "one byte short",
    ],
)
def test_truncated_file_is_a_format_error(small: Path, tmp_path: Path, where: str) -> None:
    cut = _cut_points(small)[where]
    path = kit.truncate_copy(small, tmp_path / "cut.gguf", cut)
    with pytest.raises(FormatError, match="truncated|past the end") as info:
        open_model(path)
    assert type(info.value) is FormatError
    # once the header is complete, the message names the first tensor that does not fit
    reader = GGUFReader(small)
    if cut >= reader.data_offset:
        first_bad = min((t for t in reader.tensors if t.data_offset + t.n_bytes > cut), key=lambda t: t.data_offset)
        assert repr(first_bad.name) in str(info.value)
    elif where in ("after the tensor infos", "inside the padding"):
        # the header is complete but the aligned start of the tensor data is past the end
        expected = f"tensor data would start at byte {reader.data_offset}, past the end ({cut})"
        assert expected in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(FormatError, match="empty file"):
        open_model(path)


@pytest.mark.parametrize(
    "content",
    [
        b"not a gguf file at all, just some text\n" * 10,
        b"PK\x03\x04" + bytes(100),
        b"GGUF",
        b"GGU",
        b"\0" * 64,
    ],
)
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(FormatError, match="magic|truncated|past the end"):
        open_model(path)


@pytest.mark.parametrize("version", [0x0001, 99])
def test_unsupported_gguf_version(small: Path, version: int) -> None:
    kit.patch_u32(small, 4, version)
    with pytest.raises(FormatError, match="version"):
        open_model(small)


# --------------------------------------------------------------------------------------------------
# tensors outside their file


@pytest.mark.parametrize(
    ("label", "rel_from_end"),
    [
        ("offset near 2**64", 32),  # data_start + rel itself passes 2**64
        ("offset+size overflows 64 bits", 2048),  # data_start + rel < 2**64 < data_start + rel + n_bytes
        ("offset past the end", None),
    ],
)
def test_tensor_offset_out_of_the_file(small: Path, label: str, rel_from_end: int | None) -> None:
    name = "blk.0.ffn_down_exps.weight"
    reader = GGUFReader(small)
    t = next(t for t in reader.tensors if t.name == name)
    if rel_from_end is None:
        rel = (small.stat().st_size - reader.data_offset) // 32 * 32  # aligned, just inside the file
    else:
        rel = U64 - rel_from_end
    assert rel % 32 == 0
    if label == "offset+size overflows 64 bits":
        assert reader.data_offset + rel < U64 < reader.data_offset + rel + t.n_bytes
        # what a wrapping 64-bit check would compute: a range that looks inside the file
        assert (reader.data_offset + rel + t.n_bytes) % U64 < small.stat().st_size
    kit.patch_u64(small, kit.tensor_info_offsets(small, name)["offset"], rel)
    with pytest.raises(FormatError, match=rf"tensor '{re.escape(name)}' needs bytes .* but the file has") as info:
        open_model(small)
    assert type(info.value) is FormatError


@pytest.mark.parametrize("target", ["blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"])
def test_tensor_data_aliasing_another_tensors_is_refused_as_llama_cpp_does(small: Path, target: str) -> None:
    """An expert tensor pointing at another tensor's bytes (inside the file, aligned) loaded and
    computed with them; llama.cpp's reader requires each offset to be the running padded sum of the
    tensors before it (``gguf.cpp``: "has offset X, expected Y")."""
    name = "blk.0.ffn_up_exps.weight"
    offsets = kit.tensor_info_offsets(small, name)
    other = next(t for t in GGUFReader(small).tensors if t.name == target)
    rel = int(other.data_offset) - GGUFReader(small).data_offset
    kit.patch_u64(small, offsets["offset"], rel)
    with pytest.raises(FormatError, match=rf"tensor '{re.escape(name)}' has data offset {rel}, expected \d+"):
        open_model(small)


def test_tensor_bigger_than_its_file(small: Path) -> None:
    """A dim patched so that the last tensor's size passes the end of the file."""
    reader = GGUFReader(small)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    dims_off = kit.tensor_info_offsets(small, last.name)["dims"]
    kit.patch_u64(small, dims_off + 8 * 2, int(last.shape[2]) * 1000)  # ne2 = experts x 1000
    with pytest.raises(FormatError, match=rf"'{re.escape(last.name)}' needs bytes"):
        open_model(small)


#: the vocabulary file read through gguf's GGUFReader too (the smallest: GGUFReader takes 1-11 s
#: per file, building a view of every token; the others are checked against their header's counts)
READER_VOCAB = "ggml-vocab-phi-3.gguf"


@pytest.mark.parametrize("path", shared_vocab_paths(), ids=lambda p: p.name)
def test_vocab_only_files_of_llama_cpp_open(path: Path) -> None:
    """llama.cpp's vocabulary-only files have no tensors and end before the aligned data start."""
    with path.open("rb") as f:
        magic, _version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
    assert magic == b"GGUF" and n_tensors == 0
    model = open_model(path)
    assert model.tensors == {}
    assert len(model.metadata) == n_kv
    assert model.architecture == model.metadata["general.architecture"]
    if path.name == READER_VOCAB:
        reader = GGUFReader(path)
        assert len(reader.tensors) == 0
        assert model.architecture == reader.fields["general.architecture"].contents()
        assert len(model.metadata) == len(reader.fields) - 3  # GGUFReader counts the 3 header fields too


def test_the_vocab_file_read_through_gguf_is_among_the_shared_ones() -> None:
    names = [p.name for p in shared_vocab_paths()]
    assert not names or READER_VOCAB in names, names


@pytest.mark.parametrize("pad", [0, 7, 31])
def test_a_file_without_tensors_opens_whatever_its_padding(tmp_path: Path, pad: int) -> None:
    """No tensors: the data section is empty, whether or not the file is padded to the alignment."""
    blob = gb.GGUFBytes().add("general.architecture", GGUFValueType.STRING, "llama").build()
    body = blob.rstrip(b"\0")  # the header ends with the architecture string: no zero byte of its own
    assert len(body) % 32 != 0
    path = tmp_path / "vocab.gguf"
    path.write_bytes(body + bytes(min(pad, -len(body) % 32)))
    model = open_model(path)
    assert model.tensors == {} and model.architecture == "llama"


def test_a_tensor_past_the_end_is_still_refused_when_the_header_is_unaligned(tmp_path: Path) -> None:
    """The empty-data rule does not let a tensor through: its bytes would start past the end."""
    blob = (
        gb.GGUFBytes(tensors=[gb.Tensor("t", [32])]).add("general.architecture", GGUFValueType.STRING, "llama").build()
    )
    path = tmp_path / "cut.gguf"
    header_end = len(blob) - 32 * 4
    path.write_bytes(blob[: header_end - 1])  # the padding before the data, cut short
    with pytest.raises(FormatError, match="past the end|truncated"):
        open_model(path)


@pytest.mark.parametrize("n_dims", [0, 5])
def test_bad_number_of_dims(tmp_path: Path, n_dims: int) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [32, 4], Q.F32), ("b.weight", [32, 4], Q.F32)])
    kit.patch_u32(path, kit.tensor_info_offsets(path, "b.weight")["n_dims"], n_dims)
    with pytest.raises(FormatError):
        open_model(path)


def test_zero_dim(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [32, 4], Q.F32)])
    kit.patch_u64(path, kit.tensor_info_offsets(path, "a.weight")["dims"] + 8, 0)
    with pytest.raises(FormatError, match=r"'a\.weight' has dims \[32, 0\]"):
        open_model(path)


def test_unknown_ggml_type(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [32, 4], Q.F32)])
    kit.patch_u32(path, kit.tensor_info_offsets(path, "a.weight")["type"], 250)
    with pytest.raises(UnsupportedTypeError, match=r"'a\.weight' has unknown ggml type 250"):
        open_model(path)


def test_row_not_a_multiple_of_the_block_size(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [256, 4], Q.Q4_K)])
    kit.patch_u64(path, kit.tensor_info_offsets(path, "a.weight")["dims"], 128)
    with pytest.raises(FormatError, match="not a multiple of the block size 256"):
        open_model(path)


def test_tensor_name_not_utf8(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [32, 4], Q.F32)])
    kit.patch(path, kit.tensor_info_offsets(path, "a.weight")["name"], b"\xff")
    with pytest.raises(FormatError):
        open_model(path)


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("dup.aaaa", [32, 4], Q.F32), ("dup.aaab", [32, 4], Q.F32)])
    name_off = kit.tensor_info_offsets(path, "dup.aaab")["name"]
    kit.patch(path, name_off + len("dup.aaa"), b"a")
    with pytest.raises(FormatError, match=r"tensor 'dup\.aaaa' appears twice"):
        open_model(path)


def test_duplicate_metadata_key(tmp_path: Path) -> None:
    path = kit.write_gguf(
        tmp_path / "d.gguf",
        [("a.weight", [32, 4], Q.F32)],
        kv={"test.keyA": (1, GGUFValueType.UINT32), "test.keyB": (2, GGUFValueType.UINT32)},
    )
    off = kit.kv_value_offset(path, "test.keyB") - 4 - 1  # the last byte of the key name
    kit.patch(path, off, b"A")
    with pytest.raises(FormatError, match="(?i)duplicate"):
        open_model(path)


def test_missing_architecture(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "d.gguf", [("a.weight", [32, 4], Q.F32)])
    off = GGUFReader(path).fields["general.architecture"].offset + 8
    kit.patch(path, off, b"GENERAL")
    with pytest.raises(FormatError, match="general.architecture is missing"):
        open_model(path)


# --------------------------------------------------------------------------------------------------
# huge counts and lengths: refused from the header alone, without walking the file


def _array_file(tmp_path: Path, value: list[object]) -> Path:
    writer_kv = {"test.arr": (value, GGUFValueType.ARRAY)}
    return kit.write_gguf(tmp_path / "arr.gguf", [("a.weight", [256, 64], Q.F32)], kv=writer_kv)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("value", "n_items"),
    [
        ([1, 2, 3], 1 << 62),
        ([1, 2, 3], (1 << 64) - 1),
        (["a", "bc"], 1 << 62),
        ([[1, 2], [3]], 1 << 62),
        ([True, False], 1 << 40),
    ],
    ids=["int32-2^62", "int32-2^64-1", "string-2^62", "nested-2^62", "bool-2^40"],
)
def test_array_with_a_huge_claimed_length(tmp_path: Path, value: list[object], n_items: int) -> None:
    path = _array_file(tmp_path, value)
    assert open_model(path).metadata["test.arr"] == value  # nested arrays stay nested
    kit.patch_u64(path, kit.array_length_offset(path, "test.arr"), n_items)
    with pytest.raises(FormatError, match=rf"claims {n_items} items, more than the file holds"):
        open_model(path)


def test_array_with_an_unknown_item_type(tmp_path: Path) -> None:
    path = _array_file(tmp_path, [1, 2, 3])
    kit.patch_u32(path, kit.kv_value_offset(path, "test.arr"), 77)
    with pytest.raises(FormatError, match="'test.arr' has unknown array item type 77"):
        open_model(path)


def test_long_arrays_stay_in_the_file_with_their_length(tmp_path: Path) -> None:
    path = _array_file(tmp_path, list(range(5000)))
    model = open_model(path)
    value = model.metadata["test.arr"]
    assert isinstance(value, SkippedValue)
    assert len(value) == 5000
    assert value.item_type == GGUFValueType.INT32  # gguf's writer stores Python ints as INT32
    assert value.n_bytes == 5000 * 4
    assert kit.pread(path, value.offset, 8) == struct.pack("<2i", 0, 1)  # where the items are
    assert model.skipped_arrays == frozenset({"test.arr"})


@pytest.mark.timeout(10)
@pytest.mark.parametrize("count", [1 << 62, (1 << 64) - 1, 10**6])
def test_huge_tensor_count(small: Path, count: int) -> None:
    kit.patch_u64(small, 8, count)
    with pytest.raises(FormatError):
        open_model(small)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("count", [1 << 62, (1 << 64) - 1])
def test_huge_kv_count(small: Path, count: int) -> None:
    kit.patch_u64(small, 16, count)
    with pytest.raises(FormatError):
        open_model(small)


@pytest.mark.timeout(30)
def test_huge_tensor_count_over_zero_data_is_refused_from_the_header(tmp_path: Path) -> None:
    path = kit.write_gguf(tmp_path / "z.gguf", [("zeros.weight", [256, 256], Q.F32)], fill="zeros")
    kit.patch_u64(path, 8, 1 << 62)
    # a 256 KiB file cannot hold 2**62 tensor infos (>= 32 bytes each): refused from the count,
    # before a single record is parsed (zeros would otherwise parse as empty names for a long time)
    with pytest.raises(FormatError, match=r"GGUF\.tensor_count=4611686018427387904 is more tensor infos than"):
        open_model(path)


# --------------------------------------------------------------------------------------------------
# split sets


@pytest.fixture
def split3(tmp_path: Path) -> tuple[list[Path], Path]:
    """A 3-shard set and the single file written from the same spec and seed."""
    (tmp_path / "set").mkdir()
    shards = write_synthetic_model(tmp_path / "set" / "m.gguf", kit.SMALL, shards=3)
    single = write_synthetic_model(tmp_path / "single.gguf", kit.SMALL)[0]
    return shards, single


def test_split_set_is_named_as_llama_cpp_does(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    assert [p.name for p in shards] == [f"m-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    assert all(p.exists() for p in shards)


@pytest.mark.parametrize("opened", [0, 1, 2], ids=["first", "second", "third"])
def test_split_set_opens_from_any_shard(split3: tuple[list[Path], Path], opened: int) -> None:
    shards, single = split3
    model = open_model(shards[opened])
    ref = open_model(single)
    assert model.path == os.fspath(shards[opened])
    assert model.architecture == "qwen3moe"
    assert [s.index for s in model.shards] == [0, 1, 2]
    assert [s.path for s in model.shards] == [os.path.abspath(p) for p in shards]
    assert all(s.matches(os.stat(s.path)) for s in model.shards)
    assert model.metadata["split.count"] == 3
    assert set(model.tensors) == set(ref.tensors)
    assert len(model.tensors) == 8
    # each tensor: the right shard, the absolute offset gguf.GGUFReader gives in that shard, same bytes
    per_shard = [kit.reader_tensors(p) for p in shards]
    seen_shards = set()
    for name, info in model.tensors.items():
        (k,) = [k for k, ts in enumerate(per_shard) if name in ts]
        assert info.shard == k, name
        seen_shards.add(k)
        t = per_shard[k][name]
        assert (info.data_offset, info.n_bytes) == (t.data_offset, t.n_bytes), name
        r = ref.tensors[name]
        assert (info.n_bytes, info.dims, info.ggml_type) == (r.n_bytes, r.dims, r.ggml_type)
        got = kit.pread(shards[k], info.data_offset, info.n_bytes)
        assert got == kit.pread(single, r.data_offset, r.n_bytes), name
    assert seen_shards == {0, 1, 2}
    # the layout of a split set says which shard each expert is in
    layout, ref_layout = build_layout(model), build_layout(ref)
    for loc, ref_loc in zip(layout, ref_layout, strict=True):
        for seg, ref_seg in zip(loc.segments, ref_loc.segments, strict=True):
            assert kit.pread(shards[seg.shard], seg.offset, seg.n_bytes) == kit.pread(
                single, ref_seg.offset, ref_seg.n_bytes
            )


@pytest.mark.parametrize(("missing", "opened"), [(0, 1), (1, 0), (1, 2), (2, 1)])
def test_split_set_with_a_missing_shard(split3: tuple[list[Path], Path], missing: int, opened: int) -> None:
    shards, _ = split3
    shards[missing].unlink()
    with pytest.raises(MissingShardError) as info:
        open_model(shards[opened])
    assert info.value.path == os.path.abspath(shards[missing])
    assert shards[missing].name in str(info.value)
    assert "missing" in str(info.value)


def test_split_shards_renamed_out_of_order(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    tmp = shards[0].with_suffix(".tmp")
    shards[1].rename(tmp)
    shards[2].rename(shards[1])
    tmp.rename(shards[2])
    with pytest.raises(FormatError, match=r"split\.no=2, but the file name says shard 2 of 3"):
        open_model(shards[0])


def test_split_shard_with_a_wrong_split_no(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    kit.patch_u16(shards[1], kit.kv_value_offset(shards[1], "split.no"), 0)
    with pytest.raises(FormatError, match=r"split\.count=3, split\.no=0, but the file name says shard 2 of 3") as info:
        open_model(shards[0])
    assert os.path.abspath(shards[1]) in str(info.value)


def test_split_shard_with_a_wrong_split_count(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    kit.patch_u16(shards[2], kit.kv_value_offset(shards[2], "split.count"), 4)
    with pytest.raises(FormatError, match=r"split\.count=4"):
        open_model(shards[1])


def test_split_shard_with_a_wrong_tensors_count(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    kit.patch_u32(shards[1], kit.kv_value_offset(shards[1], "split.tensors.count"), 9)
    with pytest.raises(FormatError, match=r"split\.tensors\.count=9 disagrees with the first shard's 8"):
        open_model(shards[0])


def test_split_tensors_count_that_all_shards_get_wrong(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    for p in shards:
        kit.patch_u32(p, kit.kv_value_offset(p, "split.tensors.count"), 9)
    with pytest.raises(FormatError, match=r"split\.tensors\.count says 9 tensors, the 3 shards hold 8"):
        open_model(shards[0])


def test_split_shard_from_another_set(split3: tuple[list[Path], Path], tmp_path: Path) -> None:
    shards, _ = split3
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = write_synthetic_model(other_dir / "m.gguf", kit.SMALL.with_(n_layer=3, seed=7), shards=3)
    shutil.copyfile(other[1], shards[1])
    with pytest.raises(FormatError, match=r"split\.tensors\.count=12 disagrees with the first shard's 8"):
        open_model(shards[0])


def test_split_shard_from_a_set_of_another_size(split3: tuple[list[Path], Path], tmp_path: Path) -> None:
    shards, _ = split3
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = write_synthetic_model(other_dir / "m.gguf", kit.SMALL, shards=4)
    shutil.copyfile(other[1], shards[1])
    with pytest.raises(FormatError, match=r"split\.count=4, split\.no=1"):
        open_model(shards[0])


def test_split_tensor_in_two_shards(split3: tuple[list[Path], Path]) -> None:
    shards, _ = split3
    victim, renamed = "blk.1.ffn_down_exps.weight", "blk.0.ffn_down_exps.weight"
    assert victim in kit.reader_tensors(shards[2])
    assert renamed in kit.reader_tensors(shards[1])
    kit.patch(shards[2], kit.tensor_info_offsets(shards[2], victim)["name"], renamed.encode())
    with pytest.raises(FormatError, match=rf"tensor '{re.escape(renamed)}' is also in another shard"):
        open_model(shards[0])


def test_split_set_refused_by_the_map_writer(split3: tuple[list[Path], Path], tmp_path: Path) -> None:
    shards, _ = split3
    model = open_model(shards[0])
    with pytest.raises(ConfigError, match="split set of 3"):
        write_expert_map(model, build_layout(model), tmp_path / "m.weepf")
    assert not (tmp_path / "m.weepf").exists()


def test_single_file_named_like_a_set_of_one(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "m-00001-of-00001.gguf", kit.SMALL)[0]
    model = open_model(path)
    assert len(model.shards) == 1
    assert model.shards[0].index == 0


@pytest.mark.parametrize(
    "name", ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "m-00000-of-00003.gguf", "m-00004-of-00003.gguf"]
)
def test_complete_file_named_as_a_shard_opens_alone(small: Path, name: str) -> None:
    """No split.count: a single file, whatever its name (llama.cpp decides from the metadata)."""
    path = small.rename(small.with_name(name))
    model = open_model(path)
    assert [(s.path, s.index) for s in model.shards] == [(os.path.abspath(path), 0)]
    assert {info.shard for info in model.tensors.values()} == {0}
    _assert_matches_reader(model, path)


def test_file_named_as_a_shard_with_split_count_one_opens_alone(tmp_path: Path) -> None:
    path = kit.write_gguf(
        tmp_path / "m-00001-of-00002.gguf",
        [("a.weight", [32, 4], Q.F32)],
        kv={"split.no": (0, GGUFValueType.UINT16), "split.count": (1, GGUFValueType.UINT16)},
    )
    model = open_model(path)
    assert len(model.shards) == 1
    assert model.metadata["split.count"] == 1


def test_shard_of_a_bigger_set_copied_alone(split3: tuple[list[Path], Path], tmp_path: Path) -> None:
    """split.count=3 in the file: a shard, its missing siblings are refused by name."""
    shards, _ = split3
    (tmp_path / "alone").mkdir()
    path = Path(shutil.copyfile(shards[1], tmp_path / "alone" / shards[1].name))
    with pytest.raises(MissingShardError, match=r"m-00001-of-00003\.gguf of the split set is missing") as info:
        open_model(path)
    assert info.value.path == os.path.abspath(tmp_path / "alone" / shards[0].name)
    assert "split.count=3" in str(info.value)


@pytest.mark.parametrize("which", ["the model", "a shard"])
def test_a_symbolic_link_loop_is_a_format_error(split3: tuple[list[Path], Path], tmp_path: Path, which: str) -> None:
    shards, _ = split3
    folder = tmp_path / "loops"
    folder.mkdir()
    for k, shard in enumerate(shards):
        if which == "a shard" and k == 2:
            os.symlink(shard.name, folder / shard.name)  # a link to itself
        else:
            shutil.copyfile(shard, folder / shard.name)
    given = folder / shards[0].name
    if which == "the model":
        given = folder / "loop.gguf"
        os.symlink("loop.gguf", given)
    with pytest.raises(FormatError, match="a loop of symbolic links, not a file"):
        open_model(given)


def test_single_file_claiming_to_be_a_shard(small: Path, tmp_path: Path) -> None:
    """A plain name, but split metadata saying shard 2 of 3."""
    path = kit.write_gguf(
        tmp_path / "plain.gguf",
        [("a.weight", [32, 4], Q.F32)],
        kv={"split.no": (1, GGUFValueType.UINT16), "split.count": (3, GGUFValueType.UINT16)},
    )
    with pytest.raises(FormatError, match=r"split\.count=3, split\.no=1: a shard of a split set, but the file name"):
        open_model(path)


@pytest.mark.parametrize("name", ["plain.gguf", "m-00001-of-00002.gguf"])
@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"split.no": (1, GGUFValueType.UINT16)}, r"split\.no=1 in a file that is not split"),
        (
            {"split.no": (2, GGUFValueType.UINT16), "split.count": (1, GGUFValueType.UINT16)},
            r"split\.no=2 in a file that is not split",
        ),
        ({"split.count": (0, GGUFValueType.UINT16)}, r"split\.count=0 \(a file is split in 1 or more"),
        ({"split.count": ("2", GGUFValueType.STRING)}, r"split\.count is '2', not an integer"),
        ({"split.count": (True, GGUFValueType.BOOL)}, r"split\.count is True, not an integer"),
        (
            {"split.count": (1, GGUFValueType.UINT16), "split.no": (0.0, GGUFValueType.FLOAT32)},
            r"split\.no is 0\.0, not an integer",
        ),
    ],
    ids=["no-without-count", "no-past-count-one", "count-zero", "count-string", "count-bool", "no-float"],
)
def test_split_metadata_of_a_single_file_is_checked(
    tmp_path: Path, name: str, kv: dict[str, tuple[object, GGUFValueType]], message: str
) -> None:
    path = kit.write_gguf(tmp_path / name, [("a.weight", [32, 4], Q.F32)], kv=kv)
    with pytest.raises(FormatError, match=message):
        open_model(path)


# --------------------------------------------------------------------------------------------------
# split_shard_paths


def test_split_shard_paths_plain_names(tmp_path: Path) -> None:
    for name in (
        "model.gguf",
        "model-0001-of-0003.gguf",
        "model-00001-of-00003.bin",
        "model-00001-of-00003.gguf.part",
        "-00001-of-00003.gguf",
        "model-00001-of-000003.gguf",
    ):
        assert split_shard_paths(tmp_path / name) is None, name


@pytest.mark.parametrize("k", [1, 2, 3])
def test_split_shard_paths_of_each_shard(tmp_path: Path, k: int) -> None:
    expected = [os.path.join(tmp_path, f"Qwen3-30B-A3B-Q4_K-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert split_shard_paths(tmp_path / f"Qwen3-30B-A3B-Q4_K-{k:05d}-of-00003.gguf") == expected
    assert split_shard_paths(str(tmp_path / f"Qwen3-30B-A3B-Q4_K-{k:05d}-of-00003.gguf")) == expected


def test_split_shard_paths_relative_name_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert split_shard_paths("m-00002-of-00002.gguf") == [
        os.path.join(os.getcwd(), "m-00001-of-00002.gguf"),
        os.path.join(os.getcwd(), "m-00002-of-00002.gguf"),
    ]


def test_split_shard_paths_single(tmp_path: Path) -> None:
    assert split_shard_paths(tmp_path / "m-00001-of-00001.gguf") == [os.path.join(tmp_path, "m-00001-of-00001.gguf")]


@pytest.mark.parametrize(
    "name",
    ["m-00000-of-00003.gguf", "m-00004-of-00003.gguf", "m-00001-of-00000.gguf", "m-00000-of-00000.gguf"],
)
def test_split_shard_paths_impossible_numbers(tmp_path: Path, name: str) -> None:
    with pytest.raises(FormatError, match="split name says shard"):
        split_shard_paths(tmp_path / name)


@pytest.mark.parametrize("name", ["m-00000-of-00003.gguf", "m-00004-of-00003.gguf"])
def test_open_model_with_an_impossible_split_name(split3: tuple[list[Path], Path], name: str) -> None:
    """A shard (split.count=3) renamed to an impossible number; a complete file so named opens alone."""
    shards, _ = split3
    path = shards[0].rename(shards[0].with_name(name))
    with pytest.raises(FormatError, match="split name says shard [04] of 3"):
        open_model(path)


def test_errors_are_in_the_tree() -> None:
    assert issubclass(MissingShardError, FormatError)
    assert issubclass(LayoutError, FormatError)
    assert issubclass(FormatError, AioExpertsError)
    assert issubclass(FormatError, ValueError)


# --------------------------------------------------------------------------------------------------
# byte order


def test_big_endian_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    writer = GGUFWriter(os.fspath(path), "qwen3moe", endianess=GGUFEndian.BIG)
    for key, value in kit.moe_kv().items():
        writer.add_key_value(key, value[0], value[1])
    for name, (dims, _t) in kit.moe_layer(0).items():
        writer.add_tensor(name, np.ones(tuple(reversed(dims)), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFReader(path).byte_order == "S"  # really a swapped file
    with pytest.raises(FormatError, match="(?i)endian|byte order"):
        open_model(path)
