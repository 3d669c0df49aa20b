"""The GGUF header reader on files written byte by byte: nested arrays, empty keys, strings that are
not UTF-8, large arrays, and the public-API-only rule for the ``gguf`` package.

Expected values are the literals the files were written from (``gguf_bytes`` is a separate writer
made from the format description), never values read back by the code under test.
"""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import format_testkit as kit
import gguf_bytes as gb
import pytest
from gguf import GGUFReader, GGUFValueType

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.hparams import MoEHParams
from aioexperts._format.model import LossyStr, SkippedValue, open_model

T = GGUFValueType
FORMAT_DIR = Path(__file__).resolve().parents[2] / "aioexperts" / "_format"
# GGUFReader's private helpers (gguf 0.17-0.19) that an earlier reader overrode
_READER_INTERNALS = {
    "_get_str",
    "_get_field_parts",
    "_get_tensor_info_field",
    "_build_fields",
    "_build_tensor_info",
    "_build_tensors",
    "_push_field",
    "gguf_scalar_to_np",
}


def _moe_file(tmp_path: Path, *extra: tuple[str | bytes, GGUFValueType, object], arch: str = "qwen3moe") -> Path:
    """A small valid MoE model (one layer, 4 experts of width 32) plus the extra key/values."""
    f = gb.GGUFBytes()
    f.add("general.architecture", T.STRING, arch)
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 32),
        ("expert_count", 4),
        ("expert_used_count", 2),
        ("expert_feed_forward_length", 32),
    ):
        f.add(f"{arch}.{key}", T.UINT32, value)
    for key, vtype, value in extra:
        f.add(key, vtype, value)
    f.tensors = [
        gb.Tensor("blk.0.ffn_gate_inp.weight", [32, 4]),
        gb.Tensor("blk.0.ffn_gate_exps.weight", [32, 32, 4]),
        gb.Tensor("blk.0.ffn_up_exps.weight", [32, 32, 4]),
        gb.Tensor("blk.0.ffn_down_exps.weight", [32, 32, 4]),
    ]
    path = tmp_path / "m.gguf"
    path.write_bytes(f.build())
    return path


# --------------------------------------------------------------------------------------------------
# 1. nested arrays and empty keys


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            gb.Arr(T.ARRAY, [gb.Arr(T.STRING, ["a", "bc"]), gb.Arr(T.STRING, ["def"])]),
            [["a", "bc"], ["def"]],
        ),
        (gb.Arr(T.ARRAY, [gb.Arr(T.UINT32, [1, 2, 3]), gb.Arr(T.UINT32, [4])]), [[1, 2, 3], [4]]),
        # the first inner array is empty: the second still has its own item type (a writer that takes
        # the item type of the first inner array for all of them reads the strings as integers)
        (gb.Arr(T.ARRAY, [gb.Arr(T.UINT32, []), gb.Arr(T.STRING, ["x", "yz"])]), [[], ["x", "yz"]]),
        (
            gb.Arr(T.ARRAY, [gb.Arr(T.UINT8, [7, 8]), gb.Arr(T.STRING, ["s"]), gb.Arr(T.FLOAT32, [1.5])]),
            [[7, 8], ["s"], [1.5]],
        ),
        (gb.Arr(T.ARRAY, [gb.Arr(T.ARRAY, [gb.Arr(T.INT16, [-1]), gb.Arr(T.BOOL, [True])])]), [[[-1], [True]]]),
        (gb.Arr(T.ARRAY, []), []),
    ],
    ids=["strings", "u32", "first-empty", "mixed-types", "three-deep", "empty-outer"],
)
def test_nested_arrays_read_as_nested_lists(tmp_path: Path, value: gb.Arr, expected: list[object]) -> None:
    model = open_model(_moe_file(tmp_path, ("test.nested", T.ARRAY, value)))
    assert model.metadata["test.nested"] == expected
    assert model.value_types["test.nested"] == T.ARRAY
    # each leaf keeps the Python type of its own inner array
    if expected and expected[0] == [] and len(expected) > 1:
        assert all(isinstance(s, str) for s in model.metadata["test.nested"][1])


def test_nested_arrays_deeper_than_the_limit_are_refused_naming_the_key(tmp_path: Path) -> None:
    value = gb.Arr(T.UINT8, [1])
    for _ in range(9):  # 10 levels in all
        value = gb.Arr(T.ARRAY, [value])
    with pytest.raises(FormatError, match=r"'test\.deep' nests arrays deeper than 8 levels"):
        open_model(_moe_file(tmp_path, ("test.deep", T.ARRAY, value)))


def test_nested_array_with_an_inner_count_larger_than_the_file(tmp_path: Path) -> None:
    value = gb.Arr(T.ARRAY, [gb.Arr(T.UINT32, [1, 2], count=1 << 40)])
    with pytest.raises(FormatError, match=r"array 'test\.lie' at byte \d+ claims 1099511627776 items"):
        open_model(_moe_file(tmp_path, ("test.lie", T.ARRAY, value)))


def test_empty_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r'metadata key #\d+ at byte \d+ is empty \(""\)'):
        open_model(_moe_file(tmp_path, ("", T.UINT32, 5)))


def test_duplicate_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"duplicate metadata key 'test\.k'"):
        open_model(_moe_file(tmp_path, ("test.k", T.UINT32, 1), ("test.k", T.STRING, "again")))


# --------------------------------------------------------------------------------------------------
# 2. strings that are not UTF-8


BAD = b"Qwen\xff\xfe-MoE \xc3("  # 0xff, 0xfe and a truncated two-byte sequence


