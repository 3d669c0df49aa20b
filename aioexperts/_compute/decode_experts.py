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

import threading
from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType

from aioexperts._compute import fused as _fused
from aioexperts._compute.glu import GatedActivation, swiglu
from aioexperts._compute.grouped import GroupCall, matvec_group, product_task
from aioexperts._errors import ConfigError
from aioexperts._format.views import ExpertView, LayoutKey, layout_key

__all__ = ("RowStep", "expert_group", "group_classes", "row_step")

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
    if not all(_class_served(*key) for key in classes):
        return None
    return list(classes.values()) or None


def _class_served(
    gate_t: GGMLQuantizationType,
    up_t: GGMLQuantizationType,
    down_t: GGMLQuantizationType,
    gate_shape: Shape,
    up_shape: Shape,
    down_shape: Shape,
) -> bool:
    """Whether :func:`expert_group` serves experts of these types and shapes: gate and up of one
    shape, a down as wide as the gate's rows (no zero padding), a group kernel for every type."""
    if gate_shape != up_shape or down_shape[1] != gate_shape[0]:
        return False
    return all(product_task(t) is not None for t in {gate_t, up_t, down_t})


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


class RowStep:
    """One layer's routed experts for one decode row, prepared at the layer's first call (for the
    class of experts of that call; calls of another class take the general path): the gate and
    up products as one fan-out (:class:`~aioexperts._compute.grouped.GroupCall`), the gated
    activation in numpy, the down products as a second fan-out, and the slot-order weighted sum
    compiled (:mod:`aioexperts._compute.kernels.combine`). The kernels, the activation and the sum
    are :func:`expert_group`'s and :func:`~aioexperts._compute.moe.combine_moe`'s, so the output
    has their bits; the descriptors, inputs and outputs live here, so a call makes no array but
    its result and looks up no address but the experts'.

    One thread at a time (:meth:`run` returns None while another thread runs it).

    Args:
        views: the ``n`` checked views of a first call, all of one class (:func:`group_classes`);
            they fix the types, shapes and byte counts every later call must have.
        activation: the layer's gated activation.

    Raises:
        ValueError: ``views`` is empty, or no group kernel or compiled sum serves them
            (:func:`row_step` checks first).
    """

    __slots__ = (
        "_act",
        "_activation",
        "_down",
        "_gate_up",
        "_gather",
        "_gu",
        "_gu_halves",
        "_quiet_activation",
        "_lock",
        "_sum",
        "_tmp",
        "_x",
        "_ys",
        "layout",
        "n",
    )

    def __init__(self, views: Sequence[ExpertView], activation: GatedActivation) -> None:
        if not views:
            raise ValueError("RowStep: no views")
        self._make(layout_key(views[0]), len(views), activation)

    @classmethod
    def for_layout(cls, layout: LayoutKey, n: int, activation: GatedActivation) -> RowStep:
        """The step of ``n`` experts of ``layout`` (:func:`~aioexperts._format.views.layout_key`:
        what :class:`RowStep` takes from its first call's views), made without views: from a
        layer's :class:`~aioexperts._format.views.ExpertTable`.

        Raises:
            ValueError: ``n < 1``, or no group kernel or compiled sum serves the layout's types
                (:func:`row_step_for_layout` checks first).
        """
        if n < 1:
            raise ValueError("RowStep: no experts")
        step = cls.__new__(cls)
        step._make(layout, n, activation)
        return step

    def _make(self, layout: LayoutKey, n: int, activation: GatedActivation) -> None:
        (gate_t, up_t, down_t), (gate_shape, _, down_shape), _ = layout
        self.n = n
        self.layout: LayoutKey = layout
        task, down_task = product_task(gate_t), product_task(down_t)
        weighted_sum = _fused.compiled_kernel("combine", "weighted_rows_sum")
        gather = _fused.compiled_kernel("combine", "gather_addresses")
        if task is None or down_task is None or weighted_sum is None or gather is None or gate_t != up_t:
            raise ValueError("RowStep: no group kernel for these types")  # the caller checked
        self._sum = weighted_sum
        self._gather = gather
        n_ff, n_embd = gate_shape
        self._x = np.zeros((1, n_embd), dtype=np.float32)
        self._gu = np.zeros((2 * n, n_ff), dtype=np.float32)
        self._act = np.zeros((n, n_ff), dtype=np.float32)
        self._tmp = np.zeros((n, n_ff), dtype=np.float32)
        self._ys = np.zeros((n, down_shape[0]), dtype=np.float32)
        i64 = np.int64
        self._gate_up = GroupCall(
            task,
            np.zeros(2 * n, dtype=i64),
            np.full(2 * n, n_ff, dtype=i64),
            task.row_bytes(n_embd),
            self._x,
            np.zeros(2 * n, dtype=i64),
            self._gu.reshape(-1),
            4 * n_ff * np.arange(2 * n, dtype=i64),
        )
        self._down = GroupCall(
            down_task,
            np.zeros(n, dtype=i64),
            np.full(n, down_shape[0], dtype=i64),
            down_task.row_bytes(down_shape[1]),
            self._act,
            np.arange(n, dtype=i64),
            self._ys.reshape(-1),
            4 * down_shape[0] * np.arange(n, dtype=i64),
        )
        self._activation = activation
        self._gu_halves = (self._gu[:n], self._gu[n:])
        # the plain SwiGLU with its compiled tail warns of nothing (its exp's overflow it silences
        # itself): no np.errstate around it, 10 us a layer with the caches cold
        self._quiet_activation = activation is swiglu and _fused.compiled_kernel("glu", "silu_mul_tail") is not None
        self._lock = threading.Lock()

    def fits(self, views: Sequence[ExpertView]) -> bool:
        """Whether ``views`` have this step's count and :attr:`layout` (types, shapes, byte counts)."""
        key = self.layout
        return len(views) == self.n and all(layout_key(v) == key for v in views)

    def run(self, x: np.ndarray, views: Sequence[ExpertView], weights: np.ndarray) -> np.ndarray | None:
        """``sum_i weights[i] * down_i(act(gate_i x) * up_i x)`` in slot order.

        Args:
            x: ``(1, n_embd)`` float32.
            views: the experts of slots ``0..n-1``, pinned, with :meth:`fits` true (the caller
                checks it: the step reads the memory the views give, as sized when it was made).
            weights: ``(n,)`` float32 routing weights in slot order.

        Returns:
            ``(1, n_embd)`` float32, a new array; None when another thread runs this step or a
            product saw a non-finite input (the caller takes the general path).

        Raises:
            ConfigError: ``views``, ``weights`` or ``x`` not of this step's count, shape and dtype.
        """
        n = self.n
        if len(views) != n or not self._fits_call(x, weights):
            raise ConfigError(
                f"RowStep of {n} experts: {len(views)} views, weights {weights.dtype}{weights.shape}, "
                f"x {x.dtype}{x.shape}"
            )
        if not self._lock.acquire(blocking=False):
            return None
        try:
            gate_up, down = self._gate_up, self._down
            addresses = gate_up.addresses
            for i, v in enumerate(views):
                addresses[i] = v.gate.address
                addresses[n + i] = v.up.address
                down.addresses[i] = v.down.address
            return self._compute(x, weights)
        finally:
            self._lock.release()

    def run_at(self, x: np.ndarray, ids: np.ndarray, addresses: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """:meth:`run` of the experts ``ids`` found in a table instead of views.

        Args:
            x: ``(1, n_embd)`` float32.
            ids: ``(n,)`` int64 expert ids in slot order.
            addresses: an :class:`~aioexperts._format.views.ExpertTable`'s ``(3, n_experts)`` int64
                addresses whose layout is this step's :attr:`layout` (the caller checks it), valid
                for the call (the hold that gave it lasts).
            weights: ``(n,)`` float32 routing weights in slot order.

        Returns:
            As :meth:`run`.

        Raises:
            ConfigError: ``ids``, ``weights`` or ``x`` not of this step's count, shape and dtype,
                an id outside the table, or ``addresses`` not ``(3, n_experts)`` int64.
        """
        n = self.n
        if (
            ids.shape != (n,)
            or ids.dtype != np.int64
            or addresses.dtype != np.int64
            or addresses.ndim != 2
            or addresses.shape[0] != 3
            or not self._fits_call(x, weights)
        ):
            raise ConfigError(
                f"RowStep of {n} experts: ids {ids.dtype}{ids.shape}, addresses {addresses.dtype}{addresses.shape}, "
                f"weights {weights.dtype}{weights.shape}, x {x.dtype}{x.shape}"
            )
        if not self._lock.acquire(blocking=False):
            return None
        try:
            # one compiled call looks the ids up and checks them (an id out of range writes nothing)
            if not self._gather(addresses, ids, self._gate_up.addresses, self._down.addresses):
                raise ConfigError(f"RowStep: expert ids {ids.tolist()} outside the table's 0..{addresses.shape[1] - 1}")
            return self._compute(x, weights)
        finally:
            self._lock.release()

    def _fits_call(self, x: np.ndarray, weights: np.ndarray) -> bool:
        return (
            weights.dtype == np.float32
            and weights.shape == (self.n,)
            and x.dtype == np.float32
            and x.shape == self._x.shape
        )

    def _compute(self, x: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """The products, activation and sum over the addresses set (the lock held)."""
        np.copyto(self._x, x)
        if not self._gate_up.run():
            return None
        g, u = self._gu_halves
        if self._quiet_activation:
            swiglu(g, u, self._tmp, self._act)
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                self._activation(g, u, self._tmp, self._act)
        if not self._down.run():
            return None
        out = np.empty((1, self._ys.shape[1]), dtype=np.float32)
        self._sum(self._ys, weights, out[0])
        return out


def row_step(views: Sequence[ExpertView], activation: GatedActivation) -> RowStep | None:
    """A :class:`RowStep` for ``views`` (checked, one token's distinct experts), or None where one
    does not serve: more than one class, gate and up of different types, no group kernel, no
    compiled sum."""
    classes = group_classes(views)
    if classes is None or len(classes) != 1 or views[0].gate.ggml_type != views[0].up.ggml_type:
        return None
    if _fused.compiled_kernel("combine", "weighted_rows_sum") is None:
        return None
    return RowStep(views, activation)


def row_step_for_layout(layout: LayoutKey, n: int, activation: GatedActivation) -> RowStep | None:
    """:func:`row_step` of ``n`` experts that all have ``layout`` (a layer's
    :class:`~aioexperts._format.views.ExpertTable`), or None where :func:`row_step` would give none
    for such views: gate and up not of one type and shape, a down width other than the gate's, no
    group kernel for a type, no compiled sum. The caller checked the shapes against the model."""
    (gate_t, up_t, down_t), (gate_shape, up_shape, down_shape), _ = layout
    if n < 1 or gate_t != up_t or len(down_shape) != 2:
        return None
    if not _class_served(gate_t, up_t, down_t, gate_shape, up_shape, down_shape):
        return None
    if _fused.compiled_kernel("combine", "weighted_rows_sum") is None:
        return None
    return RowStep.for_layout(layout, n, activation)
