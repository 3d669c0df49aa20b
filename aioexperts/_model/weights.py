"""The dense (non-expert) weights of a model, read once at load and kept in their ggml type.

A :class:`DenseMatrix` keeps the raw ggml bytes of one matrix and multiplies through the compiled
kernels of :func:`aioexperts._compute.fused.linear` (llama.cpp's ``ggml_mul_mat``); vectors (norms,
biases, sinks) are dequantized to float32. A :class:`TensorReader` reads tensors of a parsed model
with their shapes checked, and counts the bytes it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioexperts._compute import fused
from aioexperts._compute.activations import round_activations
from aioexperts._compute.grouped import SplitPlan, product_task, split_plan
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import ConfigError, FormatError
from aioexperts._format.dequant import dequantize
from aioexperts._format.model import GGUFModel
from aioexperts._model.hugepages import huge_empty

__all__ = ("DenseMatrix", "TensorReader", "invariant_products", "stack_rows")


@dataclass(frozen=True, slots=True, eq=False)
class DenseMatrix:
    """One matrix ``W`` of shape ``(rows, cols)`` (numpy order) in its ggml type.

    Attributes:
        name: the GGUF tensor name.
        raw: the ggml bytes, ``uint8``, read-only.
        ggml_type: their type.
        shape: ``(rows, cols)``.
    """

    name: str
    raw: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    # one-token split plans by (parts, task address): made on a decode step's first use
    _plans: dict[tuple[int, int], SplitPlan] = field(default_factory=dict, init=False, repr=False)

    @property
    def n_bytes(self) -> int:
        """Bytes held."""
        return int(self.raw.nbytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.n_bytes // self.shape[0]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: ``(n_tokens, cols)`` float32 -> new ``(n_tokens, rows)`` float32.

        ``x`` is rounded as llama.cpp's CPU product rounds it for this type: to its vec_dot_type
        under the default precision (:func:`aioexperts._compute.fused.linear`), to F16/BF16 for such
        weights under ``"float"`` (:func:`aioexperts._compute.activations.round_activations`).
        """
        return fused.linear(self.raw, self.ggml_type, self.shape, _float_rounding(x, self.ggml_type))

    def invariant(self, x: np.ndarray, row_range: tuple[int, int] | None = None, *, split: bool = True) -> np.ndarray:
        """``x @ W.T`` with each row of ``x`` bit for bit its one-row result :meth:`__call__`
        (:func:`aioexperts._compute.fused.linear_rows`): cross-request batching stacks the rows of
        several sequences. ``row_range`` ``(r0, r1)``: only the output columns ``r0..r1-1``
        (weight rows), ``(n_tokens, r1 - r0)``, each the same numbers as in the whole product.
        ``split``: False keeps the product on the calling thread (its caller splits the rows).
        """
        r0, r1 = (0, self.shape[0]) if row_range is None else row_range
        raw = self.raw if (r0, r1) == (0, self.shape[0]) else self.raw[r0 * self.row_bytes : r1 * self.row_bytes]
        x = _float_rounding(x, self.ggml_type)
        return fused.linear_rows(raw, self.ggml_type, (r1 - r0, self.shape[1]), x, split=split)

    def split_plan(self, parts: int) -> SplitPlan | None:
        """The one-token product's fan-out plan over about ``4 * parts`` row ranges (made on first
        use, then kept: each output row has its one-token bits however split); None where no
        fan-out task serves the type (float precision, numpy backend)."""
        task = product_task(self.ggml_type)
        if task is None:
            return None
        plan = self._plans.get((parts, task.address))
        if plan is None:
            plan = split_plan(self.ggml_type, self.raw, self.shape, 4 * parts)
            if plan is None:
                return None
            self._plans[(parts, task.address)] = plan
        return plan

    def rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows ``ids`` dequantized: ``(len(ids), cols)`` float32 (token embeddings)."""
        idx = np.asarray(ids, dtype=np.int64)
        picked = np.ascontiguousarray(self.raw.reshape(self.shape[0], -1)[idx])
        return dequantize(picked, self.ggml_type, (len(idx), self.shape[1]))


def _float_rounding(x: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``x`` rounded to F16/BF16 weights' type under the ``"float"`` precision (the default
    precision rounds every product's ``x`` inside :func:`aioexperts._compute.fused.linear`)."""
    return round_activations(x, ggml_type) if fused.precision() == "float" else x


