"""The KV cache of one sequence: per layer, named float32 arrays preallocated for ``n_ctx`` positions.

Each block says what it caches per position (:meth:`AttentionBlock.cache_shapes`, e.g.
``{"k": (n_head_kv, head_k), "v": (n_head_kv, head_v)}``; an MLA block caches its latent instead);
:class:`KVCache` allocates ``(n_ctx, *shape)`` for each at once, so a sequence never grows memory
while it runs. A recurrent block's per-sequence state (:meth:`RecurrentBlock.state_shapes`) is
allocated once, without the position axis, in the same per-layer dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ("KVCache", "cache_bytes_per_position", "state_bytes")


def cache_bytes_per_position(layer_shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> int:
    """Bytes one position takes over every layer (float32)."""
    return 4 * sum(math.prod(shape) for shapes in layer_shapes for shape in shapes.values())


def state_bytes(layer_states: Sequence[Mapping[str, tuple[int, ...]]]) -> int:
    """Bytes of one sequence's recurrent state over every layer (float32)."""
    return 4 * sum(math.prod(shape) for shapes in layer_states for shape in shapes.values())


class KVCache:
    """Preallocated float32 cache arrays, ``layers[L][name]`` of shape ``(n_ctx, *shape)``.

    Args:
        layer_shapes: per block, ``{name: per-position shape}``.
        n_ctx: positions.
        layer_states: per block, ``{name: shape}`` of its recurrent state (none by default).

    Attributes:
        state_positions: positions the recurrent state holds (0 for a new sequence; -1 while a
            forward pass runs or after one that did not finish, when it is unknown). Without
            recurrent blocks it stays 0.
    """

    def __init__(
        self,
        layer_shapes: Sequence[Mapping[str, tuple[int, ...]]],
        n_ctx: int,
        layer_states: Sequence[Mapping[str, tuple[int, ...]]] = (),
    ) -> None:
        self.n_ctx = n_ctx
        self.layers: list[dict[str, np.ndarray]] | None = [
            {name: np.zeros((n_ctx, *shape), dtype=np.float32) for name, shape in shapes.items()}
            for shapes in layer_shapes
        ]
        for arrays, states in zip(self.layers, layer_states, strict=False):
            arrays.update({name: np.zeros(shape, dtype=np.float32) for name, shape in states.items()})
        self.recurrent = any(layer_states)
        self.state_positions = 0
        self.n_bytes = n_ctx * cache_bytes_per_position(layer_shapes) + state_bytes(layer_states)

    def layer(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of block ``index``."""
        assert self.layers is not None, "KV cache freed"
        return self.layers[index]

    def free(self) -> None:
        """Drop the arrays (idempotent)."""
        self.layers = None
