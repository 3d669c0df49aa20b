"""The residual stream around the blocks, per row: a block's input, the add after its attention, the
head's input and the logits' scale, each checked finite.

One place for what the one-sequence forward pass (:class:`~aioexperts.Model`) and the batched decode
step (:mod:`aioexperts._model.forward`) do to each row, as llama.cpp's graphs chain it
(``src/models/<arch>.cpp``; Granite's scales from granite.cpp).

With hyper-connections (deepseek4.cpp; ``hc`` given) the residual of a token is ``n_hc`` streams
``(n_tokens, n_hc, n_embd)``: :func:`block_input` and :func:`after_attention` mix a block's output
into them (``build_hc_post``), :func:`mixed_input` mixes them into a block's input
(``build_hc_pre``) and :func:`head_input` into the head's (``build_hc_head``).
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute.hyper import hc_post, hc_pre
from aioexperts._compute.norms import all_finite, rms_norm
from aioexperts._errors import NonFiniteError
from aioexperts._format.architectures import ModelHParams
from aioexperts._model.hyper_weights import HyperConnections

__all__ = (
    "add_residual",
    "after_attention",
    "block_input",
    "check_finite",
    "head_input",
    "mixed_input",
    "scale_logits",
)


def add_residual(resid: np.ndarray, f: np.ndarray, hp: ModelHParams) -> np.ndarray:
    """``resid + f * residual_scale`` (granite.cpp's ``f_residual_scale``; 1 elsewhere): a new array."""
    if hp.residual_scale:
        f = f * np.float32(hp.residual_scale)
    out: np.ndarray = resid + f
    return out


def check_finite(what: str, x: np.ndarray) -> None:
    """Raise NonFiniteError naming ``what`` and the token rows of ``x`` ``(n_tokens, ...)`` that hold NaN or inf."""
    if not all_finite(x):
        rows = np.flatnonzero(~np.isfinite(x).reshape(len(x), -1).all(axis=1))
        raise NonFiniteError(
            f"{what} is not finite for token rows {rows[:8].tolist()} (NaN or inf: a broken model file, "
            "or activations beyond float32)"
        )


def block_input(
    hp: ModelHParams, il: int, resid: np.ndarray, f: np.ndarray | None, hc: HyperConnections | None = None
) -> np.ndarray:
    """Block ``il``'s input ``(n_tokens, n_embd)`` float32: the embeddings ``resid`` (times Granite's
    ``embedding_scale``; llama-graph.cpp ``build_inp_embd``) when ``f`` is None (the first block),
    else the previous block's ``resid + f`` (:func:`add_residual`). With ``hc``: the streams
    ``(n_tokens, n_hc, n_embd)``, each the embeddings at first, else the previous block's FFN output
    ``f`` mixed into its streams ``resid`` (``build_hc_post``).

    Raises:
        NonFiniteError: the residual stream after block ``il - 1`` holds NaN or inf.
    """
    if hc is not None:
        if f is None:
            return np.repeat(resid[:, None, :], hc.n_hc, axis=1)
        x = hc_post(f, resid, hc.mix(il - 1, "ffn", resid))
    elif f is None:
        return resid * np.float32(hp.embedding_scale) if hp.embedding_scale else resid
    else:
        x = add_residual(resid, f, hp)
    check_finite(f"the residual stream after block {il - 1}", x)
    return x


def mixed_input(hc: HyperConnections | None, il: int, kind: str, x: np.ndarray) -> np.ndarray:
    """What block ``il``'s ``kind`` (``"attn"`` or ``"ffn"``) norm takes: ``x`` itself, or with ``hc``
    the streams ``x`` mixed by the connection's ``pre`` weights, ``(n_tokens, n_embd)`` float32."""
    if hc is None:
        return x
    return hc_pre(x, hc.mix(il, kind, x).pre)


def after_attention(
    hp: ModelHParams, il: int, x: np.ndarray, a: np.ndarray, hc: HyperConnections | None = None
) -> np.ndarray:
    """``ffn_inp = x + a * residual_scale`` of block ``il`` (``a``, the attention's output, is scaled in
    place); with ``hc``, ``a`` mixed into the streams ``x`` (``build_hc_post``).

    Raises:
        NonFiniteError: the result holds NaN or inf.
    """
    if hc is not None:
        ffn_inp: np.ndarray = hc_post(a, x, hc.mix(il, "attn", x))
    else:
        if hp.residual_scale:
            a *= np.float32(hp.residual_scale)
        ffn_inp = x + a
    check_finite(f"the residual stream after block {il}'s attention", ffn_inp)
    return ffn_inp


def head_input(
    hp: ModelHParams,
    resid: np.ndarray,
    f: np.ndarray,
    output_norm: np.ndarray,
    hc: HyperConnections | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The last block's output ``x = resid + f`` and its output norm ``h``, both ``(n_tokens, n_embd)``;
    with ``hc``, ``x`` is the streams ``(n_tokens, n_hc, n_embd)`` and ``h`` the output norm of their
    head mix (``build_hc_head``).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
    """
    if hc is None:
        x = add_residual(resid, f, hp)
    else:
        x = hc_post(f, resid, hc.mix(hp.n_layer - 1, "ffn", resid))
    check_finite(f"the residual stream after block {hp.n_layer - 1}", x)
    if hc is not None:
        return x, rms_norm(hc_pre(x, hc.head_weights(x)), output_norm, hp.norm_eps)
    return x, rms_norm(x, output_norm, hp.norm_eps)


def scale_logits(hp: ModelHParams, logits: np.ndarray) -> np.ndarray:
    """``logits / logit_scale`` in place (granite.cpp: ``ggml_scale(cur, 1/f_logit_scale)``), checked.

    Raises:
        NonFiniteError: the logits hold NaN or inf.
    """
    if hp.logit_scale:
        logits *= np.float32(1.0 / hp.logit_scale)
    check_finite("the logits", logits)
    return logits
