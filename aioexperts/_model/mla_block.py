"""The deepseek2 attention block: multi-head latent attention (MLA) over a latent KV cache.

Registered as block ``"mla"`` (:func:`~aioexperts._model.blocks.register_block`) for the
``deepseek2`` record of :data:`~aioexperts._format.architectures.ARCHITECTURES`. The maths is
:mod:`aioexperts._compute.mla` (src/models/deepseek2.cpp, the ``is_mla`` branch); this module reads
the layer's tensors and wires the model's RoPE and YaRN factors in. The matrices stay in their ggml
type (``attn_k_b`` / ``attn_v_b`` as one matrix per head); the KV cache keeps, per position, the
``kv_lora_rank`` normalised latent and the ``rope.dimension_count`` rotated key (``{"kv": (C + R,)}``),
not per-head keys and values.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aioexperts._compute import mla
from aioexperts._compute.rope import apply_rope, rope_cos_sin
from aioexperts._errors import UnsupportedTypeError
from aioexperts._format.architectures import ModelHParams
from aioexperts._format.mla import MLAHParams
from aioexperts._model.blocks import register_block
from aioexperts._model.weights import TensorReader

__all__ = ("MLABlock",)

_UNSUPPORTED = ("attn_kv_b.weight", "attn_q_b.scale", "attn_kv_a_mqa.scale", "attn_output.scale", "attn_q.scale")


class MLABlock:
    """One layer's MLA attention (:class:`~aioexperts._model.blocks.AttentionBlock`).

    Args:
        hp: the model's hyper-parameters (RoPE of the layer, ``deepseek2`` record).
        reader: reads the layer's tensors (blocking).
        layer: block index.

    Raises:
        FormatError: a tensor of :meth:`MLAHParams.tensor_shapes` is missing or misshaped, a norm
            holds NaN, an MLA key is missing or out of range.
        UnsupportedTypeError: an old unsplit ``attn_kv_b`` file, per-tensor ``*.scale`` tensors.
    """

    def __init__(self, hp: ModelHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        for name in _UNSUPPORTED:
            if reader.has(p + name):
                raise UnsupportedTypeError(f"tensor {p + name!r} is not supported by the deepseek2 forward pass")
        self.mla = MLAHParams.from_metadata(hp.arch, reader.model.metadata)
        shapes = self.mla.tensor_shapes(layer)

        def matrix(name: str) -> mla.Matmul:
            rows, cols = shapes[p + name + ".weight"]
            return reader.matrix(p + name + ".weight", (rows, cols))

        def heads(name: str) -> list[mla.Matmul]:
            n, rows, cols = shapes[p + name + ".weight"]
            return list(reader.head_matrices(p + name + ".weight", (n, rows, cols)))

        lite = self.mla.q_lora_rank == 0
        self.weights = mla.MLAWeights(
            q_a=None if lite else matrix("attn_q_a"),
            q_a_norm=None if lite else reader.array(p + "attn_q_a_norm.weight", shapes[p + "attn_q_a_norm.weight"]),
            q_b=matrix("attn_q") if lite else matrix("attn_q_b"),
            kv_a=matrix("attn_kv_a_mqa"),
            kv_a_norm=reader.array(p + "attn_kv_a_norm.weight", shapes[p + "attn_kv_a_norm.weight"]),
            k_b=heads("attn_k_b"),
            v_b=heads("attn_v_b"),
            output=matrix("attn_output"),
        )
        self.rope = hp.rope_for(layer)
        # deepseek2.cpp: kq_scale from llama_context's attn_factor and freq_scale (YaRN's mscale)
        self.scale = mla.kq_scale(self.mla, self.rope.attn_factor, self.rope.freq_scale)

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``{"kv": (kv_lora_rank + rope_dims,)}``: the latent and the rotated key of each position."""
        return {"kv": (self.mla.cache_width,)}

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`~aioexperts._model.blocks.AttentionBlock`."""
        n_rot = self.rope.n_rot
        cos, sin = rope_cos_sin(self.rope, np.arange(start, start + x.shape[0]))

        def rope(v: np.ndarray, positions: np.ndarray) -> np.ndarray:
            return apply_rope(v, cos, sin, self.rope.rope_type, n_rot)

        return mla.mla_attention(x, start, self.weights, self.mla, cache["kv"], rope, self.scale)


register_block("mla", MLABlock)
