"""Fuzz the parsers: corrupted GGUF headers and WEEPF001 maps either parse or raise AioExpertsError.

Never another exception type, never a hang (pytest-timeout), and whatever parses is still in bounds:
every tensor and every expert byte run lies inside its file, every map range inside its model.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import format_testkit as kit
import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aioexperts._errors import AioExpertsError
from aioexperts._format.expert_map import (
    MAX_RANGE_BYTES,
    check_map_matches_layout,
    read_expert_map,
    write_expert_map,
)
from aioexperts._format.layout import build_layout
from aioexperts._format.model import GGUFModel, open_model
from aioexperts.testing import write_synthetic_model

Q = kit.Q
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
INTERESTING_U64 = [
    0,
    1,
    2,
    3,
    4,
    5,
    9,
    24,
    31,
    32,
    33,
    64,
    255,
    4096,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 32,
    (1 << 64) - 1,
]


def _base_gguf(path: Path) -> Path:
    """A small valid MoE GGUF with strings, arrays (ints, strings, bools) and a mixed-tier layer."""
    layers = {**kit.moe_layer(0), **kit.moe_layer(1, banks=((3, Q.F32), (3, Q.F16), (2, Q.Q8_0)))}
    kv = kit.moe_kv()
    kv["tokenizer.ggml.model"] = ("none", GGUFValueType.STRING)
    kv["tokenizer.ggml.tokens"] = (["<s>", "a", "bc", "def", "\u00e9"], GGUFValueType.ARRAY)
    kv["tokenizer.ggml.token_type"] = ([1, 2, 3, 1, 1], GGUFValueType.ARRAY)
    kv["test.flags"] = ([True, False, True], GGUFValueType.ARRAY)
    kv["qwen3moe.rope.freq_base"] = (10000.0, GGUFValueType.FLOAT32)
    return kit.write_gguf(path, kit.as_specs(layers), kv=kv)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def base_gguf(fuzz_dir: Path) -> tuple[bytes, int]:
    path = _base_gguf(fuzz_dir / "base.gguf")
    build_layout(open_model(path))  # valid to start with
    return path.read_bytes(), GGUFReader(path).data_offset


def _check_in_bounds(model: GGUFModel) -> None:
    """What parsed must be in bounds: a corrupted file may parse, but never point outside itself."""
    sizes = [s.size for s in model.shards]
    for info in model.tensors.values():
        assert 0 <= info.data_offset, info
        assert info.data_offset + info.n_bytes <= sizes[info.shard], info
    try:
        layout = build_layout(model)
    except AioExpertsError:
        return
    for loc in layout:
        for seg in loc.segments:
            assert seg.n_bytes > 0, seg
            assert 0 <= seg.offset, seg
            assert seg.end <= sizes[seg.shard], seg


def _open_or_refuse(path: Path) -> None:
    try:
        model = open_model(path)
    except AioExpertsError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("parsed")
    _check_in_bounds(model)


overwrite = st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255))
bitflip = st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7))
u64 = st.tuples(st.just("u64"), st.integers(0, 1 << 20), st.sampled_from(INTERESTING_U64))
u32 = st.tuples(st.just("u32"), st.integers(0, 1 << 20), st.sampled_from([v for v in INTERESTING_U64 if v < 1 << 32]))
mutations = st.lists(st.one_of(overwrite, bitflip, u64, u32), min_size=1, max_size=6)


def _mutate(data: bytearray, muts: list[tuple[str, int, int]], region: int) -> None:
    for kind, pos, value in muts:
        pos %= region
        if kind == "set":
            data[pos] = value
        elif kind == "flip":
            data[pos] ^= 1 << value
        elif kind == "u64" and pos + 8 <= len(data):
            struct.pack_into("<Q", data, pos, value)
        elif kind == "u32" and pos + 4 <= len(data):
            struct.pack_into("<I", data, pos, value)


@pytest.mark.timeout(120)
@FUZZ
@given(muts=mutations, cut=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_fuzz_gguf_header(base_gguf: tuple[bytes, int], fuzz_dir: Path, muts: list, cut: int | None) -> None:
    base, header_len = base_gguf
    data = bytearray(base)
    _mutate(data, muts, header_len + 64)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    path = fuzz_dir / "fuzzed.gguf"
    path.write_bytes(bytes(data))
    _open_or_refuse(path)


@pytest.mark.timeout(60)
@FUZZ
@given(cut=st.integers(0, 1 << 20))
def test_fuzz_gguf_truncation(base_gguf: tuple[bytes, int], fuzz_dir: Path, cut: int) -> None:
    base, header_len = base_gguf
    n = cut % (header_len + 256)
    path = fuzz_dir / "cut.gguf"
    path.write_bytes(base[:n])
    with pytest.raises(AioExpertsError):
        open_model(path)


@pytest.fixture(scope="module")
def fixture_copy(fuzz_dir: Path) -> tuple[Path, bytes]:
    path = kit.copy_fixture("qwen3moe-mixed.gguf", fuzz_dir)
    header_len = GGUFReader(path).data_offset
    with open(path, "rb") as f:
        header = f.read(header_len + 64)
    return path, header


@pytest.mark.timeout(120)
@FUZZ
@given(muts=mutations)
def test_fuzz_fixture_header(fixture_copy: tuple[Path, bytes], muts: list) -> None:
    """The mixed-tier fixture's header, corrupted in place (restored after each example)."""
    path, header = fixture_copy
    data = bytearray(header)
    _mutate(data, muts, len(header))
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(data), 0)
        try:
            _open_or_refuse(path)
        finally:
            os.pwrite(fd, header, 0)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# WEEPF001


