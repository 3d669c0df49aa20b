"""Routing traces: construction, recorder, save/load round trip, every malformed file, generators."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aioexperts._errors import ConfigError, FormatError, InvalidRequestError
from aioexperts._predict.trace import (
    TRACE_FORMAT_VERSION,
    RoutingTrace,
    TraceRecorder,
    skewed_random_trace,
    uniform_random_trace,
)


def small_trace(dtype: Any = np.int16) -> RoutingTrace:
    ids = np.array(
        [
            [[0, 3], [1, -1], [4, 4]],
            [[2, 1], [-1, -1], [0, 5]],
        ],
        dtype=dtype,
    )
    return RoutingTrace(ids, layers=[1, 2, 5], n_experts=[4, 2, 6], metadata={"model": "glm4moe", "seed": "7"})


def valid_arrays() -> dict[str, np.ndarray]:
    trace = small_trace()
    return {
        "version": np.array(TRACE_FORMAT_VERSION, dtype=np.int64),
        "ids": np.array(trace.ids),
        "layers": np.array(trace.layers, dtype=np.int64),
        "n_experts": np.array(trace.n_experts, dtype=np.int64),
        "metadata": np.array(json.dumps(dict(trace.metadata))),
    }


def write_npz(path: Path, arrays: dict[str, Any], *, allow_pickle: bool = False) -> Path:
    with path.open("wb") as f:
        np.savez(f, allow_pickle=allow_pickle, **arrays)
    return path


# --- construction -------------------------------------------------------------------------------


def test_trace_properties_and_immutability() -> None:
    trace = small_trace()
    assert (trace.n_tokens, trace.n_layers, trace.k) == (2, 3, 2)
    assert len(trace) == 2
    assert trace.layers == (1, 2, 5)
    assert trace.n_experts == (4, 2, 6)
    assert trace.n_experts_total == 12
    assert trace.layer_index(5) == 2
    with pytest.raises(InvalidRequestError):
        trace.layer_index(0)
    assert trace.ids.dtype == np.int16
    with pytest.raises(ValueError, match="read-only"):
        trace.ids[0, 0, 0] = 1
    with pytest.raises(AttributeError):
        trace.layers = (0, 1, 2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        trace.metadata["x"] = "y"  # type: ignore[index]
    assert trace == small_trace()
    assert trace == small_trace(np.int32)  # equality compares values, not the ids dtype
    assert "glm4moe" in repr(trace)


def test_constructor_copies_and_converts() -> None:
    source = np.zeros((3, 1, 2), dtype=np.int64)
    source[:, 0, 1] = 1
    trace = RoutingTrace(source, [0], 8)
    source[0, 0, 0] = 5
    assert trace.ids[0, 0, 0] == 0
    assert trace.ids.dtype == np.int16
    assert trace.n_experts == (8,)
    big = RoutingTrace(np.array([[[40_000]]]), [3], [50_000])
    assert big.ids.dtype == np.int32
    kept = RoutingTrace(np.zeros((1, 1, 1), dtype=">i4"), [0], 2)
    assert kept.ids.dtype == np.dtype(np.int32)
    assert kept.ids.dtype.isnative


@pytest.mark.parametrize(
    ("ids", "layers", "n_experts", "match"),
    [
        (np.zeros((2, 2), np.int16), [0, 1], 4, "3 dimensions"),
        (np.zeros((1, 2, 1), np.float32), [0, 1], 4, "integers"),
        (np.zeros((1, 2, 1), np.int16), [0], 4, "layers has 1 entries"),
        (np.zeros((1, 2, 1), np.int16), [0, 1], [4, 4, 4], "n_experts has 3"),
        (np.zeros((1, 2, 1), np.int16), [1, 1], 4, "strictly increasing"),
        (np.zeros((1, 2, 1), np.int16), [-1, 1], 4, "non-negative"),
        (np.zeros((1, 2, 3), np.int16), [0, 1], [4, 2], "k=3"),
        (np.full((1, 2, 1), 4, np.int16), [0, 1], 4, r"\[-1, 4\)"),
        (np.full((1, 2, 1), -2, np.int64), [0, 1], 4, r"\[-1, 4\)"),
        (np.zeros((1, 0, 1), np.int16), [], [], "at least one layer"),
    ],
)
def test_constructor_rejects(ids: np.ndarray, layers: list[int], n_experts: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RoutingTrace(ids, layers, n_experts)


def test_metadata_must_be_strings() -> None:
    with pytest.raises(ConfigError, match="str to str"):
        RoutingTrace(np.zeros((1, 1, 1), np.int16), [0], 2, {"seed": 3})  # type: ignore[dict-item]


# --- recorder -------------------------------------------------------------------------------------


def test_recorder_appends_per_layer_and_fills_gaps() -> None:
    recorder = TraceRecorder([1, 3], [8, 8], 2, metadata={"model": "m"})
    recorder.record(1, [0, 1])
    recorder.record(3, np.array([[2, 3], [4, 5]]))  # a batch of two tokens
    recorder.record(1, [6, -1])
    recorder.record(1, [7, 7], token_index=4)  # leaves token 2 and 3 unrecorded at layer 1
    assert len(recorder) == 5
    trace = recorder.trace()
    assert trace.layers == (1, 3)
    assert trace.metadata == {"model": "m"}
    expected = np.full((5, 2, 2), -1)
    expected[0, 0] = [0, 1]
    expected[1, 0] = [6, -1]
    expected[4, 0] = [7, 7]
    expected[0, 1] = [2, 3]
    expected[1, 1] = [4, 5]
    np.testing.assert_array_equal(trace.ids, expected)
    recorder.record(3, [1, 1])  # appends after layer 3's cursor (token 2)
    assert recorder.trace().ids[2, 1].tolist() == [1, 1]
    recorder.record(3, [0, 0], token_index=0)  # overwrites
    assert recorder.trace().ids[0, 1].tolist() == [0, 0]
    assert trace.ids[0, 1].tolist() == [2, 3]  # earlier snapshots are copies
    recorder.clear()
    assert len(recorder) == 0
    assert recorder.trace().n_tokens == 0


def test_recorder_grows_past_initial_buffer() -> None:
    recorder = TraceRecorder([0], 16, 1)
    for t in range(1000):
        recorder.record(0, [t % 16])
    np.testing.assert_array_equal(recorder.trace().ids[:, 0, 0], np.arange(1000) % 16)


def test_recorder_rejects() -> None:
    recorder = TraceRecorder([1, 2], 4, 2, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="layer 0"):
        recorder.record(0, [0, 1])
    with pytest.raises(InvalidRequestError, match=r"\[-1, 4\)"):
        recorder.record(1, [0, 4])
    with pytest.raises(ConfigError, match="shape"):
        recorder.record(1, [0, 1, 2])
    with pytest.raises(ConfigError, match="max_tokens"):
        recorder.record(1, [[0, 1]] * 3)
    with pytest.raises(ConfigError):
        TraceRecorder([2, 1], 4, 2)
    with pytest.raises(ConfigError):
        TraceRecorder([1], 4, 5)
    with pytest.raises(ConfigError, match="integers"):
        TraceRecorder([1.5], 4, 2)  # type: ignore[list-item]


# --- save / load ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(tmp_path: Path, dtype: Any, compress: bool) -> None:
    trace = small_trace(dtype)
    path = tmp_path / "trace.bin"  # no .npz suffix is appended
    trace.save(path, compress=compress)
    assert path.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["trace.bin"]  # no temporary left behind
    loaded = RoutingTrace.load(path)
    assert loaded == trace
    assert loaded.ids.dtype == dtype
    assert loaded.metadata == {"model": "glm4moe", "seed": "7"}
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == sorted(f"{key}.npy" for key in valid_arrays())


def test_round_trip_empty_and_generated(tmp_path: Path) -> None:
    empty = RoutingTrace(np.empty((0, 2, 4), np.int16), [1, 2], 8)
    empty.save(tmp_path / "e.npz")
    assert RoutingTrace.load(tmp_path / "e.npz") == empty
    generated = skewed_random_trace(50, range(1, 5), 64, 6, seed=3)
    generated.save(str(tmp_path / "g.npz"))
    assert RoutingTrace.load(str(tmp_path / "g.npz")) == generated


def test_valid_arrays_helper_loads(tmp_path: Path) -> None:
    assert RoutingTrace.load(write_npz(tmp_path / "ok.npz", valid_arrays())) == small_trace()


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(arrays: dict[str, Any]) -> None:
        arrays[key] = value

    return mutate


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(arrays: dict[str, Any]) -> None:
        del arrays[key]

    return mutate


def _ids_value(index: tuple[int, int, int], value: int) -> Callable[[dict[str, Any]], None]:
    def mutate(arrays: dict[str, Any]) -> None:
        arrays["ids"] = arrays["ids"].copy()
        arrays["ids"][index] = value

    return mutate


MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "wrong version": (_set("version", np.array(2, np.int64)), "unsupported trace version"),
    "version not a scalar": (_set("version", np.array([1], np.int64)), "unsupported trace version"),
    "version as a string": (_set("version", np.array("1")), "unsupported trace version"),
    "ids float": (_set("ids", np.zeros((2, 3, 2), np.float32)), "int16 or int32"),
    "ids int64": (_set("ids", np.zeros((2, 3, 2), np.int64)), "int16 or int32"),
    "ids uint16": (_set("ids", np.zeros((2, 3, 2), np.uint16)), "int16 or int32"),
    "ids 2-d": (_set("ids", np.zeros((2, 3), np.int16)), "3 dimensions"),
    "id too large": (_ids_value((1, 1, 0), 2), r"layer 2 must be in \[-1, 2\)"),
    "id below -1": (_ids_value((0, 2, 1), -2), r"layer 5 must be in \[-1, 6\)"),
    "layers count mismatch": (_set("layers", np.array([1, 2], np.int64)), "layers has 2 entries"),
    "n_experts count mismatch": (_set("n_experts", np.array([4, 2, 6, 6], np.int64)), "n_experts has 4"),
    "layers float": (_set("layers", np.array([1.0, 2.0, 5.0])), "1-d integer array"),
    "layers 2-d": (_set("layers", np.array([[1, 2, 5]], np.int64)), "1-d integer array"),
    "layers not increasing": (_set("layers", np.array([1, 5, 2], np.int64)), "strictly increasing"),
    "n_experts zero": (_set("n_experts", np.array([4, 0, 6], np.int64)), "n_experts of layer 2"),
    "n_experts below k": (_set("n_experts", np.array([4, 1, 6], np.int64)), "k=2"),
    "missing ids": (_drop("ids"), r"missing \['ids'\]"),
    "missing version": (_drop("version"), r"missing \['version'\]"),
    "missing metadata": (_drop("metadata"), r"missing \['metadata'\]"),
    "unexpected key": (_set("extra", np.zeros(1)), r"unexpected \['extra'\]"),
    "metadata not json": (_set("metadata", np.array("{nope")), "not valid JSON"),
    "metadata not str to str": (_set("metadata", np.array('{"seed": 7}')), "str to str"),
    "metadata a list": (_set("metadata", np.array('["a"]')), "str to str"),
    "metadata bytes": (_set("metadata", np.array(b"{}")), "0-d unicode"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_load_rejects_malformed(tmp_path: Path, case: str) -> None:
    mutate, match = MALFORMED[case]
    arrays = valid_arrays()
    mutate(arrays)
    path = write_npz(tmp_path / "bad.npz", arrays)
    with pytest.raises(FormatError, match=match) as info:
        RoutingTrace.load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_load_refuses_pickled_object_array(tmp_path: Path) -> None:
    arrays: dict[str, Any] = valid_arrays()
    arrays["metadata"] = np.array([{"model": "x"}], dtype=object)
    path = write_npz(tmp_path / "pickled.npz", arrays, allow_pickle=True)
    with pytest.raises(FormatError, match="pickle"):
        RoutingTrace.load(path)
    arrays = valid_arrays()
    arrays["ids"] = np.array(small_trace().ids.tolist(), dtype=object)
    path = write_npz(tmp_path / "pickled_ids.npz", arrays, allow_pickle=True)
    with pytest.raises(FormatError, match="pickle"):
        RoutingTrace.load(path)


def test_load_rejects_non_archives(tmp_path: Path) -> None:
    npy = tmp_path / "single.npy"
    np.save(npy, np.zeros((1, 1, 1), np.int16))
    with pytest.raises(FormatError, match="not a routing trace"):
        RoutingTrace.load(npy)
    pickled = tmp_path / "pickled.bin"
    pickled.write_bytes(b"\x80\x04\x95" + b"\x00" * 20)
    with pytest.raises(FormatError, match="not a routing trace"):  # refused before numpy sees it
        RoutingTrace.load(pickled)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(FormatError):
        RoutingTrace.load(empty)
    good = tmp_path / "good.npz"
    small_trace().save(good)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(FormatError):
        RoutingTrace.load(truncated)


def test_load_rejects_corrupt_member(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for key, value in valid_arrays().items():
            member = io.BytesIO()
            np.save(member, value)
            data = member.getvalue()
            archive.writestr(f"{key}.npy", data[:-3] if key == "ids" else data)  # ids is short
    path = tmp_path / "short.npz"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(FormatError):
        RoutingTrace.load(path)


def test_load_missing_file_is_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RoutingTrace.load(tmp_path / "absent.npz")


# --- generators -----------------------------------------------------------------------------------


def _check_distinct(trace: RoutingTrace) -> None:
    ids = np.sort(trace.ids, axis=2)
    assert (ids[..., 1:] != ids[..., :-1]).all()
    assert (ids >= 0).all()


def test_uniform_random_trace() -> None:
    trace = uniform_random_trace(300, [1, 2, 3], [16, 32, 64], 4, seed=1)
    assert trace.ids.shape == (300, 3, 4)
    assert trace.ids.dtype == np.int16
    assert trace.n_experts == (16, 32, 64)
    _check_distinct(trace)
    for i, n in enumerate(trace.n_experts):
        assert trace.ids[:, i].max() < n
        counts = np.bincount(trace.ids[:, i].ravel(), minlength=n)
        assert counts.min() > 0  # every expert shows up
    assert trace == uniform_random_trace(300, [1, 2, 3], [16, 32, 64], 4, seed=1)
    assert trace != uniform_random_trace(300, [1, 2, 3], [16, 32, 64], 4, seed=2)
    assert trace.metadata["generator"] == "uniform_random_trace"
    assert trace.metadata["seed"] == "1"


def test_skewed_random_trace_is_skewed_and_local() -> None:
    n, k = 64, 4
    skewed = skewed_random_trace(2000, [0, 1], n, k, seed=5, zipf_exponent=1.0, locality=0.5, metadata={"model": "m"})
    uniform = uniform_random_trace(2000, [0, 1], n, k, seed=5)
    assert skewed.ids.shape == (2000, 2, k)
    _check_distinct(skewed)
    assert skewed.metadata["model"] == "m"
    assert skewed.metadata["zipf_exponent"] == "1.0"

    def top_share(trace: RoutingTrace, layer: int) -> float:
        counts = np.bincount(trace.ids[:, layer].ravel(), minlength=n)
        return float(np.sort(counts)[-n // 8 :].sum() / counts.sum())

    def reuse(trace: RoutingTrace, layer: int) -> float:
        ids = trace.ids[:, layer]
        same = (ids[1:, :, None] == ids[:-1, None, :]).any(axis=2)
        return float(same.mean())

    for layer in (0, 1):
        assert top_share(skewed, layer) > 2 * top_share(uniform, layer)
        assert reuse(skewed, layer) > 0.5 > 2 * reuse(uniform, layer)
    # each layer has its own popularity order
    orders = [np.argsort(np.bincount(skewed.ids[:, i].ravel(), minlength=n)) for i in (0, 1)]
    assert not np.array_equal(orders[0], orders[1])
    assert skewed == skewed_random_trace(2000, [0, 1], n, k, seed=5, metadata={"model": "m"})


def test_skewed_limits() -> None:
    no_locality = skewed_random_trace(200, [0], 16, 4, seed=0, zipf_exponent=0.0, locality=0.0)
    _check_distinct(no_locality)
    sticky = skewed_random_trace(50, [0], 16, 4, seed=0, locality=1.0)
    assert (np.sort(sticky.ids[1:, 0], axis=1) == np.sort(sticky.ids[:1, 0], axis=1)).all()
    mixed = skewed_random_trace(100, [0, 1], [8, 300], 8, seed=0)
    _check_distinct(mixed)
    assert mixed.ids[:, 0].max() < 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k": 9},
        {"n_tokens": -1},
        {"zipf_exponent": -1.0},
        {"locality": 1.5},
        {"layers": []},
    ],
)
def test_generator_arguments_rejected(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"n_tokens": 10, "layers": [0], "n_experts": 8, "k": 2, "seed": 0, **kwargs}
    with pytest.raises(ConfigError):
        skewed_random_trace(**args)
    if not {"zipf_exponent", "locality"} & kwargs.keys():
        with pytest.raises(ConfigError):
            uniform_random_trace(**args)


def test_a_bounded_recorder_keeps_the_last_tokens() -> None:
    rec = TraceRecorder([1, 2], 8, 2, max_tokens=8, keep_last=True)
    for t in range(20):
        rec.record(1, [t % 8, (t + 1) % 8])
        rec.record(2, [(t + 2) % 8, (t + 3) % 8])
    trace = rec.trace()
    assert len(rec) <= 8 and trace.n_tokens == len(rec)
    kept = trace.n_tokens
    first = 20 - kept
    assert rec.dropped_tokens == first and trace.metadata["dropped_tokens"] == str(first)
    for row, t in enumerate(range(first, 20)):  # the most recent tokens, in order
        assert trace.ids[row, 0].tolist() == [t % 8, (t + 1) % 8]
        assert trace.ids[row, 1].tolist() == [(t + 2) % 8, (t + 3) % 8]
    with pytest.raises(ConfigError, match="exceeds max_tokens"):
        TraceRecorder([1], 8, 2, max_tokens=4).record(1, np.zeros((5, 2), dtype=np.int64))
    with pytest.raises(ConfigError, match="keep_last needs"):
        TraceRecorder([1], 8, 2, keep_last=True)


def test_files_that_are_not_traces_get_a_plain_message(tmp_path: Path) -> None:
    for content in (b"GGUF\x03\x00\x00\x00" + bytes(64), b"hello, world\n", b""):
        path = tmp_path / "x.npz"
        path.write_bytes(content)
        with pytest.raises(FormatError, match="not a routing trace") as info:
            RoutingTrace.load(path)
        assert "pickle" not in str(info.value)


def test_save_expands_the_home_and_refuses_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = RoutingTrace(np.zeros((2, 1, 1), dtype=np.int16), (0,), (4,))
    monkeypatch.setenv("HOME", str(tmp_path))
    trace.save("~/t.npz")
    assert RoutingTrace.load(tmp_path / "t.npz") == trace
    with pytest.raises(IsADirectoryError, match="name one inside the directory"):
        trace.save(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_saved_trace_has_the_mode_of_a_new_file(tmp_path: Path, umask: int) -> None:
    """0666 & ~umask like any file the user creates (as a WEEPF001 map), not mkstemp's 0600."""
    import os

    trace = RoutingTrace(np.zeros((2, 1, 1), dtype=np.int16), (0,), (4,))
    old = os.umask(umask)
    try:
        trace.save(tmp_path / "t.npz")
    finally:
        os.umask(old)
    assert (tmp_path / "t.npz").stat().st_mode & 0o777 == 0o666 & ~umask