def stack_rows(name: str, matrices: Sequence[DenseMatrix]) -> tuple[DenseMatrix, list[DenseMatrix]] | None:
    """``matrices`` (one ggml type, one column count) moved into one buffer, rows after rows.

    Returns the stacked matrix ``name`` and each of ``matrices`` again as a view of its rows in it
    (the same bytes: no memory is added once the originals are dropped), or None when the types or
    column counts differ. One product with the stacked matrix gives, column range by column range,
    bit for bit each matrix's own product (rows are independent): llama.cpp's fused ``attn_qkv``,
    made at load so that a decode step's q/k/v split over the pool as one product.
    """
    if not matrices or len({(m.ggml_type, m.shape[1]) for m in matrices}) != 1:
        return None
    raw = huge_empty(sum(m.n_bytes for m in matrices))
    np.concatenate([m.raw for m in matrices], out=raw)
    raw.flags.writeable = False
    rows = [m.shape[0] for m in matrices]
    stacked = DenseMatrix(name, raw, matrices[0].ggml_type, (sum(rows), matrices[0].shape[1]))
    views: list[DenseMatrix] = []
    offset = 0
    for m in matrices:
        views.append(DenseMatrix(m.name, raw[offset : offset + m.n_bytes], m.ggml_type, m.shape))
        offset += m.n_bytes
    return stacked, views


#: weight rows of one part of a split product at least (smaller matrices are not split)
SPLIT_MIN_ROWS = 256


