"""The WEEPF001 expert map: round trip, the exact byte layout of docs/notes/FORMATS.md section 3, every refusal."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import format_testkit as kit
import pytest

from aioexperts._errors import ConfigError, FormatError, StaleMapError
from aioexperts._format.expert_map import (
    EXPERT_MAP_MAGIC,
    MAX_EXPERTS_PER_LAYER,
    MAX_LAYERS,
    MAX_RANGE_BYTES,
    ExpertMap,
    check_map_matches_layout,
    read_expert_map,
    write_expert_map,
)
from aioexperts._format.layout import build_layout
from aioexperts._format.model import GGUFModel, open_model
from aioexperts.testing import write_synthetic_model

HEADER = struct.Struct("<8sQQQQI")
MiB = 1 << 20


def make_map(
    layers: list[list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]],
    *,
    size: int = 1 << 40,
    dev: int = 1,
    ino: int = 2,
    mtime_ns: int = 3,
    magic: bytes = EXPERT_MAP_MAGIC,
    n_layers: int | None = None,
    n_experts: list[int] | None = None,
) -> bytes:
    """A map written by hand, independently of write_expert_map, as docs/notes/FORMATS.md lays it out."""
    out = bytearray(HEADER.pack(magic, size, dev, ino, mtime_ns, len(layers) if n_layers is None else n_layers))
    for li, rows in enumerate(layers):
        out += struct.pack("<I", len(rows) if n_experts is None else n_experts[li])
        for ranges in rows:
            for off, n in ranges:
                out += struct.pack("<QQ", off, n)
    return bytes(out)


def _expert(base: int, n: int = 4096) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    return ((base, n), (base + n, n), (base + 2 * n, n))


def _valid_layers(n_layers: int = 2, n_experts: int = 2) -> list:
    return [[_expert((1 << 20) + (li * n_experts + e) * 3 * 4096) for e in range(n_experts)] for li in range(n_layers)]


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    """A writable copy of a fixture (the map binds to this file's identity)."""
    return kit.copy_fixture("qwen3moe-q4_k_m.gguf", tmp_path)


def _open(path: Path) -> tuple[GGUFModel, object]:
    model = open_model(path)
    return model, build_layout(model)


# --------------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m.gguf", "qwen3moe-mixed.gguf", "qwen2moe-f32.gguf"])
def test_round_trip_on_a_fixture_copy(tmp_path: Path, name: str) -> None:
    path = kit.copy_fixture(name, tmp_path)
    model, layout = _open(path)
    map_path = tmp_path / "m.weepf"
    write_expert_map(model, layout, map_path)
    st = os.stat(path)
    emap = read_expert_map(map_path, model.shards[0])
    assert (emap.model_size, emap.dev, emap.ino, emap.mtime_ns) == (
        st.st_size,
        st.st_dev,
        st.st_ino,
        st.st_mtime_ns,
    )
    assert len(emap.layers) == len(layout.layers)
    for record, moe in zip(emap.layers, layout.layers.values(), strict=True):
        assert len(record) == moe.n_experts
        for e, ranges in enumerate(record):
            loc = moe.locate(e)
            assert ranges == tuple((s.offset, s.n_bytes) for s in loc.segments)
    check_map_matches_layout(emap, layout)
    # read without a model too, and the map is byte-for-byte what docs/notes/FORMATS.md says
    assert read_expert_map(map_path) == emap
    expected = make_map(
        [
            [tuple((s.offset, s.n_bytes) for s in moe.locate(e).segments) for e in range(moe.n_experts)]
            for moe in layout.layers.values()
        ],
        size=st.st_size,
        dev=st.st_dev,
        ino=st.st_ino,
        mtime_ns=st.st_mtime_ns,
    )
    assert map_path.read_bytes() == expected
    assert len(expected) == 44 + len(layout.layers) * (4 + 8 * 48)


def test_write_leaves_no_temp_file(tmp_path: Path, model_copy: Path) -> None:
    model, layout = _open(model_copy)
    before = set(os.listdir(tmp_path))
    write_expert_map(model, layout, tmp_path / "m.weepf")
    write_expert_map(model, layout, tmp_path / "m.weepf")  # overwrite in place
    assert set(os.listdir(tmp_path)) == before | {"m.weepf"}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_written_map_has_the_mode_of_a_new_file(tmp_path: Path, model_copy: Path, umask: int) -> None:
    """0666 & ~umask like any file the user creates, not mkstemp's 0600 (the temp file is chmod-ed)."""
    model, layout = _open(model_copy)
    old = os.umask(umask)
    try:
        write_expert_map(model, layout, tmp_path / "m.weepf")
    finally:
        os.umask(old)
    assert (tmp_path / "m.weepf").stat().st_mode & 0o777 == 0o666 & ~umask


def test_failed_write_leaves_no_temp_file(tmp_path: Path, model_copy: Path) -> None:
    """The final rename fails (the target is a non-empty directory): the temp file is removed."""
    model, layout = _open(model_copy)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "x").write_bytes(b"x")
    before = set(os.listdir(tmp_path))
    with pytest.raises(IsADirectoryError):
        write_expert_map(model, layout, target)
    assert set(os.listdir(tmp_path)) == before