def test_save_into_a_missing_folder_names_the_users_path(tmp_path: Path) -> None:
    """Not the temporary ``.trace-*.npz.tmp`` written beside it (as ``write_miss_tier``)."""
    trace = RoutingTrace(np.zeros((2, 1, 1), dtype=np.int16), (0,), (4,))
    target = tmp_path / "no-such-dir" / "t.npz"
    with pytest.raises(FileNotFoundError) as info:
        trace.save(target)
    assert info.value.filename == str(target) and info.value.filename2 is None
    assert str(info.value) == f"[Errno 2] No such file or directory: '{target}'"
    assert not (tmp_path / "no-such-dir").exists()


# --- what a header may declare (issue 24) ------------------------------------------------------


def _tiny_trace_declaring(path: Path, n_experts: list[int]) -> Path:
    ids = np.zeros((2, len(n_experts), 1), np.int16)
    arrays = {**valid_arrays(), "ids": ids, "layers": np.arange(len(n_experts), dtype=np.int64)}
    arrays["n_experts"] = np.array(n_experts, dtype=np.int64)
    return write_npz(path, arrays)


@pytest.mark.parametrize(
    ("n_experts", "match"),
    [([2**31 - 1], r"n_experts of layer 0 is 2147483647, must be in \[1, 65536\]"), ([65536] * 17, "in all")],
)
def test_a_tiny_trace_cannot_declare_gigabytes_of_experts(tmp_path: Path, n_experts: list[int], match: str) -> None:
    path = _tiny_trace_declaring(tmp_path / "t.npz", n_experts)
    assert path.stat().st_size < 2000
    with pytest.raises(FormatError, match=match):
        RoutingTrace.load(path)


