"""A decode step's routed experts as two compiled fan-outs (one token of one call).

The general path (:func:`aioexperts._compute.moe.expert_outputs`) makes each expert one
compute-pool item of three :func:`~aioexperts._compute.fused.linear` products and its activation:
about 30 us of Python per expert, and 8 items per layer to hand out. For one token, the experts of
one type are one group instead: one :func:`~aioexperts._compute.grouped.matvec_group` fan-out for
their gate and up products (every product an item any core claims), the gated activation of the
group's rows in numpy, and one fan-out for their down products. The kernels and numpy operations
are the general path's, so every expert's output has its bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType

from aioexperts._compute.glu import GatedActivation
from aioexperts._compute.grouped import matvec_group, product_task
from aioexperts._format.views import ExpertView

__all__ = ("expert_group", "group_classes")

Shape = tuple[int, int]
ClassKey = tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType, Shape, Shape, Shape]


def group_classes(views: Sequence[ExpertView]) -> list[list[int]] | None:
    """The positions in ``views`` (checked views of one layer) cut into classes that
    :func:`expert_group` serves one at a time: one type and shape per projection in a class (a
    mixed-tier or miss-tier layer has a class per bank or tier), in order of first appearance;
    None when a class has no group kernel for a type (float precision, numpy backend, a type
    without an int8 kernel) or a down width other than its gate's (zero padding), or ``views`` is
    empty."""
    classes: dict[
        tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType, Shape, Shape, Shape], list[int]
    ]
    classes = {}
    for i, v in enumerate(views):
        key = (v.gate.ggml_type, v.up.ggml_type, v.down.ggml_type, v.gate.shape, v.up.shape, v.down.shape)
        classes.setdefault(key, []).append(i)
    for gate_t, up_t, down_t, gate_shape, up_shape, down_shape in classes:
        if gate_shape != up_shape or down_shape[1] != gate_shape[0]:
            return None
        if any(product_task(t) is None for t in {gate_t, up_t, down_t}):
            return None
    return list(classes.values()) or None


def expert_group(x: np.ndarray, views: Sequence[ExpertView], activation: GatedActivation) -> np.ndarray | None:
    """``down(act(gate x) * up x)`` of each expert in ``views`` for one token.

    Args:
        x: ``(1, n_embd)`` float32, C-contiguous.
        views: pinned, checked views of one class of :func:`group_classes`.
        activation: the layer's gated activation (:func:`aioexperts._compute.glu.expert_activation`).

    Returns:
        ``(len(views), n_embd)`` float32, row ``i`` the output of ``views[i]``; None when a product
        saw a non-finite input (the caller takes the general path, which keeps NaN and inf).

    Raises:
        FormatError: a projection's byte count does not fit its shape and type.
    """
    n = len(views)
    first = views[0]
    gate, up, down = first.gate, first.up, first.down
    n_ff = gate.shape[0]
    gu = np.empty((2 * n, n_ff), dtype=np.float32)
    g, u = gu[:n], gu[n:]
    if gate.ggml_type == up.ggml_type:
        mats = [v.gate for v in views] + [v.up for v in views]
        if not matvec_group(gate.ggml_type, gate.shape, mats, x, np.zeros(2 * n, dtype=np.int64), gu):
            return None
    else:
        zeros = np.zeros(n, dtype=np.int64)
        if not (
            matvec_group(gate.ggml_type, gate.shape, [v.gate for v in views], x, zeros, g)
            and matvec_group(up.ggml_type, up.shape, [v.up for v in views], x, zeros, u)
        ):
            return None
    act = np.empty((n, n_ff), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        activation(g, u, np.empty_like(act), act)
    out = np.empty((n, down.shape[0]), dtype=np.float32)
    if not matvec_group(down.ggml_type, down.shape, [v.down for v in views], act, np.arange(n, dtype=np.int64), out):
        return None
    return out
