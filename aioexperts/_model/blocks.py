"""Attention blocks: the part of a transformer block between its attention norm and the residual add.

A block is built once per layer at load from the model's tensors (:data:`BLOCKS` maps an
:class:`~aioexperts._format.architectures.ArchitectureRecord`'s ``block`` name to a factory
``factory(hparams, reader, layer) -> AttentionBlock``) and then runs, per call, ``n_tokens`` new
positions of one sequence against that sequence's KV cache.

:class:`GQABlock` is llama.cpp's standard attention (``build_qkv`` + ``ggml_rope_ext`` +
``build_attn`` in src/llama-graph.cpp) with each architecture's own parts: Qwen2's q/k/v biases,
Qwen3's and GLM-4-MoE's per-head q/k RMSNorms (qwen3moe.cpp, glm4-moe.cpp), OLMoE's RMSNorms over the
whole q and k projections (olmoe.cpp), gpt-oss's output bias, sinks and sliding window
(openai-moe.cpp), Granite's attention scale (granite.cpp ``build_attention_layer``), partial rotary
(``n_rot`` < head size, GLM-4-MoE) and ``rope_freqs.weight`` frequency factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from aioexperts._compute import fused as _fused
from aioexperts._compute.attention import attend
from aioexperts._compute.decode_attention import RowAttention
from aioexperts._compute.norms import rms_norm
from aioexperts._compute.pool import compute_pool
from aioexperts._compute.rope import apply_rope, rope_table
from aioexperts._errors import ConfigError, UnsupportedTypeError
from aioexperts._format.architectures import ModelHParams, RopeType
from aioexperts._model.weights import TensorReader, invariant_products, stack_rows

__all__ = (
    "BLOCKS",
    "AttentionBlock",
    "BatchedAttentionBlock",
    "BlockFactory",
    "GQABlock",
    "RecurrentBlock",
    "register_block",
)


class AttentionBlock(Protocol):
    """What the model needs of one layer's attention.

    ``cache_shapes()`` gives the per-position shape of every array the block keeps in the KV cache;
    ``attention(x, cache, start)`` takes the normed input ``x`` ``(n_tokens, n_embd)`` float32 of
    positions ``start..start+n_tokens-1``, writes those positions into ``cache`` (the arrays of
    ``cache_shapes``, ``(n_ctx, *shape)`` float32) and returns the attention output after the output
    projection (and its bias), ``(n_tokens, n_embd)`` float32, before the residual add. It runs in a
    compute-pool worker; it may call :meth:`ComputePool.map` but must not block on I/O.
    """

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray: ...


@runtime_checkable
class BatchedAttentionBlock(AttentionBlock, Protocol):
    """A block that also runs one new position of several sequences at once (a batched decode step).

    ``attention_rows(x, caches, starts, parts)``: row ``i`` of ``x`` ``(n, n_embd)`` float32 is the
    position ``starts[i]`` of the sequence whose cache is ``caches[i]``; returns ``(n, n_embd)``
    float32, each row bit for bit what ``attention(x[i:i+1], caches[i], starts[i])`` returns (the
    dense products through batch-invariant kernels, split over up to ``parts`` compute-pool workers).
    Blocks without it run such a step one row at a time.
    """

    def attention_rows(
        self, x: np.ndarray, caches: Sequence[Mapping[str, np.ndarray]], starts: Sequence[int], parts: int
    ) -> np.ndarray: ...


@runtime_checkable
class RecurrentBlock(AttentionBlock, Protocol):
    """A block that keeps, besides (or instead of) per-position arrays, a per-sequence state that is
    not per position (a linear-attention layer: Qwen3.5's gated delta net).

    ``state_shapes()`` gives the shape of every such array; the KV cache allocates each once per
    sequence (float32 zeros) in the same per-layer dict as the ``cache_shapes`` arrays.
    ``attention(x, cache, start)`` advances the state by the ``n_tokens`` rows of ``x``: the state
    must hold exactly positions ``0..start-1`` (the model sees to it), and ``start == 0`` starts
    it afresh. A state cannot be rewound: :meth:`~aioexperts.ModelSequence.keep` of a shorter
    prefix makes the next call run the kept tokens again.
    """

    def state_shapes(self) -> Mapping[str, tuple[int, ...]]: ...


BlockFactory = Callable[[ModelHParams, TensorReader, int], AttentionBlock]
"""``factory(hparams, reader, layer) -> AttentionBlock``: reads the layer's tensors (blocking)."""


#: a key of GQABlock._row_steps with no step made yet (None: made, and none serves)
_UNMADE: RowAttention | None = object()  # type: ignore[assignment]


class GQABlock:
    """Grouped-query attention with RoPE (llama-graph.cpp ``build_qkv``, ``build_attn``; see module docstring).

    Raises (at construction):
        FormatError: a required tensor is missing or misshaped.
        UnsupportedTypeError: a fused ``attn_qkv`` tensor, or per-tensor scales (``*.scale``).
    """

    def __init__(self, hp: ModelHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        rec = hp.record
        for fused_name in ("attn_qkv.weight", "attn_q.scale", "attn_k.scale", "attn_v.scale", "attn_output.scale"):
            if reader.has(p + fused_name):
                raise UnsupportedTypeError(f"tensor {p + fused_name!r} is not supported by the {rec.name} forward pass")
        self.hp = hp
        self.layer = layer
        n_embd, nh, nkv, dk, dv = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_k, hp.head_v
        self.wq = reader.matrix(p + "attn_q.weight", (nh * dk, n_embd))
        self.wk = reader.matrix(p + "attn_k.weight", (nkv * dk, n_embd))
        self.wv = reader.matrix(p + "attn_v.weight", (nkv * dv, n_embd))
        self.wo = reader.matrix(p + "attn_output.weight", (n_embd, nh * dv))
        # q, k and v in one buffer (when one type): a decode step splits them as one product
        self.wqkv = None
        stacked = stack_rows(p + "attn_q+k+v", [self.wq, self.wk, self.wv])
        if stacked is not None:
            self.wqkv, (self.wq, self.wk, self.wv) = stacked
        # build_qkv adds the biases where the file has them (qwen2moe, gpt-oss)
        self.bq = reader.optional_array(p + "attn_q.bias", (nh * dk,))
        self.bk = reader.optional_array(p + "attn_k.bias", (nkv * dk,))
        self.bv = reader.optional_array(p + "attn_v.bias", (nkv * dv,))
        self.bo = reader.optional_array(p + "attn_output.bias", (n_embd,))
        self.q_norm = self.k_norm = None
        if rec.qk_norm is not None:
            q_shape, k_shape = ((dk,), (dk,)) if rec.qk_norm == "head" else ((nh * dk,), (nkv * dk,))
            if rec.qk_norm_required:
                self.q_norm = reader.array(p + "attn_q_norm.weight", q_shape)
                self.k_norm = reader.array(p + "attn_k_norm.weight", k_shape)
            else:
                self.q_norm = reader.optional_array(p + "attn_q_norm.weight", q_shape)
                self.k_norm = reader.optional_array(p + "attn_k_norm.weight", k_shape)
        self.sinks = reader.array(p + "attn_sinks.weight", (nh,)) if rec.sinks else None
        self.rope = hp.rope_for(layer)
        # llama-model.cpp get_rope_factors: rope_freqs.weight (llama 3 style), where the graph passes it
        self.freq_factors = None
        if rec.rope_freqs:
            self.freq_factors = reader.optional_array("rope_freqs.weight", (self.rope.n_rot // 2,))
        self.rope_table = rope_table(self.rope, self.freq_factors)  # cos/sin per position, computed once
        # kq_scale: granite's attention.scale, else 1/sqrt(head); openai-moe.cpp uses 1/sqrt(n_rot)
        if hp.attention_scale:
            self.scale = hp.attention_scale
        else:
            self.scale = 1.0 / math.sqrt(self.rope.n_rot if rec.name == "gpt-oss" else dk)
        self.window = hp.window(layer)
        # (pool threads, precision, kernel backend) -> one-token step: a switch of the arithmetic
        # or of the kernels after load takes another step (or none), as the executor's row steps do
        self._row_steps: dict[tuple[int, str, str], RowAttention | None] = {}

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``{"k": (n_head_kv, head_k), "v": (n_head_kv, head_v)}``."""
        return {"k": (self.hp.n_head_kv, self.hp.head_k), "v": (self.hp.n_head_kv, self.hp.head_v)}

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`AttentionBlock`. One position (a decode step) takes the block's prepared
        :class:`~aioexperts._compute.decode_attention.RowAttention` where it serves, else
        :meth:`attention_rows`: q, k and v split over the pool in one hand-off, not one each (the
        same bits either way)."""
        if x.shape[0] == 1:
            parts = compute_pool().n_threads
            step = self._row_step(parts)
            if step is not None:
                y = step.run(x, cache["k"], cache["v"], start)
                if y is not None:
                    return y
            return self.attention_rows(x, [cache], [start], parts)
        out = self._attend(self.wq(x), self.wk(x), self.wv(x), cache, start)
        return self._output(self.wo(out))

    def prepare_decode(self, parts: int) -> None:
        """Make the prepared one-token step for a pool of ``parts`` threads and the current
        precision and kernel backend now (at load), not in the first decode step (about 0.2 ms a
        block). Blocking (a worker thread)."""
        self._row_step(parts)

    def _row_step(self, parts: int) -> RowAttention | None:
        """The prepared one-token step for ``parts`` threads, the current precision and kernel
        backend (made on first use), or None where none serves."""
        key = (parts, _fused.precision(), _fused.backend().name)
        step = self._row_steps.get(key, _UNMADE)
        if step is _UNMADE:
            step = self._row_steps[key] = self._row_attention(parts)
        return step

    def _row_attention(self, parts: int) -> RowAttention | None:
        """The prepared one-token step of this block for a pool of ``parts`` threads, or None where
        it does not serve: biases, a whole-projection q/k norm, no stacked q/k/v, float precision or
        the numpy backend, RoPE other than NORM/NEOX, no vector flash kernel."""
        hp = self.hp
        if (
            self.wqkv is None
            or any(b is not None for b in (self.bq, self.bk, self.bv, self.bo))
            or hp.record.qk_norm not in (None, "head")
            or self.rope.rope_type not in (RopeType.NORM, RopeType.NEOX)
        ):
            return None
        qkv, wo = self.wqkv.split_plan(parts), self.wo.split_plan(parts)
        if qkv is None or wo is None:
            return None
        try:
            return RowAttention(
                qkv,
                wo,
                n_head=hp.n_head,
                n_head_kv=hp.n_head_kv,
                head_k=hp.head_k,
                head_v=hp.head_v,
                q_norm=self.q_norm,
                k_norm=self.k_norm,
                eps=hp.norm_eps,
                rope=self.rope_table,
                neox=self.rope.rope_type == RopeType.NEOX,
                n_rot=self.rope.n_rot,
                scale=self.scale,
                sinks=self.sinks,
                window=self.window,
            )
        except ConfigError:  # no vector flash kernel: the general path serves
            return None

    def attention_rows(
        self, x: np.ndarray, caches: Sequence[Mapping[str, np.ndarray]], starts: Sequence[int], parts: int
    ) -> np.ndarray:
        """See :class:`BatchedAttentionBlock`: q/k/v and the output projection once for every row
        (batch-invariant, split over ``parts`` workers), the attention of each row on its own cache."""
        n = x.shape[0]
        if self.wqkv is not None:
            (qkv,) = invariant_products([(self.wqkv, x)], parts)
            nq, nk = self.wq.shape[0], self.wk.shape[0]
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        else:
            q, k, v = invariant_products([(self.wq, x), (self.wk, x), (self.wv, x)], parts)
        if n == 1:  # a decode row: its attention on this thread (a one-item map, without the map)
            outs = [self._attend(q, k, v, caches[0], starts[0])]
        else:
            outs = compute_pool().map(
                lambda i: self._attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], caches[i], starts[i]), range(n)
            )
        (y,) = invariant_products([(self.wo, np.concatenate(outs))], parts)
        return self._output(y)

    def _attend(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: Mapping[str, np.ndarray], start: int
    ) -> np.ndarray:
        """From the q/k/v projections of ``n`` positions to the attention's heads ``(n, n_head * head_v)``
        (biases, q/k norms, RoPE, the cache write, softmax(q k^T) v)."""
        hp = self.hp
        n = q.shape[0]
        if self.bq is not None:
            q += self.bq
        if self.bk is not None:
            k += self.bk
        if self.bv is not None:
            v += self.bv
        if hp.record.qk_norm == "whole":  # olmoe.cpp: build_norm on the 2-D projections
            q = rms_norm(q, self.q_norm, hp.norm_eps)
            k = rms_norm(k, self.k_norm, hp.norm_eps)
        q3 = q.reshape(n, hp.n_head, hp.head_k)
        k3 = k.reshape(n, hp.n_head_kv, hp.head_k)
        if hp.record.qk_norm == "head":
            if self.q_norm is not None:
                q3 = rms_norm(q3, self.q_norm, hp.norm_eps)
            if self.k_norm is not None:
                k3 = rms_norm(k3, self.k_norm, hp.norm_eps)
        cos, sin = self.rope_table.cos_sin(start, n)
        q3 = apply_rope(q3, cos, sin, self.rope.rope_type, self.rope.n_rot)
        k3 = apply_rope(k3, cos, sin, self.rope.rope_type, self.rope.n_rot)
        kc, vc = cache["k"], cache["v"]
        kc[start : start + n] = k3
        vc[start : start + n] = v.reshape(n, hp.n_head_kv, hp.head_v)
        return attend(q3, kc[: start + n], vc[: start + n], start, self.scale, sinks=self.sinks, window=self.window)

    def _output(self, y: np.ndarray) -> np.ndarray:
        if self.bo is not None:
            y += self.bo
        return y


#: Block implementations by :attr:`ArchitectureRecord.block` name.
BLOCKS: dict[str, BlockFactory] = {"gqa": GQABlock}


def register_block(name: str, factory: BlockFactory) -> None:
    """Add (or replace) the block implementation ``name`` (see ``aioexperts/_model/__init__.py``)."""
    BLOCKS[name] = factory
