"""Argument checks shared by every layer: options records, the runner, the maths.

The bottom of the import graph (it imports only :mod:`aioexperts._errors`), so the store layer
and the compute layer can both use it without importing each other.
"""

from __future__ import annotations

import numpy as np

from ._errors import ConfigError, InvalidRequestError

__all__ = ("check_activations", "check_bool", "check_int", "describe")


def describe(a: object) -> str:
    """A short description of a bad argument for an error message: dtype and shape of an array, else its type."""
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__


def check_int(owner: object, name: str, *, low: int, optional: bool = False, high: int | None = None) -> None:
    """Check the int field ``name`` of the frozen record ``owner``; numpy integers become ``int``."""
    value = getattr(owner, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be {bounds}, got {value}")
    object.__setattr__(owner, name, value)


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """``value`` is True or False (or None where ``optional``), else ConfigError naming ``name``."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


def check_activations(x: object, n_embd: int) -> np.ndarray:
    """``x`` as a C-contiguous float32 ``(n_tokens, n_embd)`` array (the input of an MoE layer).

    Raises:
        InvalidRequestError: ``x`` is not a float32 array of that shape.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != n_embd:
        raise InvalidRequestError(f"x must be a float32 array of shape (n_tokens, {n_embd}), got {describe(x)}")
    return np.ascontiguousarray(x)
