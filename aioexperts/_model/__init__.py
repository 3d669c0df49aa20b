"""The whole-model forward pass: weights, KV cache, blocks, :class:`Model`, :func:`load`.

How an architecture plugs in (the deepseek2 MLA block is added this way):

1. **Record** (``aioexperts/_format/archs/deepseek2.py``, the architecture's module of the registry,
   beside its MoE rules): ``model=ArchitectureRecord("deepseek2", RopeType.NORM, "deepseek2.cpp",
   dense_lead=True, block="mla")``; from outside the package, ``archs.register_architecture(record)``.
   The record names the RoPE pairing, the FFN-norm tensor (``ffn_norm``), whether leading dense
   blocks exist and the block implementation. :func:`~aioexperts._format.architectures.model_hparams` then resolves the
   generic keys (heads, head sizes, RoPE base/scaling/YaRN in ``RopeParams``, eps, context length,
   vocabulary, EOG ids) and keeps every ``{arch}.*`` key in ``ModelHParams.metadata`` (for
   ``attention.q_lora_rank``, ``kv_lora_rank``, ``key_length_mla`` ...); ``ModelHParams.yarn_log_mul``
   holds ``rope.scaling.yarn_log_multiplier`` for deepseek2. Until a record exists, ``load()``
   refuses the architecture with ``UnsupportedTypeError`` before opening the store.
2. **Block** (``aioexperts/_model/blocks.py``): ``register_block("mla", factory)`` where
   ``factory(hparams, reader, layer) -> AttentionBlock`` reads the layer's tensors with the
   :class:`~aioexperts._model.weights.TensorReader` (``reader.matrix(name, shape)`` keeps a matrix in
   its ggml type and multiplies through the compiled kernels; ``reader.array(name, shape)`` gives
   float32 for norms, biases and 3-D tensors such as ``attn_k_b``), and the block implements
   ``cache_shapes() -> {name: per-position shape}`` and ``attention(x, cache, start) -> y``.
3. **KV cache**: for each layer the model allocates ``(n_ctx, *shape)`` float32 for every entry
   of ``cache_shapes()`` once per sequence (``aioexperts/_model/kvcache.py``); the MLA block
   (``aioexperts/_model/mla_block.py``) returns ``{"kv": (kv_lora_rank + n_rot,)}``. ``attention`` writes positions
   ``start..start+n-1`` and reads ``0..start+n-1``.

The norms around the block (``attn_norm``, the record's ``ffn_norm``), the residual adds, the
dense leading blocks (``ffn_gate/up/down``, SwiGLU), the MoE layers (:class:`~aioexperts.MoERunner`),
the output norm and the (possibly tied) head are the model's and need nothing from the block.
The RoPE maths is :mod:`aioexperts._compute.rope` (``rope_cos_sin``, ``apply_rope``), attention
:mod:`aioexperts._compute.attention` (``attend``), RMSNorm :mod:`aioexperts._compute.norms`.
"""

from aioexperts._model import (
    dsv4_block,  # noqa: F401  (registers the "dsv4" block of deepseek4)
    mla_block,  # noqa: F401  (registers the "mla" block of deepseek2)
    qwen35_blocks,  # noqa: F401  (registers the "qwen35" blocks of qwen35moe)
)
from aioexperts._model.model import Model, ModelStatistics, load
from aioexperts._model.sessions import Generation, ModelSequence

__all__ = ("Generation", "Model", "ModelSequence", "ModelStatistics", "load")