def test_write_refuses_a_range_longer_than_8_mib(tmp_path: Path) -> None:
    spec = kit.TINY.with_(n_layer=1, n_embd=1024, n_ff_exp=2304, n_expert=1, n_expert_used=1)
    path = write_synthetic_model(tmp_path / "big.gguf", spec)[0]
    model, layout = _open(path)
    assert layout.max_expert_bytes > 3 * MAX_RANGE_BYTES
    before = set(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=r"ranges are 1\.\.8388608 bytes, an expert needs 9437184"):
        write_expert_map(model, layout, tmp_path / "m.weepf")
    assert set(os.listdir(tmp_path)) == before


def test_write_refuses_a_split_set(tmp_path: Path) -> None:
    shards = write_synthetic_model(tmp_path / "s.gguf", kit.TINY, shards=2)
    model, layout = _open(shards[0])
    with pytest.raises(ConfigError, match="split set of 2"):
        write_expert_map(model, layout, tmp_path / "m.weepf")
    assert not (tmp_path / "m.weepf").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".weepf")]


def test_write_with_a_pre_1970_mtime(tmp_path: Path, model_copy: Path) -> None:
    os.utime(model_copy, ns=(-(10**9), -(10**9)))
    if os.stat(model_copy).st_mtime_ns >= 0:  # pragma: no cover - file system without negative times
        pytest.skip("the file system cannot store a negative mtime")
    model, layout = _open(model_copy)
    with pytest.raises(ConfigError):
        write_expert_map(model, layout, tmp_path / "m.weepf")


# --------------------------------------------------------------------------------------------------
# refusals of the reader


