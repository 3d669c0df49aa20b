"""The KV cache of one sequence: per layer, named float32 arrays preallocated for ``n_ctx`` positions.

Each block says what it caches per position (:meth:`AttentionBlock.cache_shapes`, e.g.
``{"k": (n_head_kv, head_k), "v": (n_head_kv, head_v)}``; an MLA block caches its latent instead);
:class:`KVCache` allocates ``(n_ctx, *shape)`` for each at once, so a sequence never grows memory
while it runs. The arrays are float16 by default, as llama.cpp's (``type_k``/``type_v`` F16: the
values written are rounded to nearest even, and attention reads them as
:func:`aioexperts._compute.attention.attend` says), or float32 (``load(kv_type="f32")``).
A recurrent block's per-sequence state (:meth:`RecurrentBlock.state_shapes`) is
allocated once, without the position axis, in the same per-layer dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

__all__ = (
    "KV_ELEMENT_BYTES",
    "KV_TYPES",
    "KVCache",
    "KVType",
    "cache_bytes_per_position",
    "layer_kv_types",
    "state_bytes",
)

KVType = Literal["f16", "f32"]
#: the element types of a KV cache, by the name ``load(kv_type=...)`` takes
KV_TYPES: dict[str, type[np.floating[Any]]] = {"f16": np.float16, "f32": np.float32}
#: bytes of one element of each KV type
KV_ELEMENT_BYTES: dict[str, int] = {name: np.dtype(t).itemsize for name, t in KV_TYPES.items()}


def layer_kv_types(kv_type: KVType | Sequence[KVType], n_layers: int) -> list[KVType]:
    """``kv_type`` for each of ``n_layers`` layers (one type for all, or one per layer)."""
    return [kv_type] * n_layers if isinstance(kv_type, str) else list(kv_type)


def cache_bytes_per_position(
    layer_shapes: Sequence[Mapping[str, tuple[int, ...]]], kv_type: KVType | Sequence[KVType] = "f16"
) -> int:
    """Bytes one position takes over every layer, with elements of ``kv_type`` (one, or one per layer)."""
    types = layer_kv_types(kv_type, len(layer_shapes))
    return sum(
        KV_ELEMENT_BYTES[t] * sum(math.prod(shape) for shape in shapes.values())
        for t, shapes in zip(types, layer_shapes, strict=True)
    )


def state_bytes(layer_states: Sequence[Mapping[str, tuple[int, ...]]]) -> int:
    """Bytes of one sequence's recurrent state over every layer (float32)."""
    return 4 * sum(math.prod(shape) for shapes in layer_states for shape in shapes.values())


class KVCache:
    """Preallocated cache arrays, ``layers[L][name]`` of shape ``(n_ctx, *shape)`` (recurrent states: float32).

    Args:
        layer_shapes: per block, ``{name: per-position shape}``.
        n_ctx: positions.
        layer_states: per block, ``{name: shape}`` of its recurrent state (none by default).
        kv_type: ``"f16"`` (default, llama.cpp's) or ``"f32"``, or one of them per layer.

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
        kv_type: KVType | Sequence[KVType] = "f16",
    ) -> None:
        self.n_ctx = n_ctx
        self.kv_types = layer_kv_types(kv_type, len(layer_shapes))
        self.layers: list[dict[str, np.ndarray]] | None = [
            {name: np.zeros((n_ctx, *shape), dtype=KV_TYPES[t]) for name, shape in shapes.items()}
            for t, shapes in zip(self.kv_types, layer_shapes, strict=True)
        ]
        for arrays, states in zip(self.layers, layer_states, strict=False):
            arrays.update({name: np.zeros(shape, dtype=np.float32) for name, shape in states.items()})
        self.recurrent = any(layer_states)
        self.state_positions = 0
        self.n_bytes = n_ctx * cache_bytes_per_position(layer_shapes, kv_type) + state_bytes(layer_states)

    def layer(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of block ``index``."""
        assert self.layers is not None, "KV cache freed"
        return self.layers[index]

    def free(self) -> None:
        """Drop the arrays (idempotent)."""
        self.layers = None
