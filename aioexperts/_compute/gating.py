"""Routing: router logits to the selected experts and their weights, exactly as llama.cpp does it.

The reference is ``llm_graph_context::build_moe_ffn`` in llama.cpp's ``src/llama-graph.cpp``; each step
below names the ggml operation it mirrors. Everything is float32, vectorised over tokens.

A softmax router without selection bias, expert groups or given ids (Qwen3-MoE, Qwen2-MoE, Mixtral)
runs compiled where the numba backend serves (:mod:`aioexperts._compute.kernels.routing`: two
loops around numpy's own ``exp``), bit for bit the numpy steps: the decode step's routing is ~20
small numpy calls fewer per layer, each 10-20 us with cold caches.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

import numpy as np

from aioexperts._checks import describe
from aioexperts._compute import fused
from aioexperts._errors import ConfigError, InvalidRequestError
from aioexperts._format.hparams import GatingFunc, MoEHParams

__all__ = ("WEIGHTS_SUM_MIN", "select_experts", "sigmoid", "softmax", "sqrt_softplus")

log = logging.getLogger("aioexperts")

WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)
"""Lower clamp of the weight sum before normalising: the smallest normal float16 (llama.cpp)."""


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float32, as ``ggml_soft_max`` computes it.

    ``exp(x - max)`` per row, summed in float64 (ggml's ``ggml_float``), then multiplied by the
    reciprocal of the sum.

    Args:
        logits: ``(n_tokens, n)`` float32.

    Returns:
        ``(n_tokens, n)`` float32 probabilities; a new array.
    """
    x = np.asarray(logits, dtype=np.float32)
    out: np.ndarray = x - x.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    total = out.sum(axis=-1, keepdims=True, dtype=np.float64)
    out *= (1.0 / total).astype(np.float32)
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in float32 (``ggml_sigmoid``); no overflow warnings for large ``|x|``.

    Args:
        x: float32 array of any shape.

    Returns:
        A new float32 array of the same shape.
    """
    out = np.negative(np.asarray(x, dtype=np.float32))
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += np.float32(1.0)
    np.reciprocal(out, out=out)
    return out


_SOFTPLUS_LINEAR = np.float32(20.0)  # ggml op_softplus: x above 20 is returned as is


def sqrt_softplus(x: np.ndarray) -> np.ndarray:
    """``sqrt(softplus(x))`` in float32, as ``ggml_sqrt(ggml_softplus(x))`` computes it (DeepSeek-V4).

    ggml's softplus (ggml-cpu unary-ops.cpp ``op_softplus``) is ``x`` for ``x > 20``, else
    ``log(1 + exp(x))``.

    Args:
        x: float32 array of any shape.

    Returns:
        A new float32 array of the same shape, every value >= 0.
    """
    x = np.asarray(x, dtype=np.float32)
    # logf(1 + expf(x)) as ggml writes it, not log1p: for x below about -17 the sum rounds to 1 and the
    # probability is exactly 0 in ggml, so such experts tie (and break ties by id) there as here
    with np.errstate(over="ignore"):
        soft = np.log(np.float32(1.0) + np.exp(np.minimum(x, _SOFTPLUS_LINEAR)))
    out = np.where(x > _SOFTPLUS_LINEAR, x, soft).astype(np.float32, copy=False)
    return np.sqrt(out)


def _top_k_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first; ties keep the lower index first.

    ``ggml_argsort_top_k`` is a descending ``ggml_argsort`` cut to k. ggml's CPU argsort is a
    ``std::sort``, which for rows of at most 16 elements is an insertion sort and so stable; a stable
    sort is the deterministic choice for longer rows too.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[..., :k]


def select_experts(
    logits: np.ndarray,
    hparams: MoEHParams,
    selection_bias: np.ndarray | None = None,
    selected: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose each token's experts and their weights from the router logits.

    Mirrors llama.cpp ``build_moe_ffn`` (src/llama-graph.cpp) step by step:

    1. probabilities (``ffn_moe_probs``): ``softmax(logits)`` (gating 1), ``sigmoid(logits)``
       (gating 2), the raw logits (gating 3, ``SOFTMAX_WEIGHT``), or ``sqrt(softplus(logits))``
       (gating 4, ``SQRT_SOFTPLUS``, DeepSeek-V4);
    2. selection scores (``ffn_moe_probs_biased``): ``probs + selection_bias`` when a bias
       (``exp_probs_b``) is given; the bias only steers the choice, the weights come from ``probs``;
       with ``hparams.select_on_logits`` (llama4) the raw logits are the selection scores;
    3. group-limited selection when ``hparams.n_expert_groups > 1`` (``ffn_moe_probs_masked``): the
       experts are split into ``n_expert_groups`` consecutive groups, a group scores the sum of its
       two largest selection scores, the ``n_group_used`` best groups are kept and every expert of the
       other groups gets ``-inf`` (not 0: biased scores can be negative);
    4. top-k (``ffn_moe_topk``): the ``n_expert_used`` largest selection scores, largest first;
       or, when ``selected`` is given (``selected_experts_in``: DeepSeek-V4's hash-routed layers look
       the ids up by token id), exactly those ids, and steps 2-3 do not matter;
    5. weights (``ffn_moe_weights``): ``probs`` gathered at the selected ids; for gating 3 a softmax
       over those k values (``ffn_moe_weights_softmax``);
    6. ``weights_norm`` (``ffn_moe_weights_norm``): divide by the row sum clamped below at
       6.103515625e-5;
    7. ``weights_scale`` (``ffn_moe_weights_scaled``): multiply when the scale is not 0 or 1.

    Args:
        logits: ``(n_tokens, n_expert)`` float32 router logits. ``n_expert`` is this layer's router
            width, which for a pruned mixed-tier layer may be smaller than ``hparams.n_expert``.
        hparams: the model's MoE parameters (gating, k, groups, norm, scale).
        selection_bias: optional ``(n_expert,)`` float32 selection bias (``blk.L.exp_probs_b.bias``).
        selected: optional ``(n_tokens, k)`` integer ids chosen outside the router (the rows of
            ``blk.L.ffn_gate_tid2eid.weight`` for the tokens); the weights are still the router's.

    Returns:
        ``(ids, weights)``: ``ids`` ``(n_tokens, k)`` int32 in llama.cpp's order (descending selection
        score, ties to the lower id); ``weights`` ``(n_tokens, k)`` float32, the final routing weights
        of those ids.

    Raises:
        InvalidRequestError: ``logits`` or ``selection_bias`` is not float32 or has the wrong shape, or
            ``selected`` is not ``(n_tokens, k)`` ids in ``0..n_expert-1``.
        ConfigError: ``k`` exceeds the layer's experts, or the groups do not divide them.
    """
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.ndim != 2:
        raise InvalidRequestError(f"logits must be a 2-D float32 array (n_tokens, n_expert), got {describe(logits)}")
    n_tokens, n_expert = logits.shape
    k = hparams.n_expert_used
    if not 0 < k <= n_expert:
        raise ConfigError(f"cannot select top-{k} experts from a router with {n_expert} outputs")

    gating = hparams.gating_func
    if (
        gating == GatingFunc.SOFTMAX
        and selection_bias is None
        and selected is None
        and not hparams.select_on_logits
        and hparams.n_expert_groups <= 1
    ):
        kernels = _kernels()
        if kernels is not None and n_expert <= kernels.MAX_EXPERTS and k <= kernels.MAX_USED:
            return _softmax_top_k(kernels, logits, hparams)  # compiled, no warning (exp of values <= 0)
    with np.errstate(over="ignore", invalid="ignore"):  # logits out of range: the caller refuses the weights
        return _select_numpy(logits, hparams, selection_bias, selected)


