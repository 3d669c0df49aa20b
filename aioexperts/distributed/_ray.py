"""Ray, imported on first use: one clear error line when the ``ray`` extra is missing."""

from __future__ import annotations

from typing import Any

from .._errors import OptionalDependencyError

__all__ = ("ray_module",)


def ray_module() -> Any:
    """The ``ray`` module.

    Raises:
        OptionalDependencyError: Ray is not installed (the message names the extra).
    """
    try:
        import ray
    except ImportError as exc:
        raise OptionalDependencyError(
            "aioexperts.distributed needs Ray to run shards: pip install 'aioexperts[ray]'"
        ) from exc
    return ray
