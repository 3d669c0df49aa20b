"""``aioexperts-tier``: writes the sidecar, replaces only its own kind, never the model; errors exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioexperts._format.layout import build_layout
from aioexperts._format.model import open_model
from aioexperts._format.tier_sidecar import read_tier_sidecar
from aioexperts.cli.tiertool import default_output, main
from aioexperts.testing import SyntheticSpec, write_synthetic_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    write_synthetic_model(path, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    return path


def test_writes_a_sidecar_the_store_accepts(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model), "--type", "IQ4_XS"]) == 0
    out = default_output(str(model), "IQ4_XS")
    assert capsys.readouterr().out.strip() == out and out.endswith("m.miss-tier-IQ4_XS.gguf")
    gguf = open_model(model)
    assert read_tier_sidecar(out, gguf, build_layout(gguf)).ggml_type.name == "IQ4_XS"
    assert main([str(model), "--type", "IQ4_XS", "--quiet"]) == 0  # its own kind: replaced


def test_refuses_to_write_over_the_model_or_another_file(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model), "-o", str(model)]) == 2
    assert "is the input" in capsys.readouterr().err
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    assert main([str(model), "-o", str(other)]) == 2
    assert other.read_text() == "keep me"
    assert main([str(model), "-o", str(other), "--force", "--quiet"]) == 0
    assert main([str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x.gguf")]) == 2