def _select_numpy(
    logits: np.ndarray,
    hparams: MoEHParams,
    selection_bias: np.ndarray | None,
    selected: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`select_experts`'s numpy steps (its arguments' types checked)."""
    n_tokens, n_expert = logits.shape
    k = hparams.n_expert_used
    gating = hparams.gating_func
    if gating == GatingFunc.SOFTMAX:
        probs = softmax(logits)
    elif gating == GatingFunc.SIGMOID:
        probs = sigmoid(logits)
    elif gating == GatingFunc.SOFTMAX_WEIGHT:
        probs = logits
    elif gating == GatingFunc.SQRT_SOFTPLUS:
        probs = sqrt_softplus(logits)
    else:  # pragma: no cover - GatingFunc is closed
        raise ConfigError(f"unsupported gating function {gating!r}")

    if selection_bias is not None:
        if (
            not isinstance(selection_bias, np.ndarray)
            or selection_bias.dtype != np.float32
            or selection_bias.shape != (n_expert,)
        ):
            raise InvalidRequestError(
                f"selection_bias must be a float32 array of shape ({n_expert},), got {describe(selection_bias)}"
            )
        selection = probs + selection_bias
    else:
        selection = probs
    if hparams.select_on_logits:
        # llama4: "sigmoid is only used after top_k" (build_moe_ffn: selection_probs = logits)
        selection = logits

    if selected is not None:
        if (
            not isinstance(selected, np.ndarray)
            or selected.shape != (n_tokens, k)
            or not np.issubdtype(selected.dtype, np.integer)
        ):
            raise InvalidRequestError(
                f"selected must be integer ids of shape ({n_tokens}, {k}), got {describe(selected)}"
            )
        if selected.size and (int(selected.min()) < 0 or int(selected.max()) >= n_expert):
            raise InvalidRequestError(
                f"selected expert ids must be in 0..{n_expert - 1}, got {int(selected.min())}..{int(selected.max())}"
            )
        ids = selected.astype(np.int64)
    else:
        if hparams.n_expert_groups > 1 and n_tokens > 0:
            selection = _mask_groups(selection, hparams.n_expert_groups, hparams.n_group_used, k)
        ids = _top_k_desc(selection, k)
    weights = np.take_along_axis(probs, ids, axis=1)
    if gating == GatingFunc.SOFTMAX_WEIGHT:
        weights = softmax(weights)
    if hparams.weights_norm:
        total = weights.sum(axis=1, keepdims=True, dtype=np.float32)
        np.maximum(total, WEIGHTS_SUM_MIN, out=total)
        weights = weights / total
    scale = hparams.weights_scale
    if scale != 0.0 and scale != 1.0:
        weights = weights * np.float32(scale)
    return ids.astype(np.int32), np.ascontiguousarray(weights, dtype=np.float32)


class _Kernels:
    lock = threading.Lock()
    module: Any = None
    failed = False


def _kernels() -> Any:
    """The compiled selection (:mod:`aioexperts._compute.kernels.routing`) where the numba backend
    serves, else None (the numpy steps serve)."""
    if _Kernels.failed or fused.backend().name != "numba":
        return None
    if _Kernels.module is None:
        with _Kernels.lock:
            if _Kernels.module is None and not _Kernels.failed:
                try:
                    module = importlib.import_module(f"{__package__}.kernels.routing")
                    e = module.shift_rows(np.zeros((1, 2), dtype=np.float32))  # compiles (or loads)
                    module.finish_softmax_top_k(e, 1, True, WEIGHTS_SUM_MIN, False, np.float32(1.0))
                    _Kernels.module = module
                except Exception as exc:  # a broken numba/llvmlite can raise anything
                    _Kernels.failed = True
                    log.warning("routing runs in numpy: its kernel failed (%s: %s)", type(exc).__name__, exc)
    return _Kernels.module


def _softmax_top_k(kernels: Any, logits: np.ndarray, hparams: MoEHParams) -> tuple[np.ndarray, np.ndarray]:
    """:func:`select_experts` of a softmax router without bias, groups or given ids, compiled: bit for
    bit the numpy steps (:mod:`aioexperts._compute.kernels.routing` says how)."""
    k = hparams.n_expert_used
    if logits.shape[0] == 0:
        return np.empty((0, k), dtype=np.int32), np.empty((0, k), dtype=np.float32)
    e = kernels.shift_rows(logits)
    np.exp(e, out=e)
    scale = hparams.weights_scale
    scaled = scale != 0.0 and scale != 1.0
    ids: np.ndarray
    weights: np.ndarray
    ids, weights = kernels.finish_softmax_top_k(
        e, k, bool(hparams.weights_norm), WEIGHTS_SUM_MIN, scaled, np.float32(scale)
    )
    return ids, weights


def _mask_groups(selection: np.ndarray, n_groups: int, n_group_used: int, k: int) -> np.ndarray:
    """Keep the ``n_group_used`` best groups of experts, set every other expert to ``-inf``.

    A group's score is the sum of its two largest selection scores (``ggml_argsort_top_k(.., 2)``,
    ``ggml_get_rows``, ``ggml_sum_rows``); the kept groups are the top ``n_group_used`` of those
    scores; the rest are filled with ``-INFINITY`` (``ggml_fill`` + ``ggml_set_rows``).
    """
    n_tokens, n_expert = selection.shape
    if n_expert % n_groups:
        raise ConfigError(f"{n_groups} expert groups do not divide a router with {n_expert} outputs")
    per_group = n_expert // n_groups
    if not 0 < n_group_used <= n_groups:
        raise ConfigError(f"n_group_used must be in 1..{n_groups}, got {n_group_used}")
    if k > n_group_used * per_group:
        raise ConfigError(f"top-{k} cannot be chosen from {n_group_used} groups of {per_group} experts")
    grouped = selection.reshape(n_tokens, n_groups, per_group)
    top = min(2, per_group)
    best = -np.sort(-grouped, axis=2)[:, :, :top]
    group_scores = best.sum(axis=2, dtype=np.float32)
    kept = _top_k_desc(group_scores, n_group_used)
    keep = np.zeros((n_tokens, n_groups), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=1)
    masked = np.where(keep[:, :, None], grouped, np.float32(-np.inf))
    return masked.reshape(n_tokens, n_expert)
