"""The llama.cpp worker of ``--mode generate`` against a stand-in package laid out like llama-cpp-python.

llama-cpp-python's ``Llama.__init__`` reads ``llama_model_default_params`` through its bindings module
(``import llama_cpp.llama_cpp as llama_cpp`` in ``llama_cpp/llama.py``), so the ``norepack`` engine must
patch that module; patching the package's re-export leaves repack on.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from aioexperts_bench import generate_worker

BINDINGS = """
class _Params:
    def __init__(self):
        self.use_extra_bufts = True
        self.load_mode = 1

def llama_model_default_params():
    return _Params()
"""

LLAMA = """
import ctypes
import llama_cpp.llama_cpp as llama_cpp

N_VOCAB = 11

class _Ctx:
    def __init__(self):
        self.buffer = (ctypes.c_float * N_VOCAB)()

    def get_logits(self):
        return self.buffer

class Llama:
    def __init__(self, model_path, n_ctx=512, **kwargs):
        self.model_params = llama_cpp.llama_model_default_params()
        self._ctx = _Ctx()
        self.n_ctx, self.n_tokens = n_ctx, 0

    def n_vocab(self):
        return N_VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        if self.n_tokens + len(tokens) > self.n_ctx:
            raise RuntimeError("llama_decode returned 1: the KV cache is full")
        self.n_tokens += len(tokens)
        for i in range(N_VOCAB):
            self._ctx.buffer[i] = float((tokens[-1] * 7 + i) % N_VOCAB)
"""

PACKAGE = """
from .llama_cpp import *
from .llama import *
__version__ = "0.0-stand-in"
"""


@pytest.fixture
def stand_in_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    (pkg / "llama_cpp.py").write_text(textwrap.dedent(BINDINGS))
    (pkg / "llama.py").write_text(textwrap.dedent(LLAMA))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def _events(out: str) -> dict[str, dict[str, object]]:
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {e["phase"]: e for e in lines if e["phase"] != "token"}


@pytest.mark.parametrize(("engine", "repack"), [("llama.cpp", True), ("llama.cpp-norepack", False)])
def test_each_llama_engine_loads_with_its_repack_setting(
    stand_in_llama_cpp: Path, capsys: pytest.CaptureFixture[str], engine: str, repack: bool
) -> None:
    cfg = {"engine": engine, "model": "m.gguf", "n_ctx": 16, "prompt": [1, 2, 3], "decode": [4, 5], "threads": 1}
    assert generate_worker.main([json.dumps(cfg)]) == 0
    events = _events(capsys.readouterr().out)
    assert events["loaded"]["repack"] is repack
    assert events["prefill"]["greedy"] == (10 - 7 * cfg["prompt"][-1]) % 11  # the argmax of the stand-in's logits
    assert "done" in events


def test_a_repack_setting_that_did_not_take_stops_the_run(
    stand_in_llama_cpp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (stand_in_llama_cpp / "llama_cpp" / "llama.py").write_text(
        textwrap.dedent(LLAMA).replace(
            "self.model_params = llama_cpp.llama_model_default_params()",
            "self.model_params = llama_cpp.llama_model_default_params(); self.model_params.use_extra_bufts = True",
        )
    )
    cfg = {"engine": "llama.cpp-norepack", "model": "m.gguf", "n_ctx": 16, "prompt": [1], "decode": [], "threads": 1}
    with pytest.raises(SystemExit) as stopped:
        generate_worker.main([json.dumps(cfg)])
    assert stopped.value.code == 3
    assert "use_extra_bufts=True" in capsys.readouterr().err


def test_the_warm_prefill_is_reported_apart_and_its_positions_are_dropped(
    stand_in_llama_cpp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # n_ctx holds the prompt and the decode once, not the prompt twice: the warm-up's positions must go
    prompt = [1, 2, 3, 4, 5, 6, 7]
    cfg = {"engine": "llama.cpp", "model": "m.gguf", "n_ctx": 10, "prompt": prompt, "decode": [4, 5], "threads": 1}
    assert generate_worker.main([json.dumps({**cfg, "warm_prefill": True})]) == 0
    events = _events(capsys.readouterr().out)
    assert events["cold_prefill"]["n_tokens"] == len(prompt) and events["cold_prefill"]["seconds"] >= 0
    assert events["prefill"]["n_tokens"] == len(prompt) and "done" in events
    assert generate_worker.main([json.dumps(cfg)]) == 0
    assert "cold_prefill" not in _events(capsys.readouterr().out)
