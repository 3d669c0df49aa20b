"""A decode step's routed experts as a few compiled calls per worker (one token of one call).

The general path (:func:`aioexperts._compute.moe.expert_outputs`) makes each expert one
compute-pool item of three :func:`~aioexperts._compute.fused.linear` products and its activation:
about 30 us of Python per expert, and 8 items per layer to hand out. For one token, the experts are
split into one group per worker instead; a group is one :func:`~aioexperts._compute.grouped.matvec_group`
call for its gate and up products, the gated activation of the group's rows in numpy, and one call
for its down products. The kernels and numpy operations are the general path's, so every expert's
output has its bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aioexperts._compute.glu import GatedActivation
from aioexperts._compute.grouped import group_kernel, matvec_group
from aioexperts._format.views import ExpertView

__all__ = ("expert_group", "group_serves")


def group_serves(views: Sequence[ExpertView]) -> bool:
    """Whether :func:`expert_group` serves these experts (checked views of one layer): one type and
    shape per projection across them, a group kernel for each type (int8 precision, numba), and a
    down width equal to the gate's (no zero padding)."""
    if not views:
        return False
    first = views[0]
    gate, up, down = first.gate, first.up, first.down
    if gate.shape != up.shape or down.shape[1] != gate.shape[0]:
        return False
    for v in views:
        if (
            v.gate.ggml_type != gate.ggml_type
            or v.up.ggml_type != up.ggml_type
            or v.down.ggml_type != down.ggml_type
            or v.gate.shape != gate.shape
            or v.down.shape != down.shape
        ):
            return False
    return all(group_kernel(t) is not None for t in {gate.ggml_type, up.ggml_type, down.ggml_type})


def expert_group(x: np.ndarray, views: Sequence[ExpertView], activation: GatedActivation) -> np.ndarray | None:
    """``down(act(gate x) * up x)`` of each expert in ``views`` for one token.

    Args:
        x: ``(1, n_embd)`` float32, C-contiguous.
        views: pinned, checked views that :func:`group_serves` accepts.
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
        mats = [v.gate.data for v in views] + [v.up.data for v in views]
        if not matvec_group(gate.ggml_type, gate.shape, mats, x, np.zeros(2 * n, dtype=np.int64), gu):
            return None
    else:
        zeros = np.zeros(n, dtype=np.int64)
        if not (
            matvec_group(gate.ggml_type, gate.shape, [v.gate.data for v in views], x, zeros, g)
            and matvec_group(up.ggml_type, up.shape, [v.up.data for v in views], x, zeros, u)
        ):
            return None
    act = np.empty((n, n_ff), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        activation(g, u, np.empty_like(act), act)
    out = np.empty((n, down.shape[0]), dtype=np.float32)
    if not matvec_group(
        down.ggml_type, down.shape, [v.down.data for v in views], act, np.arange(n, dtype=np.int64), out
    ):
        return None
    return out
