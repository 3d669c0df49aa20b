"""``aioexperts-bench --mode generate``: a smoke run on a small model (no baseline, no cgroup), and its arithmetic."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from aioexperts.cli import bench
from aioexperts_bench import generate, load_generate_results, render_into, text_report
from aioexperts_bench.generate import (
    _from_events,
    _round_summary,
    _run_line,
    evaluate_targets,
    parse_limit,
    summarize,
    token_ids,
)


def test_generate_smoke_run_writes_results_and_a_report(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gen.json"
    code = bench.main(
        [
            "--mode",
            "generate",
            "--model",
            str(tiny_full_model),
            "--engines",
            "aioexperts",
            "--limits",
            "none",
            "--rounds",
            "1",
            "--prompt-tokens",
            "6",
            "--decode-tokens",
            "3",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    results = load_generate_results(out)
    (run,) = results["runs"]
    assert run["status"] == "ok" and run["engine"] == "aioexperts" and run["tokens_decoded"] == 3
    assert len(run["greedy"]) == 4 and len(run["token_seconds"]) == 3
    assert run["decode_tok_s"] > 0 and run["prefill_tok_s"] > 0 and 0 <= run["hit_rate"] <= 1
    assert run["cold_prefill_tok_s"] > 0  # no limit: warmed by one prefill first, reported apart
    assert run["slab_budget"].startswith("slab ") and run["slab_bytes"] > 0
    assert len(run["distinct_experts_per_layer"]) == 2 and all(1 <= d <= 4 for d in run["distinct_experts_per_layer"])
    # issue 36's figures per decode token: every expert of the 3 decode tokens has one source
    sources = ("cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses")
    per_token = sum(run[f"{k}_per_token"] for k in sources)
    assert per_token == run["requests_per_token"] > 0
    assert run["stall_ms_per_token"] >= 0 and run["low_tier_misses_per_token"] == 0
    printed = capsys.readouterr().out
    assert "| none | aioexperts | 1x ok |" in printed
    assert "| stall ms/token | cached |" in printed
    assert results["targets"][-1]["what"] == "slab chosen automatically"


def test_generate_smoke_run_with_the_miss_tier(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aioexperts import write_miss_tier

    sidecar = write_miss_tier(tiny_full_model, tmp_path / "tier.gguf", "Q2_K")
    out = tmp_path / "gen-tier.json"
    args = ["--mode", "generate", "--model", str(tiny_full_model), "--engines", "aioexperts", "--limits", "none"]
    args += ["--rounds", "1", "--prompt-tokens", "6", "--decode-tokens", "3", "--out", str(out), "--quiet"]
    assert bench.main([*args, "--miss-tier", str(sidecar)]) == 0
    results = load_generate_results(out)
    runs = {r["engine"]: r for r in results["runs"]}
    assert set(runs) == {"aioexperts", "aioexperts-tier"} and runs["aioexperts-tier"]["status"] == "ok"
    assert runs["aioexperts"]["low_tier_misses_per_token"] == 0
    tier = runs["aioexperts-tier"]
    sources = ("cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses")
    assert sum(tier[f"{k}_per_token"] for k in sources) == tier["requests_per_token"]
    (rnd,) = results["rounds"]
    assert rnd["tier_agreement"]["compared"] == 4 and rnd["tier_decode_ratio"] > 0
    printed = capsys.readouterr().out
    assert "| none | aioexperts-tier | 1x ok |" in printed and "the miss tier (aioexperts-tier)" in printed


def test_generate_chooses_the_miss_tier_type_beside_the_model(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from aioexperts import build_layout, open_model
    from aioexperts._format.tier_sidecar import read_tier_sidecar

    model = tmp_path / "tiny.gguf"  # the sidecar is written beside the model: a copy of our own
    shutil.copyfile(tiny_full_model, model)
    out = tmp_path / "gen-q2k.json"
    args = ["--mode", "generate", "--model", str(model), "--engines", "aioexperts-tier", "--limits", "none"]
    args += ["--rounds", "1", "--prompt-tokens", "6", "--decode-tokens", "2", "--out", str(out), "--quiet"]
    assert bench.main([*args, "--miss-tier-type", "Q2_K", "--miss-tier-behind", "0"]) == 0
    written = tmp_path / "tiny.miss-tier-Q2_K.gguf"
    gguf = open_model(model)
    assert read_tier_sidecar(written, gguf, build_layout(gguf)).ggml_type.name == "Q2_K"
    results = load_generate_results(out)
    assert results["parameters"]["miss_tier"] == {
        "path": str(written),
        "max_gate_weight": None,
        "behind_seconds": 0.0,
        "upgrade": False,
        "prefetches": True,
    }
    (run,) = results["runs"]
    assert run["status"] == "ok" and run["engine"] == "aioexperts-tier"
    sources = ("cached_hits", "prefetched_in_time", "prefetched_late", "demand_misses")
    assert sum(run[f"{k}_per_token"] for k in sources) == run["requests_per_token"]
    assert "low_tier_prefetch_hits_per_token" in run and "tier_upgrades_deferred_per_token" in run
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        bench.main([*args, "--miss-tier-type", "Q2_K", "--miss-tier", str(written)])
    assert info.value.code == 2 and "with --miss-tier give only the file" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--mode", "generate", "--limits", "1/0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        bench.main(["--mode", "generate", "--engines", "vllm"])
    assert "vllm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--limits", "abc"], "a fraction like 1/4"),
        (["--limits", "1/0"], "a fraction like 1/4"),
        (["--limits", "1/2,1/2"], "each limit once"),
        (["--run-timeout", "-1"], "--run-timeout must be > 0"),
        (["--decode-tokens", "0"], "--decode-tokens must be >= 1, got 0"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--n-ctx", "1"], "--n-ctx 1 is less than --prompt-tokens + --decode-tokens (256 + 16 = 272)"),
    ],
)
def test_each_bad_argument_is_named(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--mode", "generate", *args])
    assert info.value.code == 2
    assert said in capsys.readouterr().err


def test_limits_and_token_ids() -> None:
    assert parse_limit("none") is None and parse_limit("1/4") == Fraction(1, 4)
    with pytest.raises(ValueError, match="fraction of the model"):
        parse_limit("0")
    ids = token_ids(4099, 64, 0)
    assert ids == token_ids(4099, 64, 0) and all(256 <= i < 4096 for i in ids) and len(set(ids)) > 50


def _events(lat: list[float], faults: list[int]) -> list[dict[str, object]]:
    base = {"t": 0.0, "peak_rss_bytes": 1000, "device_read_bytes": 0}
    ev: list[dict[str, object]] = [
        {**base, "phase": "loaded", "seconds": 1.0, "major_faults": 0},
        {**base, "phase": "prefill", "seconds": 2.0, "greedy": 7, "major_faults": 5},
    ]
    for i, (s, f) in enumerate(zip(lat, faults, strict=True)):
        ev.append({**base, "phase": "token", "index": i, "seconds": s, "greedy": i, "major_faults": f})
    return ev


def test_figures_from_events_and_ratios_per_round() -> None:
    ours = {"engine": "aioexperts", "status": "ok", **_from_events(_events([0.5, 0.5], [5, 5]), 256)}
    slow = {"engine": "llama.cpp-norepack", "status": "ok", **_from_events(_events([5.0, 15.0], [105, 305]), 256)}
    killed = {"engine": "llama.cpp", "status": "oom-killed", **_from_events(_events([], [])[:1], 256)}
    assert ours["decode_tok_s"] == pytest.approx(2.0) and ours["prefill_tok_s"] == pytest.approx(128.0)
    assert slow["decode_tok_s"] == pytest.approx(0.1) and slow["major_faults_per_token"] == pytest.approx(150.0)
    rnd = _round_summary([ours, killed, slow])
    assert rnd["baseline"] == "llama.cpp-norepack" and rnd["decode_ratio"] == pytest.approx(20.0)
    assert rnd["p95_ratio"] == pytest.approx(500 / 14500)
    assert rnd["agreement"]["llama.cpp-norepack"] == {"agree": 3, "compared": 3}
    assert rnd["llama_statuses"] == {"llama.cpp": "oom-killed", "llama.cpp-norepack": "ok"}
    results = {
        "runs": [{**r, "limit": "1/4", "round": 0, "page_cache_bytes": 0} for r in (ours, killed, slow)],
        "rounds": [{"limit": "1/4", "round": 0, **rnd}, {"limit": "1/4", "round": 1, **rnd, "decode_ratio": 9.0}],
    }
    targets = {(t["limit"], t["what"]): t for t in evaluate_targets(results)}
    assert targets["1/4", "decode"]["verdict"] == "MISSED" and targets["1/4", "decode"]["per_round"] == [20.0, 9.0]
    assert targets["1/4", "p95"]["verdict"] == "met"
    rows = summarize(results)
    assert [r["engine"] for r in rows] == ["aioexperts", "llama.cpp", "llama.cpp-norepack"]
    assert rows[1]["statuses"] == ["oom-killed"] and rows[1]["decode_tok_s"] is None


def test_the_half_limit_takes_the_lower_bar_where_llama_cpp_fits() -> None:
    rounds = [{"limit": "1/2", "round": i, "decode_ratio": 0.8, "baseline_faults_per_token": 1.0} for i in range(3)]
    (target, pipeline) = evaluate_targets({"runs": [], "rounds": rounds})
    assert target["threshold"] == 0.7 and target["verdict"] == "met" and target["llama_fits"]
    assert pipeline["what"] == "pipeline" and pipeline["verdict"] == "unmeasured"
    rounds[0]["baseline_faults_per_token"] = 500.0
    (target, _) = evaluate_targets({"runs": [], "rounds": rounds})
    assert target["threshold"] == 2.0 and target["verdict"] == "MISSED"


def test_render_replaces_only_the_region(tmp_path: Path, tiny_full_model: Path) -> None:
    results = {
        "schema": generate.SCHEMA,
        "command": "aioexperts-bench --mode generate",
        "date": "2026-12-02T00:00:00+00:00",
        "machine": {"cpu_count": 2, "kernel": "6.18", "load_average_at_start": [1.0, 1.0, 1.0]},
        "model": {"name": "m.gguf", "bytes": 17e9},
        "parameters": {"rounds": 3, "prompt_tokens": 256, "decode_tokens": 16, "threads": 2},
        "runs": [],
        "rounds": [],
        "summary": [],
        "targets": [],
        "notes": ["llama-cpp-python is not installed"],
    }
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- bench:generate-headline -->\nSTALE REGION\n<!-- /bench:generate-headline -->\nafter\n")
    assert render_into(doc, [results], ["r.json"])
    text = doc.read_text()
    assert text.startswith("before\n<!-- bench:generate-headline -->\n<!-- rendered by bench/generate.py")
    assert "From `r.json`" in text and text.endswith("<!-- /bench:generate-headline -->\nafter\n")
    assert "STALE REGION" not in text and "llama-cpp-python is not installed" in text
    assert text_report(results) in text
    (tmp_path / "other.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(ValueError, match="not a results file"):
        load_generate_results(tmp_path / "other.json")


def test_results_of_two_cpus_render_apart() -> None:
    """One model measured on an AMD EPYC and on an Intel Xeon: two sections, each with its own targets."""
    from aioexperts_bench.generate_report import render_markdown

    def part(cpu: str, ours: float, isa: str | None = None) -> dict[str, object]:
        runs = [
            {"engine": e, "limit": "none", "round": 0, "status": "ok", "decode_tok_s": v, "p95_ms": 1.0}
            for e, v in (("aioexperts", ours), ("llama.cpp", 1.0))
        ]
        return {
            "schema": generate.SCHEMA,
            "command": "c",
            "date": "d",
            "machine": {
                "cpu_model": cpu,
                "cpu_vector_isa": isa,
                "load_average_at_start": [1.0],
                "load_average_at_end": [2.0],
            },
            "parameters": {"rounds": 1, "prompt_tokens": 8, "decode_tokens": 4, "threads": 2},
            "model": {"name": "m.gguf", "bytes": 1},
            "notes": [],
            "runs": runs,
            "rounds": [],
        }

    text = render_markdown([part("AMD EPYC", 0.5), part("Intel Xeon", 1.2)], ["amd.json", "xeon.json"])
    assert "From `amd.json`:" in text and "From `xeon.json`:" in text
    assert "per round 0.5: **MISSED**" in text and "per round 1.2: **met**" in text
    # the same model name of CPU with and without AVX-512 (older files record no ISA): two sections
    text = render_markdown([part("AMD EPYC", 0.5), part("AMD EPYC", 1.2, "AVX-512 VNNI")], ["zen2.json", "zen4.json"])
    assert "From `zen2.json`:" in text and "From `zen4.json`:" in text


def test_results_of_one_model_merge_with_rounds_numbered_on() -> None:
    from aioexperts_bench.generate_report import merge_results

    def part(limits: list[str], ratio: float) -> dict[str, object]:
        return {
            "schema": generate.SCHEMA,
            "command": "c",
            "date": "d",
            "machine": {"load_average_at_start": [1.0], "load_average_at_end": [2.0]},
            "model": {"name": "m.gguf", "bytes": 1},
            "notes": [],
            "runs": [
                run
                for lim in limits
                for run in (
                    {
                        "engine": "aioexperts",
                        "limit": lim,
                        "round": 0,
                        "status": "ok",
                        "decode_tok_s": ratio,
                        "p95_ms": 1.0,
                    },
                    {
                        "engine": "llama.cpp",
                        "limit": lim,
                        "round": 0,
                        "status": "ok",
                        "decode_tok_s": 1.0,
                        "p95_ms": 20.0,
                    },
                )
            ],
            "rounds": [],  # computed again from the runs
        }

    merged = merge_results([part(["1/4", "none"], 12.0), part(["1/4"], 8.0)])
    assert [(r["limit"], r["round"]) for r in merged["rounds"]] == [("1/4", 0), ("none", 0), ("1/4", 1)]
    decode = next(t for t in merged["targets"] if (t["limit"], t["what"]) == ("1/4", "decode"))
    assert decode["per_round"] == [12.0, 8.0] and decode["verdict"] == "MISSED"
    # a part's own fio rate and pipeline ratio stay with its round; a shorter prompt's no-limit runs
    # stay out of the no-limit row (it compares the longest prompt's)
    long, short = part(["none"], 0.5), part(["1/4", "none"], 20.0)
    long["parameters"], short["parameters"] = {"prompt_tokens": 256}, {"prompt_tokens": 16}
    short["rounds"] = [{"limit": "1/4", "round": 0, "fio": {"gb_s": 2.5}, "pipeline_ratio": 1.1}]
    merged = merge_results([long, short])
    assert [(r["limit"], r["round"]) for r in merged["rounds"]] == [("none", 0), ("1/4", 0)]
    assert merged["rounds"][1]["pipeline_ratio"] == 1.1 and merged["rounds"][1]["fio"] == {"gb_s": 2.5}
    none = next(t for t in merged["targets"] if (t["limit"], t["what"]) == ("none", "decode"))
    assert none["per_round"] == [0.5] and any("16-token prompt" in n for n in merged["notes"])


def test_a_merged_header_names_each_files_parameters_and_commit() -> None:
    from aioexperts_bench.generate_report import _parameters, merge_results

    def part(limits: list[str], prompt: int, commit: str) -> dict[str, object]:
        return {
            "date": f"d{prompt}",
            "command": "c",
            "machine": {"aioexperts_commit": commit, "llama_cpp_python": "0.3.36"},
            "parameters": {"limits": limits, "rounds": 3, "prompt_tokens": prompt, "decode_tokens": 8, "threads": 2},
            "runs": [{"engine": "aioexperts", "limit": limits[0], "round": 0, "status": "ok", "decode_tok_s": 1.0}],
        }

    merged = merge_results([part(["1/4", "1/2"], 16, "a" * 40), part(["none"], 256, "b" * 40 + "+dirty")])
    phrase, lines = _parameters(merged)
    assert phrase == "2 threads; llama-cpp-python 0.3.36"
    assert "limits 1/4, 1/2: 3 rounds, prompt 16 tokens" in lines[0] and "aioexperts aaaaaaaaaa;" in lines[0]
    assert "limits none: 3 rounds, prompt 256 tokens" in lines[1] and "bbbbbbbbbb+dirty" in lines[1]
    alone, none = _parameters(part(["1/4"], 16, "c" * 40))
    assert alone.startswith("3 rounds, prompt 16 tokens") and "aioexperts cccccccccc" in alone and none == []


def test_without_llama_cpp_the_bench_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate.importlib.util, "find_spec", lambda name: None)
    reason = generate.llama_unavailable_reason()
    assert reason is not None and "\n" not in reason and "aioexperts[baseline]" in reason and "7 minutes" in reason


def test_llama_cpp_killed_in_every_round_is_said_so() -> None:
    runs = [
        {"engine": "aioexperts", "limit": "1/4", "round": 0, "status": "ok", "decode_tok_s": 0.3},
        {"engine": "llama.cpp", "limit": "1/4", "round": 0, "status": "oom-killed"},
        {"engine": "llama.cpp-norepack", "limit": "1/4", "round": 0, "status": "oom-killed"},
    ]
    rnd = _round_summary(runs)
    assert rnd["baseline_failed"] and "decode_ratio" not in rnd
    targets = evaluate_targets({"runs": runs, "rounds": [{"limit": "1/4", "round": 0, **rnd}]})
    assert all(t["verdict"].startswith("met: llama.cpp produced no token") for t in targets if t["limit"] == "1/4")
    runs[0]["decode_tok_s"] = None  # aioexperts failing too is no win
    targets = evaluate_targets({"runs": runs, "rounds": [{"limit": "1/4", "round": 0, **rnd}]})
    assert all(t["verdict"] == "unmeasured" for t in targets if t["limit"] == "1/4")


def test_llama_cpp_failing_otherwise_is_no_win() -> None:
    """A crash (an assert of ggml's) says nothing about memory: the target stays unmeasured."""
    runs = [
        {"engine": "aioexperts", "limit": "none", "round": 0, "status": "ok", "decode_tok_s": 3.0},
        {"engine": "llama.cpp", "limit": "none", "round": 0, "status": "failed"},
        {"engine": "llama.cpp-norepack", "limit": "none", "round": 0, "status": "oom-killed"},
    ]
    rnd = _round_summary(runs)
    assert rnd["baseline_failed"]
    targets = evaluate_targets({"runs": runs, "rounds": [{"limit": "none", "round": 0, **rnd}]})
    verdicts = [t["verdict"] for t in targets if t["limit"] == "none"]
    assert verdicts and all(v == "unmeasured: llama.cpp produced no token (failed, oom-killed)" for v in verdicts)


def test_a_stopped_benchs_unfinished_round_is_left_out() -> None:
    from aioexperts_bench.generate_report import merge_results

    def run(limit: str, rnd: int, engine: str) -> dict[str, object]:
        return {"engine": engine, "limit": limit, "round": rnd, "status": "ok", "decode_tok_s": 1.0, "p95_ms": 1.0}

    part = {
        "schema": generate.SCHEMA,
        "command": "c",
        "date": "d",
        "machine": {},
        "model": {"name": "m.gguf", "bytes": 1},
        "parameters": {"engines": ["aioexperts", "llama.cpp"]},
        "complete": False,
        "runs": [run("1/2", 0, "aioexperts"), run("1/2", 0, "llama.cpp"), run("none", 0, "aioexperts")],
    }
    merged = merge_results([part])
    assert [(r["limit"], r["engine"]) for r in merged["runs"]] == [("1/2", "aioexperts"), ("1/2", "llama.cpp")]
    assert not merged["complete"]


def test_no_completed_aioexperts_run_exits_1(
    tiny_full_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--mode", "generate", "--model", str(tiny_full_model), "--engines", "aioexperts", "--limits", "none"]
    args += ["--rounds", "1", "--prompt-tokens", "2", "--decode-tokens", "1", "--run-timeout", "0.01", "--quiet"]
    code = bench.main([*args, "--out", str(tmp_path / "gen.json")])
    assert code == 1
    assert "no aioexperts run completed" in capsys.readouterr().err


def test_building_the_built_in_model_is_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The note callback hears about a build and a wait (it was accepted and never called)."""
    import argparse

    from aioexperts import testing as full_model
    from aioexperts.cli import bench_generate

    def fake_ensure(*, spec, progress, on_build, on_wait):  # type: ignore[no-untyped-def]
        on_wait()
        on_build(Path("/cache/m.gguf"))
        return Path("/cache/m.gguf")

    monkeypatch.setattr(full_model, "ensure_full_model", fake_ensure)
    heard: list[str] = []
    args = argparse.Namespace(model=None, routing="spread", layers=48, quiet=True)
    assert bench_generate._model(args, heard.append) == "/cache/m.gguf"
    assert heard == [
        "another run is writing the built-in model; waiting for it",
        "writing the built-in full model (48 layers) to /cache/m.gguf (once)",
    ]


def test_pipeline_ratio_is_decode_over_the_larger_of_io_at_fios_rate_and_resident_compute() -> None:
    def run(limit: str, rnd: int, tok_s: float, engine: str = "aioexperts", per_token: float = 0.0) -> dict[str, Any]:
        return {
            "engine": engine,
            "limit": limit,
            "round": rnd,
            "decode_tok_s": tok_s,
            **{"expert_bytes_per_token": per_token},
        }

    results: dict[str, Any] = {
        "runs": [
            run("none", 0, 4.0),  # compute: 0.25 s a token with every expert resident
            run("1/4", 0, 2.0, per_token=0.9e9),  # 0.5 s against I/O 0.9 GB / 2 GB/s = 0.45 s
            run("1/4", 0, 2.5, "aioexperts-tier", per_token=0.6e9),  # 0.4 s against max(0.3, 0.25)
            run("1/2", 0, 3.0, per_token=0.2e9),  # 0.333 s against compute 0.25 (I/O 0.1)
        ],
        "rounds": [
            {"limit": "none", "round": 0},
            {"limit": "1/4", "round": 0, "fio": {"gb_s": 2.0}},
            {"limit": "1/2", "round": 0, "fio": {"gb_s": 2.0}},
        ],
    }
    generate.add_pipeline_ratios(results)
    quarter, half = results["rounds"][1], results["rounds"][2]
    assert quarter["pipeline_ratio"] == pytest.approx(0.5 / 0.45)
    assert quarter["tier_pipeline_ratio"] == pytest.approx(0.4 / 0.3)
    assert half["pipeline_ratio"] == pytest.approx((1 / 3) / 0.25)
    assert "pipeline_ratio" not in results["rounds"][0]
    targets = {(t["limit"], t["what"]): t for t in evaluate_targets(results)}
    assert targets["1/4", "pipeline"]["verdict"] == "met" and targets["1/2", "pipeline"]["verdict"] == "MISSED"
    results["rounds"][1]["fio"] = {"error": "fio is not installed"}
    del results["rounds"][1]["pipeline_ratio"]
    generate.add_pipeline_ratios(results)
    assert "pipeline_ratio" not in results["rounds"][1]


def test_fio_reads_random_experts_once_each_planned_like_the_store(tiny_full_model: Path) -> None:
    from aioexperts import build_layout, open_model
    from aioexperts_bench.readlist import expert_read_list

    gguf = open_model(str(tiny_full_model))
    layout = build_layout(gguf)
    reads = expert_read_list(gguf, layout, 1, seed=3)
    one = reads.reads
    assert len(one) >= 1 and (one[:, 1] % 4096 == 0).all() and (one[:, 2] % 4096 == 0).all()
    every = expert_read_list(gguf, layout, 1 << 40, seed=3).reads
    n_experts = sum(layout.layers[x].n_experts for x in layout.layers)
    assert len({tuple(r) for r in every.tolist()}) == len(every)  # no read twice
    assert len(every) >= n_experts and every[:, 2].sum() >= one[:, 2].sum()


def test_fio_missing_leaves_the_rate_out(monkeypatch: pytest.MonkeyPatch, tiny_full_model: Path) -> None:
    import aioexperts_bench.fio as fio

    monkeypatch.setattr(fio, "fio_path", lambda: None)
    assert generate.fio_rate(str(tiny_full_model), 1 << 20, seed=0) == {"error": "fio is not installed"}


def test_tier_runs_of_another_policy_keep_their_own_row() -> None:
    """Two files whose miss tiers differ (upgrades on in one) are not averaged into one tier row:
    the earlier file's tier runs are labelled with their policy."""
    from aioexperts_bench.generate_report import merge_results

    def part(upgrade: bool, tok_s: float) -> dict[str, object]:
        return {
            "date": "d",
            "command": "c",
            "machine": {},
            "parameters": {"miss_tier": {"path": "s", "upgrade": upgrade, "prefetches": True}},
            "runs": [
                {"engine": engine, "limit": "1/4", "round": 0, "status": "ok", "decode_tok_s": value}
                for engine, value in (("aioexperts", 1.0), ("aioexperts-tier", tok_s))
            ],
        }

    merged = merge_results([part(True, 1.2), part(False, 1.5)])
    rows = {row["engine"]: row["decode_tok_s"] for row in merged["summary"]}
    assert rows == {"aioexperts": 1.0, "aioexperts-tier (upgrades)": 1.2, "aioexperts-tier": 1.5}
    same = merge_results([part(False, 1.2), part(False, 1.6)])
    assert {row["engine"]: row["decode_tok_s"] for row in same["summary"]} == {
        "aioexperts": 1.0,
        "aioexperts-tier": 1.4,
    }


def test_a_failed_run_says_why_on_its_progress_line() -> None:
    """A run whose process failed (AIOEXPERTS_COMPUTE_SPIN_US=x in its environment, say) printed only
    ``failed: 0.000 tok/s over 0 tokens, wall 1 s``: the reason was in the results file alone
    (and nowhere with ``--out ''``). The line now ends with the process's last stderr line."""
    base = {"tokens_decoded": 0, "wall_seconds": 1.0, "decode_tok_s": None}
    why = "aioexperts._errors.ConfigError: AIOEXPERTS_COMPUTE_SPIN_US must be an integer from 0 to 1000000"
    failed = {**base, "status": "failed", "stderr_tail": ["Traceback (most recent call last):", why, "  "]}
    assert _run_line(failed) == f"  failed: 0.000 tok/s over 0 tokens, wall 1 s (stderr: {why})"
    assert _run_line({**base, "status": "oom-killed", "stderr_tail": []}).endswith("wall 1 s")
    ok = {**base, "status": "ok", "decode_tok_s": 2.5, "tokens_decoded": 8}
    assert _run_line(ok) == "  ok: 2.500 tok/s over 8 tokens, wall 1 s"


def test_the_share_outside_the_fan_outs_is_a_target_of_the_uncapped_runs() -> None:
    events = _events([0.1, 0.1, 0.2], [0, 0, 0])
    events.append({**events[-1], "phase": "done", "fan_out_seconds": 0.3})
    ours = {"engine": "aioexperts", "status": "ok", **_from_events(events, 256)}
    assert ours["fan_out_ms_per_token"] == pytest.approx(100.0)
    assert ours["outside_fan_outs_share"] == pytest.approx(0.25)
    llama = {"engine": "llama.cpp", "status": "ok", **_from_events(_events([0.1, 0.1, 0.1], [0, 0, 0]), 256)}
    rnd = _round_summary([ours, llama])
    assert rnd["outside_ratio"] == pytest.approx(0.25)
    rounds = [{"limit": "none", "round": 0, **rnd}, {"limit": "none", "round": 1, **rnd, "outside_ratio": 0.1}]
    targets = {(t["limit"], t["what"]): t for t in evaluate_targets({"runs": [], "rounds": rounds})}
    assert targets["none", "outside"]["verdict"] == "MISSED"
    assert targets["none", "outside"]["per_round"] == [pytest.approx(0.25), 0.1]
    rounds[0]["outside_ratio"] = 0.12
    targets = {(t["limit"], t["what"]): t for t in evaluate_targets({"runs": [], "rounds": rounds})}
    assert targets["none", "outside"]["verdict"] == "met"
    for r in rounds:  # results of versions that did not count the fan-outs: no such target
        del r["outside_ratio"]
    assert ("none", "outside") not in {
        (t["limit"], t["what"]) for t in evaluate_targets({"runs": [], "rounds": rounds})
    }


def test_a_runs_share_of_anonymous_memory_on_huge_pages_is_recorded(tmp_path: Path) -> None:
    from aioexperts_bench.generate_worker import anon_memory

    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:  100 kB\nAnonymous:   4000 kB\nAnonHugePages:   3072 kB\nSwap: 0 kB\n")
    assert anon_memory(str(rollup)) == {"anon_bytes": 4000 * 1024, "anon_huge_bytes": 3072 * 1024}
    rollup.write_text("Rss:  100 kB\n")  # a kernel without the fields
    assert anon_memory(str(rollup)) is None
    assert anon_memory(str(tmp_path / "missing")) is None
    real = anon_memory()
    assert real is None or 0 <= real["anon_huge_bytes"] <= real["anon_bytes"]
    events = _events([0.1, 0.1], [0, 0])
    events.append({**events[-1], "phase": "done", "memory": {"anon_bytes": 4000, "anon_huge_bytes": 3000}})
    assert _from_events(events, 256)["anon_huge_share"] == pytest.approx(0.75)
    events[-1]["memory"] = None  # no smaps_rollup: no figure
    assert "anon_huge_share" not in _from_events(events, 256)
