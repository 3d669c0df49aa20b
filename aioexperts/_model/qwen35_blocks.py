"""Qwen3.5-MoE's two attention blocks: the gated delta net and the gated full attention.

Registered as block ``"qwen35"`` (:func:`~aioexperts._model.blocks.register_block`) for the
``qwen35moe`` record: the factory builds, per layer, the kind the file's pattern gives
(:class:`~aioexperts._format.delta_net.DeltaNetHParams`), as src/models/qwen35moe.cpp does.

- :class:`GatedDeltaNetBlock` (``build_layer_attn_linear``): linear attention whose per-sequence
  state (the convolution's last ``d_conv - 1`` inputs and one ``(head_v, head_k)`` matrix per value
  head) replaces the KV cache; it declares it with ``state_shapes()``
  (:class:`~aioexperts._model.blocks.RecurrentBlock`). The maths is :mod:`aioexperts._compute.delta_net`.
- :class:`GatedAttentionBlock` (``build_layer_attn``): ``attn_q`` gives per head ``[q | gate]``;
  q and k RMSNorm'd per head, IMRoPE (for text tokens every section has the token's position, so
  it is NEOX on the first ``rope.dimension_count`` dims), causal softmax, output times
  ``sigmoid(gate)``, then ``attn_output``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from aioexperts._compute import delta_net
from aioexperts._compute.attention import attend
from aioexperts._compute.gating import sigmoid
from aioexperts._compute.norms import rms_norm
from aioexperts._compute.rope import apply_rope, rope_table
from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.architectures import ModelHParams
from aioexperts._format.delta_net import DeltaNetHParams
from aioexperts._model.blocks import AttentionBlock, register_block
from aioexperts._model.weights import TensorReader

__all__ = ("GatedAttentionBlock", "GatedDeltaNetBlock", "qwen35_block")

# per-tensor scales (build_lora_mm's *_s), fused or biased projections: not in this forward pass
_LINEAR_UNSUPPORTED = ("attn_qkv.scale", "attn_gate.scale", "ssm_beta.scale", "ssm_alpha.scale", "ssm_out.scale")
_FULL_UNSUPPORTED = (
    "attn_qkv.weight",
    "attn_q.scale",
    "attn_k.scale",
    "attn_v.scale",
    "attn_output.scale",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_output.bias",
)


def _refuse(reader: TensorReader, prefix: str, names: tuple[str, ...], arch: str) -> None:
    for name in names:
        if reader.has(prefix + name):
            raise UnsupportedTypeError(f"tensor {prefix + name!r} is not supported by the {arch} forward pass")


class GatedDeltaNetBlock:
    """One gated delta net layer (:class:`~aioexperts._model.blocks.RecurrentBlock`; module docstring).

    Raises (at construction):
        FormatError: a tensor is missing or misshaped, or holds NaN (vectors).
        UnsupportedTypeError: per-tensor ``*.scale`` tensors.
    """

    def __init__(self, hp: ModelHParams, dn: DeltaNetHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        _refuse(reader, p, _LINEAR_UNSUPPORTED, hp.arch)
        self.dn = dn
        self.eps = hp.norm_eps
        n_embd, channels = hp.n_embd, dn.conv_channels
        self.wqkv = reader.matrix(p + "attn_qkv.weight", (channels, n_embd))
        self.wgate = reader.matrix(p + "attn_gate.weight", (dn.d_inner, n_embd))
        self.wbeta = reader.matrix(p + "ssm_beta.weight", (dn.n_v_heads, n_embd))
        self.walpha = reader.matrix(p + "ssm_alpha.weight", (dn.n_v_heads, n_embd))
        self.wout = reader.matrix(p + "ssm_out.weight", (n_embd, dn.d_inner))
        self.conv = reader.array(p + "ssm_conv1d.weight", (channels, dn.d_conv))
        self.dt_bias = reader.array(p + "ssm_dt.bias", (dn.n_v_heads,))
        self.a = reader.array(p + "ssm_a", (dn.n_v_heads,))
        self.norm = reader.array(p + "ssm_norm.weight", (dn.head_v,))
        delta_net.warmup()  # compiles the delta rule's kernel at load, not in the first forward

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Nothing per position: the state replaces the KV cache."""
        return {}

    def state_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``{"conv": (d_conv - 1, conv_channels), "ssm": (n_v_heads, head_v, head_k)}``."""
        dn = self.dn
        return {"conv": (dn.d_conv - 1, dn.conv_channels), "ssm": (dn.n_v_heads, dn.head_v, dn.head_k)}

    def delta_output(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> tuple[np.ndarray, np.ndarray]:
        """The delta rule's output ``o`` ``(n, n_v_heads, head_v)`` and the gate ``z`` of the same shape
        for the normed input ``x`` ``(n, n_embd)`` float32, advancing the state in ``cache``
        (``start == 0`` starts it from zeros)."""
        dn = self.dn
        n = x.shape[0]
        conv_state, ssm_state = cache["conv"], cache["ssm"]
        if start == 0:
            conv_state[...] = 0.0
            ssm_state[...] = 0.0
        qkv = self.wqkv(x)
        z = self.wgate(x).reshape(n, dn.n_v_heads, dn.head_v)
        beta = sigmoid(self.wbeta(x))
        g = delta_net.softplus(self.walpha(x) + self.dt_bias) * self.a
        mixed = delta_net.silu(delta_net.causal_conv(qkv, conv_state, self.conv))
        kw = dn.n_k_heads * dn.head_k
        q = delta_net.l2_norm(mixed[:, :kw].reshape(n, dn.n_k_heads, dn.head_k), self.eps)
        k = delta_net.l2_norm(mixed[:, kw : 2 * kw].reshape(n, dn.n_k_heads, dn.head_k), self.eps)
        v = np.ascontiguousarray(mixed[:, 2 * kw :]).reshape(n, dn.n_v_heads, dn.head_v)
        return delta_net.delta_rule(q, k, v, g, beta, ssm_state), z

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`~aioexperts._model.blocks.AttentionBlock`: ``ssm_out(RMSNorm(o) * ssm_norm * silu(z))``."""
        o, z = self.delta_output(x, cache, start)
        y = rms_norm(o, self.norm, self.eps) * delta_net.silu(z)
        return self.wout(np.ascontiguousarray(y.reshape(x.shape[0], self.dn.d_inner), dtype=np.float32))