def invariant_products(products: Sequence[tuple[DenseMatrix, np.ndarray]], parts: int) -> list[np.ndarray]:
    """Every ``W.invariant(x)`` of ``products``, each split into up to ``parts`` ranges of weight
    rows that run through the compute pool's :meth:`~aioexperts._compute.pool.ComputePool.map`
    (the calling thread and the idle workers: never more threads than the pool has).

    Every output row is the same numbers however the product is split (weight rows are independent).
    For a batched decode step (several sequences' rows in one compute job), whose products would
    otherwise run on one core. Returns ``(n_tokens, rows)`` float32 per product, in order.
    """
    if all(x.shape[0] == 1 for _, x in products):
        split = [_one_token_split(w, x, parts) for w, x in products]
        if all(y is not None for y in split):
            return [y for y in split if y is not None]
    items: list[tuple[int, DenseMatrix, np.ndarray, tuple[int, int]]] = []
    for k, (w, x) in enumerate(products):
        rows = w.shape[0]
        n = max(1, min(parts, rows // SPLIT_MIN_ROWS))
        items.extend((k, w, x, (rows * i // n, rows * (i + 1) // n)) for i in range(n))
    # a lone product may split itself (fused.SPLIT_MIN_BYTES); the parts of a split one run whole on
    # their thread (a nested split would only find the other threads busy with the other parts)
    alone = len(items) == 1
    done = compute_pool().map(lambda item: item[1].invariant(item[2], item[3], split=alone), items)
    outs: list[np.ndarray] = []
    for k in range(len(products)):
        pieces = [y for item, y in zip(items, done, strict=True) if item[0] == k]
        outs.append(pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1))
    return outs


def _one_token_split(w: DenseMatrix, x: np.ndarray, parts: int) -> np.ndarray | None:
    """``w.invariant(x)`` of one token as one fan-out of row ranges over the pool (a
    :class:`~aioexperts._compute.grouped.SplitPlan` kept on ``w``: each row its one-token bits);
    None where no fan-out task serves the type (float precision, numpy backend) or ``x`` is not finite."""
    plan = w.split_plan(parts)
    if plan is None:
        return None
    xs = x if x.dtype == np.float32 and x.flags.c_contiguous else np.ascontiguousarray(x, dtype=np.float32)
    if xs.shape != (1, w.shape[1]):
        raise ConfigError(f"{w.name}: x {x.shape} for a matrix of {w.shape[1]} columns")
    out = np.empty((1, w.shape[0]), dtype=np.float32)
    return out if plan.run(xs, out[0]) else None


class TensorReader:
    """Reads tensors of ``model`` (blocking ``pread``; from a worker thread), checking their shapes.

    Attributes:
        model: the parsed model.
        n_bytes: bytes of everything read so far (matrices in their ggml type, vectors as float32).
    """

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.n_bytes = 0

    def has(self, name: str) -> bool:
        """Whether the model has tensor ``name``."""
        return name in self.model.tensors

    def _checked(
        self, name: str, shape: tuple[int, ...] | None
    ) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        info = self.model.tensor(name)  # FormatError when missing
        if shape is not None and info.shape != tuple(shape):
            raise FormatError(f"{self.model.path}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}")
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        if info.n_bytes != math.prod(info.dims) // block * type_size:
            raise FormatError(f"{self.model.path}: tensor {name!r} has {info.n_bytes} bytes for dims {info.dims}")
        raw = huge_empty(info.n_bytes)  # streamed once per token: on 2 MiB pages
        self.model.read_tensor_into(name, raw)
        raw.flags.writeable = False
        return raw, info.ggml_type, info.shape

    def matrix(self, name: str, shape: tuple[int, int] | None = None) -> DenseMatrix:
        """The 2-D tensor ``name`` kept in its ggml type.

        Raises:
            FormatError: missing, not 2-D, or not of ``shape``; truncated.
        """
        raw, qtype, got = self._checked(name, shape)
        if len(got) != 2:
            raise FormatError(f"{self.model.path}: tensor {name!r} has shape {got}, expected a matrix")
        self.n_bytes += raw.nbytes
        return DenseMatrix(name, raw, qtype, (int(got[0]), int(got[1])))

    def head_matrices(self, name: str, shape: tuple[int, int, int]) -> list[DenseMatrix]:
        """The 3-D tensor ``name`` of numpy ``shape`` ``(n, rows, cols)`` as ``n`` matrices in its ggml type.

        For per-head weights such as deepseek2's ``attn_k_b`` / ``attn_v_b`` (ggml ``{cols, rows, n}``):
        matrix ``i`` is a zero-copy slice of the tensor's bytes.

        Raises:
            FormatError: missing, not of ``shape``, truncated.
        """
        raw, qtype, got = self._checked(name, shape)
        self.n_bytes += raw.nbytes
        n, rows, cols = (int(d) for d in got)
        per = raw.nbytes // n
        return [DenseMatrix(f"{name}[{i}]", raw[i * per : (i + 1) * per], qtype, (rows, cols)) for i in range(n)]

    def optional_matrix(self, name: str, shape: tuple[int, int] | None = None) -> DenseMatrix | None:
        """:meth:`matrix`, or None when the model has no such tensor."""
        return self.matrix(name, shape) if self.has(name) else None

    def array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor ``name`` dequantized to float32, numpy order.

        Raises:
            FormatError: missing, not of ``shape``, truncated, or holding NaN/inf.
        """
        raw, qtype, got = self._checked(name, shape)
        out = dequantize(raw, qtype, got)
        if not np.isfinite(out).all():
            raise FormatError(f"{self.model.path}: tensor {name!r} holds NaN or inf")
        self.n_bytes += out.nbytes
        return out

    def optional_array(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        """:meth:`array`, or None when the model has no such tensor."""
        return self.array(name, shape) if self.has(name) else None