def _write(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "x.weepf"
    p.write_bytes(data)
    return p


def test_hand_made_map_is_read(tmp_path: Path) -> None:
    layers = _valid_layers()
    emap = read_expert_map(_write(tmp_path, make_map(layers)))
    assert emap == ExpertMap(1 << 40, 1, 2, 3, tuple(tuple(rows) for rows in layers))


def test_wrong_magic(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"magic b'WEEPF002' is not b'WEEPF001'"):
        read_expert_map(_write(tmp_path, make_map(_valid_layers(), magic=b"WEEPF002")))


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    data = make_map(_valid_layers(2, 2))
    assert len(data) == 44 + 2 * (4 + 2 * 48)
    p = tmp_path / "cut.weepf"
    for n in range(len(data)):
        p.write_bytes(data[:n])
        with pytest.raises(FormatError, match="truncated"):
            read_expert_map(p)
    p.write_bytes(data)
    read_expert_map(p)


def test_truncated_real_map(tmp_path: Path, model_copy: Path) -> None:
    model, layout = _open(model_copy)
    write_expert_map(model, layout, tmp_path / "m.weepf")
    data = (tmp_path / "m.weepf").read_bytes()
    for n in sorted({0, 7, 8, 43, 44, 47, 48, 100, len(data) // 2, len(data) - 48, len(data) - 1}):
        with pytest.raises(FormatError, match="truncated"):
            read_expert_map(_write(tmp_path, data[:n]))


@pytest.mark.parametrize("extra", [b"\0", b"WEEPF001", bytes(48)])
def test_trailing_bytes(tmp_path: Path, extra: bytes) -> None:
    with pytest.raises(FormatError, match=rf"{len(extra)} trailing bytes after the last layer"):
        read_expert_map(_write(tmp_path, make_map(_valid_layers()) + extra))


@pytest.mark.parametrize("n_layers", [0, MAX_LAYERS + 1, 1 << 31, (1 << 32) - 1])
def test_n_layers_out_of_range(tmp_path: Path, n_layers: int) -> None:
    data = make_map(_valid_layers(), n_layers=n_layers)
    with pytest.raises(FormatError, match=rf"n_layers={n_layers}, expected 1\.\.4096"):
        read_expert_map(_write(tmp_path, data))


@pytest.mark.parametrize("n_experts", [0, MAX_EXPERTS_PER_LAYER + 1, (1 << 32) - 1])
def test_n_experts_out_of_range(tmp_path: Path, n_experts: int) -> None:
    data = make_map(_valid_layers(), n_experts=[2, n_experts])
    with pytest.raises(FormatError, match=rf"layer 1 has n_experts={n_experts}, expected 1\.\.512"):
        read_expert_map(_write(tmp_path, data))


def test_boundary_counts_are_accepted(tmp_path: Path) -> None:
    one = read_expert_map(_write(tmp_path, make_map([[_expert(0)]])))
    assert len(one.layers) == 1
    assert len(one.layers[0]) == 1
    full = read_expert_map(_write(tmp_path, make_map([[_expert(e * 3 * 4096) for e in range(512)]])))
    assert len(full.layers[0]) == 512


@pytest.mark.parametrize(
    ("which", "ranges", "size"),
    [
        ("length 0", ((0, 0), (8, 8), (16, 8)), 1 << 30),
        ("length 0 in down", ((0, 8), (8, 8), (16, 0)), 1 << 30),
        ("length 8 MiB + 1", ((0, 8), (8, MAX_RANGE_BYTES + 1), (1 << 25, 8)), 1 << 30),
        ("length 2**64-1", ((0, 8), (8, 8), (16, (1 << 64) - 1)), 1 << 30),
        ("past the model", ((0, 8), (8, 8), ((1 << 20) - 7, 8)), 1 << 20),
        ("offset near 2**64", (((1 << 64) - 4, 8), (8, 8), (16, 8)), 1 << 30),
        ("offset = size", ((1 << 20, 1), (8, 8), (16, 8)), 1 << 20),
    ],
)
def test_range_out_of_range(tmp_path: Path, which: str, ranges: tuple, size: int) -> None:
    data = make_map([[_expert(0), ranges]], size=size)
    with pytest.raises(FormatError, match=r"layer 0 expert 1: range offset=\d+ length=\d+ is outside"):
        read_expert_map(_write(tmp_path, data))


def test_range_boundaries_are_accepted(tmp_path: Path) -> None:
    size = 64 * MiB
    ranges = (
        (0, MAX_RANGE_BYTES),
        (MAX_RANGE_BYTES, 1),
        (size - 1, 1),
    )  # max length; ends exactly at the end
    emap = read_expert_map(_write(tmp_path, make_map([[ranges]], size=size)))
    assert emap.layers[0][0] == ranges


def test_too_big_to_be_a_map(tmp_path: Path) -> None:
    p = tmp_path / "huge.weepf"
    with open(p, "wb") as f:
        f.write(make_map(_valid_layers()))
        f.truncate(44 + MAX_LAYERS * (4 + MAX_EXPERTS_PER_LAYER * 48) + 1)
    with pytest.raises(FormatError, match="larger than any WEEPF001 map can be"):
        read_expert_map(p)


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"truncated WEEPF001 header \(0 bytes\)"):
        read_expert_map(_write(tmp_path, b""))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-loop"])
def test_not_a_regular_file_is_refused_before_it_is_opened(tmp_path: Path, kind: str) -> None:
    # opening a FIFO waits for a writer: the read must be refused before the open
    p = tmp_path / "not-a-map"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    else:
        os.symlink(p.name, p)
    message = (
        "a loop of symbolic links" if kind == "symlink-loop" else "is not a regular file, not a WEEPF001 expert map"
    )
    with pytest.raises(FormatError, match=message):
        read_expert_map(p)


# --------------------------------------------------------------------------------------------------
# stale maps


@pytest.fixture
def mapped(tmp_path: Path, model_copy: Path) -> tuple[Path, Path]:
    model, layout = _open(model_copy)
    map_path = tmp_path / "m.weepf"
    write_expert_map(model, layout, map_path)
    read_expert_map(map_path, open_model(model_copy).shards[0])  # fresh: accepted
    return model_copy, map_path


def test_stale_after_touch(mapped: tuple[Path, Path]) -> None:
    model_path, map_path = mapped
    st = os.stat(model_path)
    os.utime(model_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(StaleMapError, match=r"written for an earlier version of \S+\.gguf \(modified ") as info:
        read_expert_map(map_path, open_model(model_path).shards[0])
    text = str(info.value)
    assert "does not match the model" in text and "aioexperts-map write" in text
    assert "bytes long" not in text and "another file" not in text
    assert str(st.st_mtime_ns) not in text  # local ISO times, not raw numbers
    then, now = (f".{(st.st_mtime_ns + d) % 10**9:09d}" for d in (0, 1))
    assert then in text and now in text  # a touch 1 ns later reads differently
    assert info.value.recorded is not None and info.value.current is not None
    assert info.value.recorded["mtimes"] == [st.st_mtime_ns] and info.value.current["mtimes"] == [st.st_mtime_ns + 1]


def test_stale_after_a_size_change(mapped: tuple[Path, Path]) -> None:
    model_path, map_path = mapped
    st = os.stat(model_path)
    with open(model_path, "ab") as f:
        f.write(bytes(32))
    os.utime(model_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only the size differs
    with pytest.raises(StaleMapError, match=rf"it is {st.st_size + 32} bytes long, the map recorded {st.st_size}\)"):
        read_expert_map(map_path, open_model(model_path).shards[0])


def test_stale_for_another_file(mapped: tuple[Path, Path], tmp_path: Path) -> None:
    """A copy with the same size and mtime: only the inode differs."""
    model_path, map_path = mapped
    copy = tmp_path / "copy.gguf"
    shutil.copy2(model_path, copy)
    shard = open_model(copy).shards[0]
    if shard.mtime_ns != os.stat(model_path).st_mtime_ns:  # pragma: no cover
        pytest.skip("copy2 did not keep the nanosecond mtime here")
    with pytest.raises(StaleMapError, match=r"written for another file than copy.gguf"):
        read_expert_map(map_path, shard)


def test_stale_is_a_format_error_too(mapped: tuple[Path, Path]) -> None:
    model_path, map_path = mapped
    os.utime(model_path, ns=(0, 0))
    with pytest.raises(FormatError):
        read_expert_map(map_path, open_model(model_path).shards[0])


def test_map_ranges_differ_from_the_layout(mapped: tuple[Path, Path]) -> None:
    model_path, map_path = mapped
    data = bytearray(map_path.read_bytes())
    # layer record 1, expert 5, up range: offset -= 32 (still a valid map)
    pos = 44 + (4 + 8 * 48) + 4 + 5 * 48 + 16
    (off,) = struct.unpack_from("<Q", data, pos)
    struct.pack_into("<Q", data, pos, off - 32)
    map_path.write_bytes(bytes(data))
    model, layout = _open(model_path)
    emap = read_expert_map(map_path)  # valid on its own; the model identity is not checked here
    with pytest.raises(StaleMapError, match=r"MoE layer record 1 differs from the model \(block 1\); regenerate it"):
        check_map_matches_layout(emap, layout)


def test_map_of_another_model(tmp_path: Path, model_copy: Path) -> None:
    other = write_synthetic_model(tmp_path / "other.gguf", kit.TINY)[0]  # 2 MoE layers
    model, layout = _open(other)
    write_expert_map(model, layout, tmp_path / "other.weepf")
    emap = read_expert_map(tmp_path / "other.weepf")
    _, qwen_layout = _open(model_copy)
    with pytest.raises(StaleMapError, match="2 layers, the model has 3 MoE layers; regenerate it"):
        check_map_matches_layout(emap, qwen_layout, where="other.weepf")
    with pytest.raises(StaleMapError, match="written for another file than .*write it again"):
        read_expert_map(tmp_path / "other.weepf", open_model(model_copy).shards[0])


def test_map_with_fewer_experts_than_the_layout(mapped: tuple[Path, Path], tmp_path: Path) -> None:
    model_path, _ = mapped
    model, layout = _open(model_path)
    st = os.stat(model_path)
    rows = [
        [tuple((s.offset, s.n_bytes) for s in moe.locate(e).segments) for e in range(moe.n_experts)]
        for moe in layout.layers.values()
    ]
    rows[2] = rows[2][:7]
    emap = read_expert_map(
        _write(tmp_path, make_map(rows, size=st.st_size, dev=st.st_dev, ino=st.st_ino, mtime_ns=st.st_mtime_ns)),
        model.shards[0],
    )
    with pytest.raises(StaleMapError, match="record 2 differs"):
        check_map_matches_layout(emap, layout)