class GatedAttentionBlock:
    """One gated full-attention layer (module docstring).

    Raises (at construction):
        FormatError: a tensor is missing or misshaped; ``key_length != value_length``;
            ``rope.dimension_count`` odd or larger than the head.
        UnsupportedTypeError: a fused ``attn_qkv``, biases, per-tensor ``*.scale`` tensors.
    """

    def __init__(self, hp: ModelHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        _refuse(reader, p, _FULL_UNSUPPORTED, hp.arch)
        self.hp = hp
        n_embd, nh, nkv, d = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_k
        if hp.head_v != d:  # qwen35moe.cpp: GGML_ASSERT(n_embd_head_v == n_embd_head_k)
            raise FormatError(f"{hp.arch}: attention key_length {d} and value_length {hp.head_v} must be equal")
        self.rope = hp.rope_for(layer)
        if not (0 < self.rope.n_rot <= d and self.rope.n_rot % 2 == 0):
            raise FormatError(f"{hp.arch}: rope.dimension_count={self.rope.n_rot} must be even and in 1..{d}")
        self.wq = reader.matrix(p + "attn_q.weight", (nh * 2 * d, n_embd))
        self.wk = reader.matrix(p + "attn_k.weight", (nkv * d, n_embd))
        self.wv = reader.matrix(p + "attn_v.weight", (nkv * d, n_embd))
        self.wo = reader.matrix(p + "attn_output.weight", (n_embd, nh * d))
        self.q_norm = reader.array(p + "attn_q_norm.weight", (d,))
        self.k_norm = reader.array(p + "attn_k_norm.weight", (d,))
        self.rope_table = rope_table(self.rope)
        self.scale = hp.attention_scale or 1.0 / math.sqrt(d)

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``{"k": (n_head_kv, head), "v": (n_head_kv, head)}``."""
        return {"k": (self.hp.n_head_kv, self.hp.head_k), "v": (self.hp.n_head_kv, self.hp.head_v)}

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`~aioexperts._model.blocks.AttentionBlock`."""
        hp = self.hp
        n, nh, nkv, d = x.shape[0], hp.n_head, hp.n_head_kv, hp.head_k
        q_full = self.wq(x).reshape(n, nh, 2 * d)
        gate = np.ascontiguousarray(q_full[:, :, d:]).reshape(n, nh * d)
        q = rms_norm(q_full[:, :, :d], self.q_norm, hp.norm_eps)
        k = rms_norm(self.wk(x).reshape(n, nkv, d), self.k_norm, hp.norm_eps)
        cos, sin = self.rope_table.cos_sin(start, n)
        q = apply_rope(q, cos, sin, self.rope.rope_type, self.rope.n_rot)
        k = apply_rope(k, cos, sin, self.rope.rope_type, self.rope.n_rot)
        kc, vc = cache["k"], cache["v"]
        kc[start : start + n] = k
        vc[start : start + n] = self.wv(x).reshape(n, nkv, d)
        out = attend(q, kc[: start + n], vc[: start + n], start, self.scale)
        return self.wo(np.ascontiguousarray(out * sigmoid(gate), dtype=np.float32))


def qwen35_block(hp: ModelHParams, reader: TensorReader, layer: int) -> AttentionBlock:
    """The block of ``layer``: a gated delta net where the file's pattern makes it recurrent, else
    gated full attention (qwen35moe.cpp ``is_recr``).

    Raises:
        FormatError: a missing or malformed ``ssm.*`` key, a tensor missing or misshaped.
        UnsupportedTypeError: as the blocks.
    """
    dn = DeltaNetHParams.from_metadata(hp.arch, reader.model.metadata, hp.n_layer)
    if dn.recurrent[layer]:
        return GatedDeltaNetBlock(hp, dn, reader, layer)
    return GatedAttentionBlock(hp, reader, layer)


register_block("qwen35", qwen35_block)
