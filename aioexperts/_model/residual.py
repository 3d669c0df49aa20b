"""The residual stream between blocks: the add (with Granite's scale) and the check that it stays finite."""

from __future__ import annotations

import numpy as np

from aioexperts._errors import NonFiniteError
from aioexperts._format.architectures import ModelHParams

__all__ = ("add_residual", "check_finite")


def add_residual(resid: np.ndarray, f: np.ndarray, hp: ModelHParams) -> np.ndarray:
    """``resid + f * residual_scale`` (granite.cpp's ``f_residual_scale``; 1 elsewhere): a new array."""
    if hp.residual_scale:
        f = f * np.float32(hp.residual_scale)
    return resid + f


def check_finite(what: str, x: np.ndarray) -> None:
    """Raise NonFiniteError naming ``what`` and the token rows of ``x`` ``(n_tokens, ...)`` that hold NaN or inf."""
    if not np.isfinite(x).all():
        rows = np.flatnonzero(~np.isfinite(x).all(axis=-1))
        raise NonFiniteError(
            f"{what} is not finite for token rows {rows[:8].tolist()} (NaN or inf: a broken model file, "
            "or activations beyond float32)"
        )
