"""Argument checks shared by every layer: options records, the runner, the maths.

The bottom of the import graph (it imports only :mod:`aioexperts._errors`), so the store layer
and the compute layer can both use it without importing each other.
"""

from __future__ import annotations

import numpy as np

from ._errors import ConfigError, InvalidRequestError

__all__ = ("as_int_array", "check_activations", "check_bool", "check_int", "describe")


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


def as_int_array(value: object, name: str, shape: tuple[int, ...] | None = None, *, ndim: int = 1) -> np.ndarray:
    """``value`` as an int64 array: any integer array-like (a list, tuple or range of ints, an integer
    numpy array of any integer dtype), as numpy APIs take it.

    Args:
        value: the ids.
        name: the argument's name, for the message.
        shape: the shape ``value`` must have; None: any shape with ``ndim`` dimensions.
        ndim: the dimensions when ``shape`` is None.

    Raises:
        InvalidRequestError: ``value`` is not an array-like of integers (floats, bools, strings,
            ragged lists, ints beyond 64 bits) or has the wrong shape; the message says what it got.
    """
    want = f"an integer array of shape {shape}" if shape is not None else f"a {ndim}-D integer array"
    if value is None or isinstance(value, str | bytes):
        raise InvalidRequestError(f"{name} must be {want} (or a list of ints), got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequestError(
            f"{name} must be {want} (or a list of ints), got {type(value).__name__}: {exc}"
        ) from None
    if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(value, np.ndarray):
        arr = arr.astype(np.int64)  # np.asarray([]) is float64
    if arr.dtype.kind not in "iu" or (arr.shape != shape if shape is not None else arr.ndim != ndim):
        got = describe(value) if isinstance(value, np.ndarray) else f"{type(value).__name__} giving {describe(arr)}"
        raise InvalidRequestError(f"{name} must be {want} (or a list of ints), got {got}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidRequestError(f"{name}: {int(arr.max())} is beyond int64")
    return arr.astype(np.int64, copy=False)
