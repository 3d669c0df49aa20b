"""Rotary position embedding (RoPE) as ggml applies it, with linear scaling, YaRN and frequency factors.

The reference is ggml's CPU ``ggml_compute_forward_rope_flt`` (ggml/src/ggml-cpu/ops.cpp):
``ggml_rope_cache_init`` and ``rope_yarn`` build ``cos`` and ``sin`` per pair, ``rotate_pairs``
rotates adjacent pairs (``GGML_ROPE_TYPE_NORMAL``) or the two halves of the rotated part
(``GGML_ROPE_TYPE_NEOX``); dimensions past ``n_rot`` pass through. ``ggml_rope_yarn_corr_dims``
(ggml/src/ggml.c) gives YaRN's correction range. The parameters come from
:class:`aioexperts._format.architectures.RopeParams`.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from aioexperts._compute import fused as _fused
from aioexperts._errors import ConfigError
from aioexperts._format.architectures import RopeParams, RopeType

__all__ = ("RopeTable", "apply_rope", "rope_cos_sin", "rope_table", "yarn_corr_dims")


def yarn_corr_dims(
    n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """YaRN's ``(low, high)`` correction dims (ggml.c ``ggml_rope_yarn_corr_dims``)."""

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, float(start)), min(float(n_dims - 1), float(end))


