"""Strict JSON for every file and line the project writes: no ``NaN`` or ``Infinity`` tokens.

Python's :mod:`json` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default, which strict parsers
(``jq``, JavaScript's ``JSON.parse``, Go, Rust's serde) reject. :func:`json_safe` turns an undefined
number into ``null`` and numpy scalars and arrays into Python values; :func:`dumps` and :func:`dump`
apply it and then write with ``allow_nan=False``, so a non-finite float can never reach the output.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any

__all__ = ("dump", "dumps", "json_safe")


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, tuples made lists, dict keys made
    strings and numpy scalars and arrays made Python numbers and lists (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return json_safe(value.tolist())
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(json_safe(value), allow_nan=False, **kwargs)``."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def dump(value: Any, fp: IO[str], **kwargs: Any) -> None:
    """``json.dump(json_safe(value), fp, allow_nan=False, **kwargs)``."""
    json.dump(json_safe(value), fp, allow_nan=False, **kwargs)
