"""The residual stream around the blocks, per row: a block's input, the add after its attention, the
head's input and the logits' scale, each checked finite.

One place for what the one-sequence forward pass (:class:`~aioexperts.Model`) and the batched decode
step (:mod:`aioexperts._model.forward`) do to each row, as llama.cpp's graphs chain it
(``src/models/<arch>.cpp``; Granite's scales from granite.cpp).
"""

from __future__ import annotations

import numpy as np

from aioexperts._compute.norms import rms_norm
from aioexperts._errors import NonFiniteError
from aioexperts._format.architectures import ModelHParams

__all__ = ("add_residual", "after_attention", "block_input", "check_finite", "head_input", "scale_logits")


def add_residual(resid: np.ndarray, f: np.ndarray, hp: ModelHParams) -> np.ndarray:
    """``resid + f * residual_scale`` (granite.cpp's ``f_residual_scale``; 1 elsewhere): a new array."""
    if hp.residual_scale:
        f = f * np.float32(hp.residual_scale)
    out: np.ndarray = resid + f
    return out


def check_finite(what: str, x: np.ndarray) -> None:
    """Raise NonFiniteError naming ``what`` and the token rows of ``x`` ``(n_tokens, ...)`` that hold NaN or inf."""
    if not np.isfinite(x).all():
        rows = np.flatnonzero(~np.isfinite(x).all(axis=-1))
        raise NonFiniteError(
            f"{what} is not finite for token rows {rows[:8].tolist()} (NaN or inf: a broken model file, "
            "or activations beyond float32)"
        )


def block_input(hp: ModelHParams, il: int, resid: np.ndarray, f: np.ndarray | None) -> np.ndarray:
    """Block ``il``'s input ``(n_tokens, n_embd)`` float32: the embeddings ``resid`` (times Granite's
    ``embedding_scale``; llama-graph.cpp ``build_inp_embd``) when ``f`` is None (the first block),
    else the previous block's ``resid + f`` (:func:`add_residual`).

    Raises:
        NonFiniteError: the residual stream after block ``il - 1`` holds NaN or inf.
    """
    if f is None:
        return resid * np.float32(hp.embedding_scale) if hp.embedding_scale else resid
    x = add_residual(resid, f, hp)
    check_finite(f"the residual stream after block {il - 1}", x)
    return x


def after_attention(hp: ModelHParams, il: int, x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``ffn_inp = x + a * residual_scale`` of block ``il`` (``a``, the attention's output, is scaled in place).

    Raises:
        NonFiniteError: the result holds NaN or inf.
    """
    if hp.residual_scale:
        a *= np.float32(hp.residual_scale)
    ffn_inp: np.ndarray = x + a
    check_finite(f"the residual stream after block {il}'s attention", ffn_inp)
    return ffn_inp


def head_input(
    hp: ModelHParams, resid: np.ndarray, f: np.ndarray, output_norm: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The last block's output ``x = resid + f`` and its output norm ``h``, both ``(n_tokens, n_embd)``.

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
    """
    x = add_residual(resid, f, hp)
    check_finite(f"the residual stream after block {hp.n_layer - 1}", x)
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
