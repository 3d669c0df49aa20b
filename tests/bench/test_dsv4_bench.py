"""The benches on the DeepSeek-V4 geometry (``--model dsv4-flash``), end to end on a tiny ``deepseek4`` file.

``aioexperts-bench --mode generate --model dsv4-flash`` and ``bench/model_speed.py --model dsv4-flash``
run the built-in DeepSeek-V4-Flash-geometry model (about 9.1 GB at 4 layers); here the same option
gets :data:`~aioexperts.testing.TINY_DSV4_SPEC` (the same layout at a test size) so the wiring runs in
seconds. llama.cpp runs beside aioexperts when llama-cpp-python is installed, as in the real bench.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioexperts.testing
from aioexperts.cli import bench
from aioexperts_bench import load_generate_results

pytest.importorskip("tokenizers")

REPO = Path(__file__).parents[2]
LLAMA = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny_dsv4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V4-geometry model, written once for this module."""
    return aioexperts.testing.write_dsv4_model(
        tmp_path_factory.mktemp("dsv4") / "tiny-dsv4.gguf", aioexperts.testing.TINY_DSV4_SPEC
    )


@pytest.fixture
def built_in_is_tiny(tiny_dsv4: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``ensure_dsv4_model`` returns the tiny file; the layers it was asked for are recorded."""
    asked: list[int] = []

    def ensure(n_layer: int = 4, **kwargs: Any) -> Path:
        asked.append(n_layer)
        return tiny_dsv4

    monkeypatch.setattr(aioexperts.testing, "ensure_dsv4_model", ensure)
    return asked


def test_generate_runs_the_dsv4_model_beside_llama_cpp(
    built_in_is_tiny: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gen-dsv4.json"
    engines = "aioexperts,llama.cpp-norepack" if LLAMA else "aioexperts"  # repack: AMX asserts on deepseek4
    argv = ["--mode", "generate", "--model", "dsv4-flash", "--engines", engines, "--limits", "none"]
    argv += ["--rounds", "1", "--prompt-tokens", "8", "--decode-tokens", "3", "--out", str(out), "--quiet"]
    assert bench.main(argv) == 0
    assert built_in_is_tiny == [4]  # --layers' default for dsv4-flash
    results = load_generate_results(out)
    runs = {r["engine"]: r for r in results["runs"]}
    ours = runs["aioexperts"]
    assert ours["status"] == "ok" and ours["tokens_decoded"] == 3 and len(ours["greedy"]) == 4
    assert len(ours["distinct_experts_per_layer"]) == 4  # every deepseek4 layer is an MoE layer
    assert ours["decode_tok_s"] > 0 and ours["prefill_tok_s"] > 0
    if LLAMA:  # llama.cpp loads deepseek4 and decodes the same teacher-forced tokens
        assert runs["llama.cpp-norepack"]["status"] == "ok" and runs["llama.cpp-norepack"]["tokens_decoded"] == 3
        assert results["rounds"][0]["agreement"]["llama.cpp-norepack"]["compared"] == 4
    assert "| none | aioexperts | 1x ok |" in capsys.readouterr().out


def test_generate_passes_layers_on_and_refuses_what_chooses_nothing(
    built_in_is_tiny: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mode", "generate", "--model", "dsv4-flash", "--layers", "6", "--engines", "aioexperts"]
    argv += ["--limits", "none", "--rounds", "1", "--prompt-tokens", "4", "--decode-tokens", "1", "--quiet"]
    assert bench.main([*argv, "--out", str(tmp_path / "a.json")]) == 0
    assert built_in_is_tiny == [6]
    for bad, said in (
        (["--model", "dsv4-flash", "--routing", "skewed"], "--routing is the built-in Qwen3 model's"),
        (["--model", "x.gguf", "--layers", "4"], "a --model file has its own"),
        (["--model", "dsv4-flash", "--layers", "0"], "--layers must be >= 1, got 0"),
    ):
        with pytest.raises(SystemExit) as info:
            bench.main(["--mode", "generate", *bad])
        assert info.value.code == 2
        assert said in capsys.readouterr().err


def _model_speed() -> Any:
    spec = importlib.util.spec_from_file_location("model_speed_dsv4", REPO / "bench" / "model_speed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_speed_runs_the_dsv4_model_and_renders_its_own_region(
    tiny_dsv4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    speed = _model_speed()
    asked: list[int] = []
    monkeypatch.setattr(speed, "ensure_dsv4_model", lambda n, **kw: asked.append(n) or tiny_dsv4)
    out = tmp_path / "speed-dsv4.json"
    argv = ["--model", "dsv4-flash", "--tokens", "2", "--prompt", "8", "--rounds", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["model_speed.py", *argv])
    anyio.run(speed.main, speed.parse(argv))
    assert asked == [4]
    results = json.loads(out.read_text())
    assert results["parameters"]["architecture"] == "deepseek4" and results["parameters"]["layers"] == 4
    assert len(results["rounds"]) == 1 and results["rounds"][0]["decode_ms_per_token"] > 0
    assert [s["slab_fraction"] for s in results["summary"]["slabs"]] == [0.10, 0.25, 0.50]
    doc = tmp_path / "model.md"
    qwen = "<!-- bench:model_speed -->\nthe Qwen3 figures\n<!-- /bench:model_speed -->\n"
    doc.write_text(qwen + "<!-- bench:model_speed-deepseek4 -->\nnot yet\n<!-- /bench:model_speed-deepseek4 -->\n")
    speed.render(out, doc)
    text = doc.read_text()
    assert text.startswith(qwen)  # the Qwen3 model's region is left alone
    assert "not yet" not in text and "(4 layers, 8 experts per layer, top-3)" in text
    doc.write_text(qwen)
    with pytest.raises(SystemExit, match="no <!-- bench:model_speed-deepseek4 -->"):
        speed.render(out, doc)
