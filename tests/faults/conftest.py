"""Fixtures of the fault tests: a small synthetic MoE model on ext4 (O_DIRECT works) and its bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioexperts.testing import SyntheticSpec, write_synthetic_model
from faults.stack import Key, reference_bytes

#: 3 layers x 8 experts; each expert is three reads (gate, up, down) of about 37 KB.
SMALL = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults-model") / "small.gguf"
    write_synthetic_model(path, SMALL)
    return path


@pytest.fixture(scope="session")
def reference(model_path: Path) -> dict[Key, list[bytes]]:
    return reference_bytes(model_path)
