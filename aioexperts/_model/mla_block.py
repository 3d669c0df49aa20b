"""The deepseek2 attention block: multi-head latent attention (MLA) over a latent KV cache.

Registered as block ``"mla"`` (:func:`~aioexperts._model.blocks.register_block`) for the
``deepseek2`` record of :data:`~aioexperts._format.archs.MODEL_RECORDS`. The maths is
:mod:`aioexperts._compute.mla` (src/models/deepseek2.cpp, the ``is_mla`` branch); this module reads
the layer's tensors and wires the model's RoPE and YaRN factors in. The matrices stay in their ggml
type (``attn_k_b`` / ``attn_v_b`` as one matrix per head; an old file's ``attn_kv_b`` is split into
them, its key part dequantized to float32); the KV cache keeps, per position, the
``kv_lora_rank`` normalised latent and the ``rope.dimension_count`` rotated key (``{"kv": (C + R,)}``),
not per-head keys and values.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aioexperts._compute import mla
from aioexperts._compute.rope import apply_rope, rope_table
from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.architectures import ModelHParams
from aioexperts._format.mla import MLAHParams
from aioexperts._model.blocks import register_block
from aioexperts._model.weights import DenseMatrix, TensorReader

__all__ = ("MLABlock",)

_UNSUPPORTED = ("attn_q_a.scale", "attn_q_b.scale", "attn_q.scale", "attn_kv_a_mqa.scale", "attn_output.scale")


class MLABlock:
    """One layer's MLA attention (:class:`~aioexperts._model.blocks.AttentionBlock`).

    Args:
        hp: the model's hyper-parameters (RoPE of the layer, ``deepseek2`` record).
        reader: reads the layer's tensors (blocking).
        layer: block index.

    Raises:
        FormatError: a tensor of :meth:`MLAHParams.tensor_shapes` is missing or misshaped, a norm
            (or an old file's ``attn_kv_b``) holds NaN, an MLA key is missing or out of range.
        UnsupportedTypeError: per-tensor ``*.scale`` tensors; ``attn_kv_b`` next to ``attn_k_b``.
    """

    def __init__(self, hp: ModelHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        for name in _UNSUPPORTED:
            if reader.has(p + name):
                raise UnsupportedTypeError(f"tensor {p + name!r} is not supported by the deepseek2 forward pass")
        self.mla = MLAHParams.from_metadata(hp.arch, reader.model.metadata)
        if self.mla.split_kv_b and reader.has(p + "attn_kv_b.weight"):  # llama.cpp: wrong number of tensors
            raise UnsupportedTypeError(f"tensor {p}attn_kv_b.weight next to attn_k_b/attn_v_b: which one is meant?")
        shapes = self.mla.tensor_shapes(layer)

        def matrix(name: str) -> mla.Matmul:
            rows, cols = shapes[p + name + ".weight"]
            return reader.matrix(p + name + ".weight", (rows, cols))

        def heads(name: str) -> list[mla.Matmul]:
            n, rows, cols = shapes[p + name + ".weight"]
            return list(reader.head_matrices(p + name + ".weight", (n, rows, cols)))

        if self.mla.split_kv_b:
            k_b: mla.HeadMatrices = heads("attn_k_b")
            v_b: mla.HeadMatrices = heads("attn_v_b")
        else:
            k_b, v_b = _split_kv_b(reader, p + "attn_kv_b.weight", shapes[p + "attn_kv_b.weight"], self.mla)
        lite = self.mla.q_lora_rank == 0
        self.weights = mla.MLAWeights(
            q_a=None if lite else matrix("attn_q_a"),
            q_a_norm=None if lite else reader.array(p + "attn_q_a_norm.weight", shapes[p + "attn_q_a_norm.weight"]),
            q_b=matrix("attn_q") if lite else matrix("attn_q_b"),
            kv_a=matrix("attn_kv_a_mqa"),
            kv_a_norm=reader.array(p + "attn_kv_a_norm.weight", shapes[p + "attn_kv_a_norm.weight"]),
            k_b=k_b,
            v_b=v_b,
            output=matrix("attn_output"),
        )
        self.rope = hp.rope_for(layer)
        # deepseek2.cpp: kq_scale from llama_context's attn_factor and freq_scale (YaRN's mscale)
        self.scale = mla.kq_scale(self.mla, self.rope.attn_factor, self.rope.freq_scale)
        self.rope_table = rope_table(self.rope)  # cos/sin per position, computed once

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``{"kv": (kv_lora_rank + rope_dims,)}``: the latent and the rotated key of each position."""
        return {"kv": (self.mla.cache_width,)}

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`~aioexperts._model.blocks.AttentionBlock`."""
        n_rot = self.rope.n_rot
        cos, sin = self.rope_table.cos_sin(start, x.shape[0])

        def rope(v: np.ndarray, positions: np.ndarray) -> np.ndarray:
            return apply_rope(v, cos, sin, self.rope.rope_type, n_rot)

        return mla.mla_attention(x, start, self.weights, self.mla, cache["kv"], rope, self.scale)


def _split_kv_b(
    reader: TensorReader, name: str, shape: tuple[int, ...], hp: MLAHParams
) -> tuple[np.ndarray, list[mla.Matmul]]:
    """An old file's ``attn_kv_b``: the absorbed key part dequantized and transposed (float32, it cannot
    stay in a ggml type), the value rows of each head as zero-copy matrices (:func:`mla.split_kv_b`)."""
    rows, cols = shape
    kv_b = reader.matrix(name, (rows, cols))
    n, v, c = hp.nope_dims, hp.value_length, hp.kv_lora_rank
    k_b = np.stack([kv_b.rows(np.arange(h * (n + v), h * (n + v) + n)).T for h in range(hp.n_head)])
    if not np.isfinite(k_b).all():
        raise FormatError(f"{reader.model.path}: tensor {name!r} holds NaN or inf")
    reader.n_bytes += k_b.nbytes
    v_b: list[mla.Matmul] = []
    for h in range(hp.n_head):
        start = (h * (n + v) + n) * kv_b.row_bytes
        raw = kv_b.raw[start : start + v * kv_b.row_bytes]
        v_b.append(DenseMatrix(f"{name}[{h}].v", raw, kv_b.ggml_type, (v, c)))
    return np.ascontiguousarray(k_b), v_b


register_block("mla", MLABlock)
