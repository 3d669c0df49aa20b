"""The bench's parts on their own: statistics, the read list, fio's iolog, the recorder, rendering."""

from __future__ import annotations

import math
import os
from pathlib import Path

import anyio
import numpy as np
import pytest

from aioexperts.testing import SyntheticSpec, write_synthetic_model
from aioexperts_bench import ReadList, drop_page_cache, make_steps, probe_host_cache, rotated, spread
from aioexperts_bench import store_adapter as ea
from aioexperts_bench.read_replay import Destination, replay_mmap, replay_pread

SMALL = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parts") / "m.gguf"
    write_synthetic_model(path, SMALL)
    return path


def test_spread_is_median_min_max_and_skips_nan() -> None:
    s = spread([3.0, 1.0, 2.0, math.nan, None])
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert spread([1.0, 2.0, 3.0, 4.0]).median == 2.5
    assert spread([]).n == 0 and spread([]).fmt() == "-"
    assert s.fmt(".1f") == "2.0 (1.0-3.0)"


def test_rotated_order() -> None:
    items = ["a", "b", "c"]
    assert [rotated(items, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_read_list_iolog_and_sizes(tmp_path: Path) -> None:
    f = tmp_path / "data"
    f.write_bytes(b"\0" * 20000)
    rl = ReadList.from_rows([str(f)], [(0, 8192, 8192), (0, 0, 4096), (0, 16384, 8192)])
    assert rl.total_bytes == 20480 and rl.expected_bytes() == 8192 + 4096 + (20000 - 16384)
    assert rl.destinations().tolist() == [0, 8192, 12288]
    log = tmp_path / "log"
    rl.write_fio_iolog(log)
    lines = log.read_text().splitlines()
    assert lines[:3] == ["fio version 2 iolog", f"{f} add", f"{f} open"]
    assert lines[3:] == [f"{f} read 8192 8192", f"{f} read 0 4096", f"{f} read 16384 8192"]
    cut = rl.resized(4096)
    assert len(cut) == 5 and cut.total_bytes == rl.total_bytes
    assert rl.same_reads(ReadList(rl.paths, rl.reads[::-1].copy()))
    assert not rl.same_reads(cut)
    with pytest.raises(ValueError, match="whitespace"):
        ReadList.from_rows(["a b"], [(0, 0, 4096)]).write_fio_iolog(log)


@pytest.mark.io_uring
def test_recorder_sees_exactly_the_store_reads_and_replays_read_the_same_bytes(model: Path) -> None:
    info = ea.model_info(str(model))
    steps = make_steps(info, 4, seed=1)
    recorder = ea.ReadRecorder(info.shard_paths, "io_uring", timestamps=True)

    async def run() -> dict[str, object]:
        options = ea.BenchOptions(slots=info.n_experts_total, backend=recorder, queue_depth=8)
        async with ea.open_bench_store(str(model), options) as store:
            await ea.cold_pass(store, steps, window=2)
            return ea.store_stats(store)

    stats = anyio.run(run)
    reads = recorder.read_list()
    assert len(reads) == stats["reads"] == 3 * info.n_experts_total
    assert reads.expected_bytes() == stats["bytes_read"]
    assert all(end >= start for start, end in recorder.times)
    assert {info.layer_of(s, o + n // 2) for s, o, n in reads.reads.tolist()} == set(info.layers)
    with open(model, "rb") as f:
        data = f.read()
    pieces = [
        (w, data[o : o + n]) for w, (_, o, n) in zip(reads.destinations().tolist(), reads.reads.tolist(), strict=True)
    ]

    def landed(dest: Destination) -> bool:
        return all(dest.array[w : w + len(p)].tobytes() == p for w, p in pieces)

    drop_page_cache(reads.paths)
    for direct in (True, False):
        with Destination(reads.total_bytes) as dest:
            r = replay_pread(reads, dest, direct=direct, n_threads=3)
            ok = landed(dest)
        assert ok and r.bytes_read == reads.expected_bytes() and r.n_reads == len(reads)
    with Destination(reads.total_bytes) as dest:
        r = replay_mmap(reads, dest)
        ok = landed(dest)
    assert ok and r.bytes_read == reads.expected_bytes()


def test_host_cache_probe_reports_rates(model: Path) -> None:
    probe = probe_host_cache(str(model), n_bytes=1 << 20)
    assert probe.model_first > 0 and probe.model_again > 0
    assert probe.reread_speedup == pytest.approx(probe.model_again / probe.model_first)
    assert probe.likely_host_cache == bool(probe.caveat)
    assert not [p for p in os.listdir(model.parent) if p.startswith(".aioexperts-probe-")]


def test_fio_replay_counts_every_read(model: Path) -> None:
    from aioexperts_bench import fio_path, run_fio_replay

    if fio_path() is None:
        pytest.skip("fio is not installed")
    info = ea.model_info(str(model))
    rows = [(s, o - o % 4096, -(-(o % 4096 + n) // 4096) * 4096) for s, o, n, _ in info.segments]
    reads = ReadList.from_rows(info.shard_paths, rows * 8)
    r = run_fio_replay(reads, depth=16)
    assert r.n_reads == len(reads) and r.bytes_read == reads.expected_bytes()


@pytest.mark.parametrize(
    ("script", "needle"),
    [
        ("echo 'fio: engine io_uring not loadable' >&2; exit 3", "fio exited with status 3: fio: engine io_uring not"),
        ("echo 'not json'", "fio printed no JSON report"),
        ('echo \'{"jobs": [{"error": 5, "read": {}}]}\'', "fio reported error 5 in its job"),
    ],
)
def test_a_failing_fio_raises_one_line(
    script: str, needle: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioexperts_bench import fio

    fake = tmp_path / "fio"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(fio, "fio_path", lambda: str(fake))
    info = ea.model_info(str(model))
    reads = ReadList.from_rows(info.shard_paths, [(0, 0, 4096)])
    with pytest.raises(fio.FioError) as raised:
        fio.run_fio_replay(reads, depth=4, workdir=str(tmp_path))
    assert needle in str(raised.value) and "\n" not in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == ["fio"]  # the iolog is removed


def test_render_replaces_marked_regions_only(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("render", Path(__file__).parents[2] / "bench" / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    results = {
        "schema": 1,
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"cpu_count": 2, "cpu_model": "X", "memory_bytes": 1 << 30, "kernel": "6", "filesystem": "ext4"},
        "model": {"name": "m.gguf", "bytes": 1, "experts": 2},
        "loops": {"uvloop": {"yield_us": 1.5, "task_event_us": 20.0}},
        "targets": [{"what": "warm hit", "direction": "<=", "limit": 20.0, "value": None, "met": None}],
    }
    text = "keep\n<!-- bench:loops -->\nold\n<!-- /bench:loops -->\nkeep too\n"
    new, names = render.render_file(text, results, "r.json")
    assert names == ["loops"] and new.startswith("keep\n") and new.endswith("keep too\n")
    assert "| uvloop | 1.50 | 20.0 |" in new and "old" not in new
    path = tmp_path / "doc.md"
    path.write_text("<!-- bench:targets -->\n<!-- /bench:targets -->\n")
    results_path = tmp_path / "r.json"
    import json

    results_path.write_text(json.dumps(results))
    assert render.main([str(results_path), "--write", str(path)]) == 0
    assert "not measured" in path.read_text()


def test_the_docs_tables_are_rendered_from_the_committed_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``<!-- bench:NAME -->`` region of README.md and docs/ is what render.py makes of the file it names.

    Fails when a region was typed or edited by hand, left empty, or not rendered again after its
    results file changed (run ``bench/render.py RESULTS --write README.md docs/*.md --extra``).
    """
    import importlib.util
    import re

    from aioexperts_bench import load_results

    repo = Path(__file__).parents[2]
    monkeypatch.chdir(repo)  # the satellite benches' results files are named relative to the repository
    spec = importlib.util.spec_from_file_location("render", repo / "bench" / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    extra_files = {path for path, _ in render.EXTRA.values()}
    rendered = []
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        text = doc.read_text()
        main = set(re.findall(r"rendered by bench/render.py from (\S+);", text)) - extra_files
        assert len(main) <= 1, (doc, main)
        source = main.pop() if main else ""
        new, names = render.render_file(text, load_results(source) if source else {}, source, extra=True)
        assert new == text, f"{doc.name}: a region differs from its rendering"
        rendered += names
    assert set(render.EXTRA) <= set(rendered)  # every satellite bench has its table in the docs


def test_destination_is_prefaulted_and_closes() -> None:
    with Destination(10_000) as dest:
        assert dest.n_bytes % 4096 == 0 and dest.n_bytes >= 10_000
        assert np.all(dest.array[::4096] == 0)


_BENCH = Path(__file__).parents[2] / "bench"


@pytest.mark.parametrize(
    "script", sorted(p.name for p in _BENCH.glob("*.py") if "__main__" in p.read_text(encoding="utf-8"))
)
def test_every_bench_script_imports_and_answers_help(script: str) -> None:
    """A bench script that no longer imports is found here, not at the end of a long quiet run.

    It runs against this checkout's ``aioexperts`` and ``aioexperts_bench`` (first on its path), not an
    installed copy elsewhere.
    """
    import os
    import subprocess
    import sys

    repo = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    path = repo / "bench" / script
    done = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_a_results_file_of_before_the_store_rename_reads_under_the_new_names(tmp_path: Path) -> None:
    """Files written when the bench called its own store "engine" keep rendering (docs/results/)."""
    import json

    from aioexperts_bench import SCHEMA, load_results

    old = {"schema": SCHEMA, "reads": {"warm": {"engine": {"x": 1}}, "parameters": {"engine_slots": 7}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    reads = load_results(path)["reads"]
    assert reads["warm"] == {"store": {"x": 1}} and reads["parameters"] == {"store_slots": 7}


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        (["avx", "avx2", "fma"], "AVX2"),
        (["avx2", "avx512f", "avx512bw"], "AVX-512"),
        (["avx2", "avx512f", "avx512bw", "avx512_vnni"], "AVX-512 VNNI"),
        (["avx2", "avx_vnni"], "AVX2"),
        (["sse4_2"], None),
    ],
)
def test_cpu_vector_isa_names_the_widest_isa(flags: list[str], isa: str | None) -> None:
    from aioexperts_bench.machine import cpu_vector_isa

    assert cpu_vector_isa(flags) == isa


def test_machine_label_names_the_vector_isa_when_recorded() -> None:
    from aioexperts_bench import machine_label

    facts = {"cpu_count": 2, "cpu_model": "AMD EPYC", "memory_bytes": 24 << 30, "filesystem": "ext4", "kernel": "6.18"}
    assert "AMD EPYC, 24 GiB" in machine_label(facts)
    assert "AMD EPYC (AVX-512 VNNI), 24 GiB" in machine_label({**facts, "cpu_vector_isa": "AVX-512 VNNI"})
    limited = {**facts, "cpu_vector_isa": "AVX-512 VNNI", "isa_limits": {"kernels": "AVX2", "llama.cpp": None}}
    assert "AMD EPYC (AVX-512 VNNI; kernels limited to AVX2), 24 GiB" in machine_label(limited)


AVX2_ONLY_LLAMA = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 | REPACK = 1 |"
AVX512_LLAMA = "CPU : AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 |"


@pytest.mark.parametrize(
    ("numba_features", "llama_info", "cpu", "expected"),
    [
        (None, None, "AVX-512 VNNI", {"kernels": None, "llama.cpp": None}),
        (
            "+avx2,+fma,-avx512f,-avx512bw,-avx512vnni",
            AVX2_ONLY_LLAMA,
            "AVX-512 VNNI",
            {"kernels": "AVX2", "llama.cpp": "AVX2"},
        ),
        ("+avx2,+avx512f,+avx512bw,+avx512vnni", AVX512_LLAMA, "AVX-512 VNNI", {"kernels": None, "llama.cpp": None}),
        (
            "+avx2,+avx512f,+avx512bw,-avx512vnni",
            AVX512_LLAMA,
            "AVX-512 VNNI",
            {"kernels": "AVX-512", "llama.cpp": None},
        ),
        (None, AVX2_ONLY_LLAMA, "AVX2", {"kernels": None, "llama.cpp": None}),
    ],
)
def test_isa_limits_say_what_each_engine_was_held_to(
    numba_features: str | None,
    llama_info: str | None,
    cpu: str,
    expected: dict[str, str | None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An AVX2 run on an AVX-512 CPU (NUMBA_CPU_FEATURES and an AVX2 build of llama.cpp) is named
    as such in the results, so it never passes for the CPU's own ISA."""
    from aioexperts_bench import machine

    monkeypatch.setattr(
        machine,
        "cpu_vector_isa",
        lambda flags=None, _real=machine.cpu_vector_isa: _real(flags) if flags is not None else cpu,
    )
    if numba_features is None:
        monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    else:
        monkeypatch.setenv("NUMBA_CPU_FEATURES", numba_features)
    assert machine.isa_limits(llama_info) == expected


@pytest.mark.parametrize("script", ["render.py", "generate.py"])
def test_render_scripts_refuse_a_bad_results_file_or_doc_in_one_line(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README.md's ``bench/generate.py --render`` and docs/bench.md's ``bench/render.py`` (``make
    render RESULTS=...``) name a results file the user types: a missing, binary, non-JSON or foreign
    one (or a missing doc) is one ``PROG: error: ...`` line and status 2, never a traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script[:-3], Path(__file__).parents[2] / "bench" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\xff\xfe")
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    doc = tmp_path / "doc.md"
    doc.write_text("no region\n")
    for name in ("missing.json", "garbage.gguf", "text.json", "list.json", "other.json"):
        path = str(tmp_path / name)
        argv = [path] if script == "render.py" else ["--render", path, "--", str(doc)]
        assert module.main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.endswith("\n") and err.count("\n") == 1 and f": error: {path}" in err, err  # PROG: error: ...
    # a good results file, a missing doc
    results = Path(__file__).parents[2] / "docs" / "results"
    good = results / ("2026-11-30-vm-2vcpu-epyc.json" if script == "render.py" else "generate-dsv4-4l-none.json")
    missing = str(tmp_path / "missing.md")
    argv = [str(good), "--write", missing] if script == "render.py" else ["--render", str(good), "--", missing]
    assert module.main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith(f": error: {missing}: No such file or directory\n") and err.count("\n") == 1, err