def test_the_trace_tool_answers_a_huge_declaration_in_one_line_within_bounded_memory(tmp_path: Path) -> None:
    """Before: a 1.3 KB trace made the tool allocate 16 GB and die with a MemoryError traceback.
    The tool runs under a 1 GiB address-space limit here: it must answer in one line, exit status 2."""
    path = _tiny_trace_declaring(tmp_path / "t.npz", [2**31 - 1])
    good = tmp_path / "good.npz"
    small_trace().save(good)
    limit = 1 << 30

    def run(trace: Path) -> subprocess.CompletedProcess[str]:
        code = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); " + (
            "import sys; from aioexperts.cli.tracetool import main; sys.exit(main(sys.argv[1:]))"
        )
        return subprocess.run(
            [sys.executable, "-c", code, "summary", str(trace), "--json"], capture_output=True, text=True, timeout=120
        )

    assert run(good).returncode == 0  # the limit leaves room for a real trace
    done = run(path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("aioexperts-trace: error:") and done.stderr.count("\n") == 1, done.stderr
    assert "65536" in done.stderr


def _npz_with_a_lying_npy_header(path: Path, shape: tuple[int, ...]) -> Path:
    """A valid trace whose ``ids.npy`` header declares ``shape`` but holds the bytes of two tokens."""
    arrays = valid_arrays()
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in arrays.items():
            buffer = io.BytesIO()
            if key == "ids":
                header = {"descr": "<i2", "fortran_order": False, "shape": shape}
                np.lib.format.write_array_header_1_0(buffer, header)
                buffer.write(np.ascontiguousarray(value).tobytes())
            else:
                np.lib.format.write_array(buffer, value, allow_pickle=False)
            archive.writestr(f"{key}.npy", buffer.getvalue())
    return path


def test_an_npy_header_cannot_make_the_loader_allocate_more_than_the_member_holds(tmp_path: Path) -> None:
    path = _npz_with_a_lying_npy_header(tmp_path / "t.npz", (2**40, 3, 2))
    assert path.stat().st_size < 4000
    with pytest.raises(FormatError, match=r"ids\.npy declares a \(1099511627776, 3, 2\) int16 array"):
        RoutingTrace.load(path)
    honest = _npz_with_a_lying_npy_header(tmp_path / "ok.npz", (2, 3, 2))
    assert RoutingTrace.load(honest) == small_trace()  # the same writer, telling the truth, is read


@pytest.mark.parametrize("max_tokens", [None, 8, 13])
def test_a_decode_rows_fast_record_equals_the_general_one(max_tokens: int | None) -> None:
    """One ``(1, k)`` row appended (the router's per-layer record, a fast path) leaves the trace the
    general path leaves: gaps, growth, a bounded ring's drops, a bad id refused with nothing written."""
    rng = np.random.default_rng(5)
    layers, k = [1, 3, 4], 2
    kw: dict[str, Any] = {"max_tokens": max_tokens, "keep_last": True} if max_tokens else {}
    fast, general = TraceRecorder(layers, 6, k, **kw), TraceRecorder(layers, 6, k, **kw)
    for _ in range(200):
        layer = layers[int(rng.integers(len(layers)))]
        ids = rng.integers(-1, 6, (1, k)).astype([np.int16, np.int32, np.int64][int(rng.integers(3))])
        fast.record(layer, ids)
        general.record(layer, ids.tolist())  # a list: the general path
        assert len(fast) == len(general) and fast.dropped_tokens == general.dropped_tokens
    np.testing.assert_array_equal(fast.trace().ids, general.trace().ids)
    before = fast.trace().ids
    for bad in (np.array([[0, 6]], np.int32), np.array([[-2, 0]], np.int64)):
        with pytest.raises(InvalidRequestError):
            fast.record(1, bad)
    np.testing.assert_array_equal(fast.trace().ids, before)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_array_subclasses_of_one_row_are_recorded_as_the_general_path_records_them() -> None:
    fast, general = TraceRecorder([0], 8, 2), TraceRecorder([0], 8, 2)
    fast.record(0, np.matrix([[1, 2]]))
    general.record(0, [1, 2])
    fast.record(0, np.ma.masked_array([[3, 4]], mask=[[False, True]]))
    general.record(0, np.asarray(np.ma.masked_array([[3, 4]], mask=[[False, True]])))
    np.testing.assert_array_equal(fast.trace().ids, general.trace().ids)