@pytest.mark.parametrize("key", ["general.name", "tokenizer.chat_template", "general.description"])
def test_non_utf8_string_does_not_refuse_the_model(tmp_path: Path, key: str) -> None:
    model = open_model(_moe_file(tmp_path, (key, T.STRING, BAD)))
    value = model.metadata[key]
    assert isinstance(value, LossyStr)
    assert value.raw == BAD
    assert value == "Qwen\ufffd\ufffd-MoE \ufffd("
    assert model.architecture == "qwen3moe"
    hp = MoEHParams.from_metadata(model.architecture, model.metadata)  # the store's keys still read
    assert (hp.n_expert, hp.n_expert_used) == (4, 2)


def test_non_utf8_items_of_a_string_array_and_a_non_utf8_key(tmp_path: Path) -> None:
    model = open_model(
        _moe_file(
            tmp_path,
            ("test.strings", T.ARRAY, gb.Arr(T.STRING, ["ok", b"\x80bad"])),
            (b"test.\xffkey", T.UINT32, 9),
        )
    )
    ok, bad = model.metadata["test.strings"]
    assert ok == "ok" and not isinstance(ok, LossyStr)
    assert isinstance(bad, LossyStr) and bad.raw == b"\x80bad"
    (key,) = [k for k in model.metadata if k.startswith("test.") and k != "test.strings"]
    assert isinstance(key, LossyStr) and key.raw == b"test.\xffkey"
    assert model.metadata[key] == 9


def test_non_utf8_architecture_is_refused_naming_the_key(tmp_path: Path) -> None:
    f = gb.GGUFBytes().add("general.architecture", T.STRING, b"qwen3\xffmoe")
    path = tmp_path / "a.gguf"
    path.write_bytes(f.build())
    with pytest.raises(FormatError, match=r"general\.architecture is not valid UTF-8"):
        open_model(path)


def test_non_utf8_string_in_a_key_the_store_reads_is_refused_naming_it(tmp_path: Path) -> None:
    model = open_model(_moe_file(tmp_path, ("qwen3moe.expert_shared_feed_forward_length", T.STRING, b"\xff")))
    with pytest.raises(FormatError, match=r"qwen3moe\.expert_shared_feed_forward_length is a string that is not valid"):
        MoEHParams.from_metadata(model.architecture, model.metadata)


# --------------------------------------------------------------------------------------------------
# 3. large arrays: length known, items left in the file


def test_large_string_array_is_skipped_with_its_length(tmp_path: Path) -> None:
    tokens = [f"t{i}" for i in range(5000)]
    path = _moe_file(tmp_path, ("tokenizer.ggml.tokens", T.ARRAY, gb.Arr(T.STRING, tokens)))
    model = open_model(path)
    value = model.metadata["tokenizer.ggml.tokens"]
    assert isinstance(value, SkippedValue)
    assert len(value) == 5000
    assert (value.value_type, value.item_type) == (T.ARRAY, T.STRING)
    assert value.n_bytes == sum(8 + len(t) for t in tokens)
    assert kit.pread(path, value.offset, 10) == struct.pack("<Q", 2) + b"t0"
    assert "tokenizer.ggml.tokens" in model.skipped_arrays


def test_large_nested_array_is_skipped_by_its_leaves(tmp_path: Path) -> None:
    value = gb.Arr(T.ARRAY, [gb.Arr(T.UINT16, list(range(1000))) for _ in range(5)])
    model = open_model(_moe_file(tmp_path, ("test.big", T.ARRAY, value), ("test.after", T.UINT32, 77)))
    skipped = model.metadata["test.big"]
    assert isinstance(skipped, SkippedValue) and len(skipped) == 5 and skipped.item_type == T.ARRAY
    assert model.metadata["test.after"] == 77  # the reader went past it correctly


def test_per_layer_array_of_a_moe_key_is_still_refused_when_large(tmp_path: Path) -> None:
    model = open_model(_moe_file(tmp_path, ("qwen3moe.feed_forward_length", T.ARRAY, gb.Arr(T.UINT32, [64] * 5000))))
    with pytest.raises(UnsupportedTypeError, match=r"feed_forward_length is a per-layer array \(5000 values\)"):
        MoEHParams.from_metadata(model.architecture, model.metadata)


# --------------------------------------------------------------------------------------------------
# agreement with gguf.GGUFReader's public fields, and no private gguf API in the reader


@pytest.mark.parametrize("name", kit.FIXTURE_NAMES or ["<no fixtures>"])
def test_metadata_equals_gguf_readers_public_fields(name: str) -> None:
    path = kit.fixture_path(name)
    model = open_model(path)
    reader = GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(model.metadata) == keys
    for key in keys:
        field = reader.fields[key]
        ours = model.metadata[key]
        assert model.value_types[key] == field.types[0], key
        if isinstance(ours, SkippedValue):
            assert len(ours) == len(field.data), key
        else:
            assert ours == field.contents(), key


def test_the_format_modules_use_no_private_gguf_api() -> None:
    """The bounds checks must not depend on ``GGUFReader`` internals that change between versions."""
    offenders = []
    for source in sorted(FORMAT_DIR.glob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gguf":
                offenders += [f"{source.name}: {a.name}" for a in node.names if a.name.startswith("_")]
                offenders += [f"{source.name}: {a.name}" for a in node.names if a.name == "GGUFReader"]
                if any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{source.name}: {node.module}")
            if isinstance(node, ast.Attribute) and node.attr in _READER_INTERNALS:
                offenders.append(f"{source.name}: .{node.attr}")
    assert offenders == []
