"""A decode step's grouped-query attention, prepared once per block (one token of one sequence).

The general path (``GQABlock.attention_rows``) makes, per layer and token, the q/k/v product's
and the output projection's fan-outs through :func:`~aioexperts._model.weights.invariant_products`,
the per-head q/k norms and RoPE as four calls, and the flash attention's descriptor: about 140 us of
Python per layer with the caches cold from the weights. A :class:`RowAttention` keeps what does
not change between tokens (the products' :class:`~aioexperts._compute.grouped.SplitPlan`, the
buffers of q/k/v, the normed and rotated heads and the attention's output, the flash descriptor)
and runs: the q/k/v fan-out, one compiled call for the q and k norms and RoPE and the two cache
writes (:func:`aioexperts._compute.kernels.flash.norm_rope_store_kv`: the general path's
:func:`~aioexperts._compute.kernels.rope.norm_rope_heads` and numpy's float16 rounding), the flash
fan-out by KV head, the output fan-out. The kernels are the general path's, so the output has its
bits.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from aioexperts._compute import fused as _fused
from aioexperts._compute.grouped import SplitPlan
from aioexperts._compute.pool import compute_pool
from aioexperts._compute.rope import RopeTable
from aioexperts._errors import ConfigError

__all__ = ("RowAttention",)

_NONE = np.empty(0, dtype=np.float32)


class RowAttention:
    """One token's attention of a GQA block without biases (see the module docstring).

    Args:
        qkv: the plan of the stacked q/k/v product (``n_head * head_k + n_head_kv * (head_k + head_v)`` rows).
        wo: the plan of the output projection (``n_head * head_v`` columns).
        n_head, n_head_kv, head_k, head_v: the block's heads.
        q_norm, k_norm: ``(head_k,)`` float32 per-head RMSNorm weights, or None for no norm.
        eps: the norms' epsilon.
        rope: the block's cos/sin table; ``neox`` its pairing; ``n_rot`` the rotated dims.
        scale: the score scale (``kq_scale``).
        sinks: ``(n_head,)`` float32 sink logits or None.
        window: the sliding window in positions, 0 for none.

    Raises:
        ConfigError: shapes that do not fit, or no flash kernel serves (the numpy backend, no
            hardware float16, head sizes not multiples of 32).
    """

    def __init__(
        self,
        qkv: SplitPlan,
        wo: SplitPlan,
        *,
        n_head: int,
        n_head_kv: int,
        head_k: int,
        head_v: int,
        q_norm: np.ndarray | None,
        k_norm: np.ndarray | None,
        eps: float,
        rope: RopeTable,
        neox: bool,
        n_rot: int,
        scale: float,
        sinks: np.ndarray | None,
        window: int,
    ) -> None:
        nq, nk = n_head * head_k, n_head_kv * head_k
        if qkv.rows != nq + nk + n_head_kv * head_v or wo.cols != n_head * head_v or n_head % n_head_kv:
            raise ConfigError(f"RowAttention: plans of {qkv.rows} and {wo.cols} do not fit the heads")
        flash = _fused.flash_task_address()
        if flash is None or head_k % 32 or head_v % 32:
            raise ConfigError("RowAttention: no vector flash kernel serves")
        from .kernels import flash as flash_module

        self._flash: Any = flash_module  # untyped (the kernels package)
        self._flash_task = flash
        self.qkv, self.wo = qkv, wo
        self.n_head, self.n_head_kv, self.head_k, self.head_v = n_head, n_head_kv, head_k, head_v
        self._nq, self._nk = nq, nk
        # own writable copies: one compiled signature with the empty "no norm" (and the warm-up's)
        self._q_norm = _NONE if q_norm is None else np.array(q_norm, dtype=np.float32)
        self._k_norm = _NONE if k_norm is None else np.array(k_norm, dtype=np.float32)
        self._norms = (q_norm is not None, k_norm is not None)
        self._eps = np.float32(eps)
        self._rope, self._neox, self._n_rot = rope, neox, n_rot
        self._scale = np.float32(scale)
        self._sinks = _NONE if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
        self._window = window
        f32 = np.float32
        self._qkv_out = np.empty((1, qkv.rows), dtype=f32)
        self._q_tmp, self._q3 = np.empty((1, n_head, head_k), f32), np.empty((1, n_head, head_k), f32)
        self._k_tmp, self._k3 = np.empty((1, n_head_kv, head_k), f32), np.empty((1, n_head_kv, head_k), f32)
        self._attn = np.empty((1, n_head, head_v), dtype=f32)
        # the views a token's step reads and writes, made once (each a few microseconds per layer
        # with the caches cold after the weights)
        out = self._qkv_out
        self._qkv_row = out[0]
        self._q_heads = out[:, :nq].reshape(1, n_head, head_k)
        self._k_heads = out[:, nq : nq + nk].reshape(1, n_head_kv, head_k)
        self._v_heads = out[0, nq + nk :].reshape(n_head_kv, head_v)
        self._attn_row = self._attn.reshape(1, -1)
        # the general path's fan-out descriptor, the cache's fields set per token
        self._desc = self._flash.flash_descriptor(
            self._q3, n_head_kv, head_v, self._scale, self._sinks, window, self._attn
        )
        self._desc_address = self._desc.ctypes.data
        self._busy = threading.Lock()

    def run(self, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int) -> np.ndarray | None:
        """The attention output ``(1, n_embd)`` float32 (a new array) of the token ``x`` ``(1, n_embd)``
        float32 at position ``start``, its key and value written at ``start`` of the float16 caches
        ``(n_ctx, n_head_kv, head)`` (C-contiguous); None when the step is busy (another thread's
        token), ``x`` is not finite, or the arguments are not as said: the caller takes the general
        path, which has the same bits and raises its errors."""
        if (
            x.dtype != np.float32
            or x.shape != (1, self.qkv.cols)
            or not x.flags.c_contiguous
            or k_cache.dtype != np.float16
            or v_cache.dtype != np.float16
            or k_cache.shape[1:] != (self.n_head_kv, self.head_k)
            or v_cache.shape[1:] != (self.n_head_kv, self.head_v)
            or not k_cache.flags.c_contiguous
            or not v_cache.flags.c_contiguous
            or not 0 <= start < min(k_cache.shape[0], v_cache.shape[0])
        ):
            return None
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._run(x, k_cache, v_cache, start)
        finally:
            self._busy.release()

    def _run(self, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int) -> np.ndarray | None:
        if not self.qkv.run(x, self._qkv_row):
            return None
        cos, sin = self._rope.cos_sin(start, 1)
        norm_q, norm_k = self._norms
        k16, v16 = k_cache.view(np.uint16), v_cache.view(np.uint16)
        # the q and k norms and RoPE and the two cache writes: one compiled call
        self._flash.norm_rope_store_kv(
            self._q_heads,
            norm_q,
            self._q_norm,
            self._q_tmp,
            self._q3,
            self._k_heads,
            norm_k,
            self._k_norm,
            self._k_tmp,
            self._k3,
            self._v_heads,
            self._eps,
            cos,
            sin,
            self._neox,
            self._n_rot,
            k16,
            v16,
            start,
        )
        self._attend(k16, v16, start)
        y = np.empty((1, self.wo.rows), dtype=np.float32)
        if not self.wo.run(self._attn_row, y[0]):
            return None
        return y

    def _attend(self, k16: np.ndarray, v16: np.ndarray, start: int) -> None:
        """The flash attention of the token's heads over positions ``0..start`` of the float16
        caches' bits ``k16``/``v16`` (the general path's :func:`aioexperts._compute.fused.flash_kernel`:
        a fan-out by KV head from ``FLASH_SPLIT_MIN``, else one call)."""
        m = self._flash
        n_kv = start + 1
        pool = compute_pool()
        if _fused.flash_splits(pool, 1, self.n_head, n_kv):
            m.set_flash_cache(self._desc, k16, v16, n_kv, start)
            if pool.fan_out(self._flash_task, self._desc, self.n_head_kv, self._desc_address) is not None:
                return
        args: tuple[Any, ...] = (start, self._scale, self._sinks, self._window, self._attn, 0, self.n_head)
        m.flash_attend_f16_bits(self._q3, k16[:n_kv], v16[:n_kv], *args)