@pytest.fixture(scope="module")
def base_map(fuzz_dir: Path) -> tuple[bytes, Path]:
    model_path = write_synthetic_model(fuzz_dir / "tiny.gguf", kit.TINY)[0]
    model = open_model(model_path)
    write_expert_map(model, build_layout(model), fuzz_dir / "tiny.weepf")
    return (fuzz_dir / "tiny.weepf").read_bytes(), model_path


def _read_map_or_refuse(path: Path, model_path: Path) -> None:
    try:
        emap = read_expert_map(path)
    except AioExpertsError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("parsed")
    assert 1 <= len(emap.layers)
    for rows in emap.layers:
        assert 1 <= len(rows) <= 512
        for ranges in rows:
            for off, n in ranges:
                assert 1 <= n <= MAX_RANGE_BYTES
                assert off + n <= emap.model_size
    model = open_model(model_path)
    try:
        read_expert_map(path, model.shards[0])
        check_map_matches_layout(emap, build_layout(model))
    except AioExpertsError:
        return


@pytest.mark.timeout(60)
@FUZZ
@given(muts=mutations, cut=st.one_of(st.none(), st.integers(0, 1 << 16)), tail=st.binary(max_size=64))
def test_fuzz_expert_map_mutations(
    base_map: tuple[bytes, Path], fuzz_dir: Path, muts: list, cut: int | None, tail: bytes
) -> None:
    base, model_path = base_map
    data = bytearray(base)
    _mutate(data, muts, len(data))
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    path = fuzz_dir / "fuzzed.weepf"
    path.write_bytes(bytes(data) + tail)
    _read_map_or_refuse(path, model_path)


@pytest.mark.timeout(60)
@FUZZ
@given(blob=st.one_of(st.binary(max_size=1024), st.binary(max_size=512).map(lambda b: b"WEEPF001" + b)))
def test_fuzz_expert_map_random_bytes(base_map: tuple[bytes, Path], fuzz_dir: Path, blob: bytes) -> None:
    _, model_path = base_map
    path = fuzz_dir / "random.weepf"
    path.write_bytes(blob)
    _read_map_or_refuse(path, model_path)
