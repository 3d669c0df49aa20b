"""The KV cache of one sequence: per layer, named float32 arrays preallocated for ``n_ctx`` positions.

Each block says what it caches per position (:meth:`AttentionBlock.cache_shapes`, e.g.
``{"k": (n_head_kv, head_k), "v": (n_head_kv, head_v)}``; an MLA block caches its latent instead);
:class:`KVCache` allocates ``(n_ctx, *shape)`` for each at once, so a sequence never grows memory
while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ("KVCache", "cache_bytes_per_position")


def cache_bytes_per_position(layer_shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> int:
    """Bytes one position takes over every layer (float32)."""
    return 4 * sum(math.prod(shape) for shapes in layer_shapes for shape in shapes.values())


class KVCache:
    """Preallocated float32 cache arrays, ``layers[L][name]`` of shape ``(n_ctx, *shape)``.

    Args:
        layer_shapes: per block, ``{name: per-position shape}``.
        n_ctx: positions.
    """

    def __init__(self, layer_shapes: Sequence[Mapping[str, tuple[int, ...]]], n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.layers: list[dict[str, np.ndarray]] | None = [
            {name: np.zeros((n_ctx, *shape), dtype=np.float32) for name, shape in shapes.items()}
            for shapes in layer_shapes
        ]
        self.n_bytes = n_ctx * cache_bytes_per_position(layer_shapes)

    def layer(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of block ``index``."""
        assert self.layers is not None, "KV cache freed"
        return self.layers[index]

    def free(self) -> None:
        """Drop the arrays (idempotent)."""
        self.layers = None
