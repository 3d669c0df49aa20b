"""The gated activations of an expert's FFN, as ggml-cpu computes them in float32.

``ggml_swiglu_split`` (SiLU), ``ggml_swiglu_clamp`` (DeepSeek-V4), gpt-oss ``ggml_swiglu_oai`` and
``ggml_geglu_split`` (tanh GELU), on ``(n, n_ff)`` float32 arrays; each element depends on its own
inputs only, so a group of experts' rows at once gives every row the bits it gets alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from aioexperts._compute import fused as _fused
from aioexperts._format.hparams import Activation, MoEHParams

__all__ = ("GatedActivation", "expert_activation", "geglu", "swiglu", "swiglu_clamp", "swiglu_oai")

GatedActivation = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
"""``act(g, u, tmp, out)``: ``out = act(g) * u`` elementwise; may clobber ``g``, ``u`` and ``tmp``."""


def expert_activation(hparams: MoEHParams, layer: int) -> GatedActivation:
    """The routed experts' gated activation of ``layer``: the clamped SwiGLU where the layer has a
    clamp (DeepSeek-V4), else ``hparams.activation``."""
    limit = hparams.expert_clamp(layer)
    if limit:
        return lambda g, u, tmp, out: swiglu_clamp(g, u, tmp, out, limit)
    if hparams.activation is Activation.SWIGLU_OAI:
        alpha, clip = hparams.swiglu_alpha, hparams.swiglu_limit
        return lambda g, u, tmp, out: swiglu_oai(g, u, tmp, out, alpha, clip)
    if hparams.activation is Activation.GELU:
        return geglu
    return swiglu


def swiglu(g: np.ndarray, u: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(g) * u = g / (1 + exp(-g)) * u`` (``ggml_swiglu_split``); clobbers g and tmp.

    Around numpy's ``exp`` the rest is two compiled calls where they serve (2-D float32 arrays of
    one shape, C-contiguous), with the bits of numpy's steps: the negation, which also says whether
    ``exp`` may overflow (only then is its warning silenced: ``np.errstate`` costs about 10 us with
    the caches cold), and the tail. A decode layer's Python runs with the caches its weights
    flushed, where each numpy call costs several microseconds."""
    tail = _fused.compiled_kernel("glu", "silu_mul_tail") if g.ndim == 2 else None
    compiled = (
        tail is not None
        and g.dtype == tmp.dtype == u.dtype == out.dtype == np.float32
        and g.shape == tmp.shape == u.shape == out.shape
        and g.flags.c_contiguous
        and tmp.flags.c_contiguous
        and u.flags.c_contiguous
        and out.flags.c_contiguous
    )
    negate = _fused.compiled_kernel("glu", "negate_rows") if compiled else None
    if negate is None:
        np.negative(g, out=tmp)
        may_overflow = True
    else:
        may_overflow = negate(g, tmp)
    if may_overflow:
        with np.errstate(over="ignore"):
            np.exp(tmp, out=tmp)
    else:
        np.exp(tmp, out=tmp)  # nothing above 88: no overflow to silence
    if compiled and tail is not None:
        tail(g, tmp, u, out)
        return
    tmp += np.float32(1.0)
    np.divide(g, tmp, out=g)
    np.multiply(g, u, out=out)


def swiglu_clamp(g: np.ndarray, u: np.ndarray, tmp: np.ndarray, out: np.ndarray, limit: float) -> None:
    """``ggml_swiglu_clamp`` (ggml-cpu ops.cpp, DeepSeek-V4): ``gate = min(g, limit)``,
    ``up = clamp(u, -limit, limit)``, ``out = silu(gate) * up``; clobbers g, u and tmp."""
    lim = np.float32(limit)
    np.minimum(g, lim, out=g)
    np.clip(u, -lim, lim, out=u)
    swiglu(g, u, tmp, out)


def swiglu_oai(g: np.ndarray, u: np.ndarray, tmp: np.ndarray, out: np.ndarray, alpha: float, limit: float) -> None:
    """gpt-oss ``ggml_swiglu_oai``: ``x = min(g, limit)``, ``y = clamp(u, -limit, limit)``,
    ``out = x / (1 + exp(-alpha x)) * (y + 1)``; clobbers g, u and tmp."""
    lim = np.float32(limit)
    np.minimum(g, lim, out=g)
    np.clip(u, -lim, lim, out=u)
    np.multiply(g, np.float32(-alpha), out=tmp)
    with np.errstate(over="ignore"):
        np.exp(tmp, out=tmp)
    tmp += np.float32(1.0)
    np.divide(g, tmp, out=g)
    u += np.float32(1.0)
    np.multiply(g, u, out=out)


_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)  # ggml GELU constants
_GELU_COEF_A = np.float32(0.044715)


def geglu(g: np.ndarray, u: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """``ggml_geglu_split``: ``out = gelu(g) * u`` with ggml's tanh GELU
    ``0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2)))``; clobbers tmp. (ggml's CPU backend looks
    GELU up in a float16 table, which differs from this float32 formula by up to ~1e-3 relative.)"""
    np.multiply(g, g, out=tmp)
    tmp *= _GELU_COEF_A
    tmp += np.float32(1.0)
    tmp *= g
    tmp *= _SQRT_2_OVER_PI
    np.tanh(tmp, out=tmp)
    tmp += np.float32(1.0)
    tmp *= g
    tmp *= np.float32(0.5)
    np.multiply(tmp, u, out=out)
