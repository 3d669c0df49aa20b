"""LoadOptions: the model's options checked once, when load() is called (issue 32)."""

from __future__ import annotations

from pathlib import Path

import pytest

import aioexperts
from aioexperts._model.config import LoadOptions


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_ctx", 0),
        ("n_ctx", True),
        ("memory_budget", -1),
        ("prefetch", "router"),
        ("resident_embedding_bytes", 1.5),
        ("batch_wait", -1.0),
        ("hits_first", 1),
        ("record_trace", None),
    ],
)
def test_each_bad_option_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(aioexperts.ConfigError, match=field):
        LoadOptions(**{field: value})  # type: ignore[arg-type]


def test_load_decides_the_options_once_and_the_model_keeps_them(tiny_full_model: Path) -> None:
    prefetch = aioexperts.PrefetchOptions(depth=1)
    model = aioexperts.load(tiny_full_model, n_ctx=48, prefetch=prefetch, batch_wait=None, hits_first=False)
    assert model.options == LoadOptions(n_ctx=48, prefetch=prefetch, batch_wait=0.0, hits_first=False)
    with pytest.raises(aioexperts.ConfigError, match="n_ctx"):
        aioexperts.load(tiny_full_model, n_ctx=-3)  # refused at load(), before anything starts


def test_apply_to_refuses_what_is_not_a_runner() -> None:
    with pytest.raises(aioexperts.ConfigError, match="MoERunner"):
        LoadOptions().apply_to(object())  # type: ignore[arg-type]