def rope_cos_sin(
    params: RopeParams, positions: np.ndarray, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of every rotated pair at every position (ops.cpp ``ggml_rope_cache_init``).

    Args:
        params: the layer's RoPE parameters.
        positions: ``(n_tokens,)`` integer positions.
        freq_factors: optional ``(n_rot/2,)`` float32 divisors of each pair's frequency
            (``rope_freqs.weight``).

    Returns:
        ``(cos, sin)``, each ``(n_tokens, n_rot/2)`` float32, already multiplied by the magnitude
        factor (``attn_factor``, and YaRN's ``1 + 0.1 ln(1/freq_scale)`` when ``ext_factor != 0``).
    """
    f32 = np.float32
    n_dims = params.n_rot
    half = n_dims // 2
    # float32 throughout, as ggml: theta_scale = powf(base, -2.0f / n_dims), theta *= theta_scale per pair
    theta_scale = f32(np.float64(params.freq_base) ** np.float64(f32(-2.0) / f32(n_dims)))
    theta_p = np.asarray(positions, dtype=np.float32).copy()
    factors = None if freq_factors is None else np.asarray(freq_factors, dtype=np.float32)[:half]
    freq_scale = f32(params.freq_scale)
    mscale = f32(params.attn_factor)
    ramp = None
    if params.ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, params.n_ctx_orig, params.freq_base, params.beta_fast, params.beta_slow)
        y = (np.arange(half, dtype=np.float32) - f32(low)) / max(f32(0.001), f32(high) - f32(low))
        ramp = (f32(1.0) - np.minimum(f32(1.0), np.maximum(f32(0.0), y))) * f32(params.ext_factor)
        mscale = f32(mscale * f32(f32(1.0) + f32(0.1) * f32(math.log(1.0 / params.freq_scale))))
    cos = np.empty((theta_p.size, half), dtype=np.float32)
    sin = np.empty((theta_p.size, half), dtype=np.float32)
    for k in range(half):
        extrap = theta_p if factors is None else theta_p / factors[k]
        theta = freq_scale * extrap
        if ramp is not None:
            theta = theta * (f32(1.0) - ramp[k]) + extrap * ramp[k]
        # cosf / sinf (correctly rounded in glibc's float32 versions), then times mscale in float32
        cos[:, k] = np.cos(theta.astype(np.float64)).astype(np.float32) * mscale
        sin[:, k] = np.sin(theta.astype(np.float64)).astype(np.float32) * mscale
        theta_p = theta_p * theta_scale
    return cos, sin


class RopeTable:
    """:func:`rope_cos_sin` of positions ``0..size-1``, computed once and grown on demand.

    Each position's values are :func:`rope_cos_sin`'s for that position (the formula is per
    position), so a slice of the table replaces a call per token and layer. Thread-safe: a call
    that needs more positions builds a larger table (the positions asked plus as many again, at
    most :attr:`GROW_AHEAD` more, and at least twice its size) and swaps it in.

    Args:
        params: the RoPE parameters.
        freq_factors: optional ``(n_rot/2,)`` float32 frequency divisors (``rope_freqs.weight``).
    """

    MIN_POSITIONS = 256
    #: positions a growth adds past the ones asked for, at most (a long prompt's table is not doubled)
    GROW_AHEAD = 4096

    def __init__(self, params: RopeParams, freq_factors: np.ndarray | None = None) -> None:
        self.params = params
        self.freq_factors = None if freq_factors is None else np.array(freq_factors, dtype=np.float32)
        half = params.n_rot // 2
        self._table: tuple[np.ndarray, np.ndarray] = (
            np.empty((0, half), dtype=np.float32),
            np.empty((0, half), dtype=np.float32),
        )
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Positions in the table now."""
        return int(self._table[0].shape[0])

    def cos_sin(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` of positions ``start..start+n-1``, each ``(n, n_rot/2)`` float32 (read-only views).

        Raises:
            ConfigError: ``start < 0`` or ``n < 0``.
        """
        if start < 0 or n < 0:
            raise ConfigError(f"RoPE positions {start}..{start + n - 1} are not valid")
        cos, sin = self._table
        end = start + n
        if end > cos.shape[0]:
            with self._lock:
                cos, sin = self._table
                if end > cos.shape[0]:
                    # room past what is asked (up to GROW_AHEAD): a prefill's table has room for
                    # the decode tokens after it
                    ahead = min(end, self.GROW_AHEAD)
                    size = max(end + ahead, 2 * cos.shape[0], self.MIN_POSITIONS)
                    cos, sin = rope_cos_sin(self.params, np.arange(size), self.freq_factors)
                    cos.flags.writeable = sin.flags.writeable = False
                    self._table = (cos, sin)
        return cos[start:end], sin[start:end]


_tables: dict[tuple[RopeParams, bytes | None], RopeTable] = {}
_tables_lock = threading.Lock()


def rope_table(params: RopeParams, freq_factors: np.ndarray | None = None) -> RopeTable:
    """The process-wide :class:`RopeTable` of ``params`` and ``freq_factors`` (layers with the same
    RoPE share one)."""
    key = (params, None if freq_factors is None else np.asarray(freq_factors, dtype=np.float32).tobytes())
    with _tables_lock:
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = RopeTable(params, freq_factors)
        return table


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_type: RopeType, n_rot: int) -> np.ndarray:
    """Rotate the first ``n_rot`` dims of every head (ops.cpp ``rotate_pairs``).

    Args:
        x: ``(n_tokens, n_heads, head_dim)`` float32 (not modified).
        cos, sin: from :func:`rope_cos_sin`, ``(n_tokens, n_rot/2)``.
        rope_type: :attr:`RopeType.NORM` pairs ``(2i, 2i+1)``, :attr:`RopeType.NEOX` pairs ``(i, i + n_rot/2)``.
        n_rot: rotated dims (even, at most ``head_dim``).

    Returns:
        A new ``(n_tokens, n_heads, head_dim)`` float32 array.

    Raises:
        ConfigError: shapes that do not fit.
    """
    if x.ndim != 3 or n_rot % 2 or n_rot > x.shape[2] or cos.shape != (x.shape[0], n_rot // 2):
        raise ConfigError(f"RoPE: x {x.shape}, cos {cos.shape}, n_rot {n_rot} do not fit")
    if rope_type in (RopeType.NORM, RopeType.NEOX) and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32:
        kernel = _fused.compiled_kernel("rope", "rope_heads")
        if kernel is not None:  # the same bits in one call (two per layer of a decode step)
            out = np.empty(x.shape, dtype=np.float32)
            kernel(np.ascontiguousarray(x), cos, sin, rope_type == RopeType.NEOX, n_rot, out)
            return out
    out = np.array(x, dtype=np.float32, copy=True)
    c = cos[:, None, :]
    s = sin[:, None, :]
    if rope_type == RopeType.NORM:
        x0 = x[:, :, 0:n_rot:2]
        x1 = x[:, :, 1:n_rot:2]
        out[:, :, 0:n_rot:2] = x0 * c - x1 * s
        out[:, :, 1:n_rot:2] = x0 * s + x1 * c
    elif rope_type == RopeType.NEOX:
        h = n_rot // 2
        x0 = x[:, :, :h]
        x1 = x[:, :, h:n_rot]
        out[:, :, :h] = x0 * c - x1 * s
        out[:, :, h:n_rot] = x0 * s + x1 * c
    else:  # pragma: no cover - RopeType has two members
        raise ConfigError(f"unknown RoPE type {rope_type!r}")
    return out
