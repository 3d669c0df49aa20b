"""The hyper-connection weights of a deepseek4 model, read once at load (deepseek4.cpp ``load_arch_tensors``).

Per block ``hc_attn_{fn,scale,base}`` and ``hc_ffn_{fn,scale,base}``, for the head
``output_hc_{fn,scale,base}``; the maths is :mod:`aioexperts._compute.hyper`, the residual stream
around the blocks :mod:`aioexperts._model.residual`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioexperts._compute.hyper import HyperMix, hc_coefficients, hc_head_weights
from aioexperts._errors import FormatError
from aioexperts._format.architectures import ModelHParams
from aioexperts._model.weights import DenseMatrix, TensorReader

__all__ = ("HyperConnections", "read_hyper_connections")


@dataclass(frozen=True, slots=True, eq=False)
class _Mixer:
    fn: DenseMatrix
    scale: np.ndarray
    base: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class HyperConnections:
    """Every block's two hyper-connections and the head's (``n_hc`` streams).

    Attributes:
        n_hc: ``hyper_connection.count`` streams.
        iterations: ``hyper_connection.sinkhorn_iterations``.
        eps: ``hyper_connection.epsilon``.
        norm_eps: the RMSNorm epsilon.
    """

    n_hc: int
    iterations: int
    eps: float
    norm_eps: float
    attn: tuple[_Mixer, ...]
    ffn: tuple[_Mixer, ...]
    head: _Mixer

    def mix(self, layer: int, kind: str, x: np.ndarray) -> HyperMix:
        """The coefficients of block ``layer``'s ``kind`` (``"attn"`` or ``"ffn"``) connection for the
        streams ``x`` ``(n, n_hc, n_embd)`` float32."""
        m = (self.attn if kind == "attn" else self.ffn)[layer]
        return hc_coefficients(
            x, m.fn, m.scale, m.base, iterations=self.iterations, eps=self.eps, norm_eps=self.norm_eps
        )

    def head_weights(self, x: np.ndarray) -> np.ndarray:
        """The head's ``pre`` ``(n, n_hc)`` for the last block's streams ``x``."""
        return hc_head_weights(x, self.head.fn, self.head.scale, self.head.base, self.eps, self.norm_eps)


#: The most Sinkhorn iterations a file may ask for. DeepSeek-V4 uses 20; each iteration is a few
#: graph nodes per mixer and block in llama.cpp, whose graph holds about 8 nodes per tensor, so a
#: count far above this is a corrupt file, and running it would spin for hours per token.
MAX_SINKHORN_ITERATIONS = 1024


def _int_key(hp: ModelHParams, name: str, high: int | None = None) -> int:
    value = hp.metadata.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"{hp.arch}.{name} must be an int > 0, got {value!r} (deepseek4.cpp reads it)")
    if high is not None and value > high:
        raise FormatError(f"{hp.arch}.{name} is {value}, more than {high}: a corrupt file")
    return value


def read_hyper_connections(hp: ModelHParams, reader: TensorReader) -> HyperConnections:
    """Read the hyper-connection keys and tensors (blocking).

    Raises:
        FormatError: a missing or malformed ``hyper_connection.*`` key (``sinkhorn_iterations``
            above :data:`MAX_SINKHORN_ITERATIONS`), a tensor missing or misshaped.
    """
    n_hc = _int_key(hp, "hyper_connection.count")
    iterations = _int_key(hp, "hyper_connection.sinkhorn_iterations", MAX_SINKHORN_ITERATIONS)
    eps = hp.metadata.get("hyper_connection.epsilon")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < 1:
        raise FormatError(f"{hp.arch}.hyper_connection.epsilon must be a number in [0, 1), got {eps!r}")
    width, n_mix = n_hc * hp.n_embd, (2 + n_hc) * n_hc

    def mixer(prefix: str, rows: int, n_scale: int) -> _Mixer:
        return _Mixer(
            reader.matrix(prefix + "fn.weight", (rows, width)),
            reader.array(prefix + "scale.weight", (n_scale,)),
            reader.array(prefix + "base.weight", (rows,)),
        )

    attn = tuple(mixer(f"blk.{il}.hc_attn_", n_mix, 3) for il in range(hp.n_layer))
    ffn = tuple(mixer(f"blk.{il}.hc_ffn_", n_mix, 3) for il in range(hp.n_layer))
    return HyperConnections(n_hc, iterations, float(eps), hp.norm_eps, attn, ffn, mixer("output_hc_", n_hc, 1))
