"""The MoE executor: router, gating, routed experts (any mix of ggml types) and shared experts.

The reference is llama.cpp's ``llm_graph_context::build_moe_ffn`` (``src/llama-graph.cpp``) for the
routed part and ``build_ffn`` with ``LLM_FFN_SILU, LLM_FFN_PAR`` for the shared expert; each function
names the formula it mirrors.

Performance notes: everything is float32; every matrix product goes through
:func:`aioexperts._compute.fused.linear` (compiled kernels that read the raw ggml blocks in slot
memory: one fused decode-and-dot per token for a token or two, a blocked product that decodes each
row once for small batches, exact dequantization + BLAS for prefill); tokens are grouped by expert,
so each selected expert is decoded once per call whatever the number of tokens that chose it; the
distinct experts of a call (and the shared expert) are spread over the compute pool's idle workers
(:meth:`aioexperts._compute.pool.ComputePool.map`); the only Python loops run over the distinct
experts (and over the k slots for the final sum, in llama.cpp's order), never over tokens; the
per-expert scratch buffers live in a per-thread workspace that is reused from call to call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, overload

import numpy as np
from gguf import GGMLQuantizationType
from numpy.typing import ArrayLike

from aioexperts._checks import as_int_array, check_activations, describe
from aioexperts._compute import fused as _fused
from aioexperts._compute import pool as _pool_module
from aioexperts._compute.activations import quantized_round_trip
from aioexperts._compute.decode_experts import RowStep, expert_group, group_classes, row_step, row_step_for_layout
from aioexperts._compute.gating import select_experts
from aioexperts._compute.glu import expert_activation, swiglu, swiglu_clamp
from aioexperts._compute.grouped import f32_split_plan, f32_task
from aioexperts._compute.pool import compute_pool
from aioexperts._errors import ConfigError, FormatError, InvalidRequestError
from aioexperts._format.hparams import MoEHParams
from aioexperts._format.views import ExpertTable, ExpertView, LayoutKey, ProjectionView

__all__ = (
    "ExpertOutputs",
    "MoEOutput",
    "MoEPlan",
    "ResidentLayer",
    "check_token_ids",
    "combine_moe",
    "expert_outputs",
    "expert_rows",
    "moe_forward",
    "plan_moe",
    "prepare_row_step",
    "route",
    "router_logits",
)

TensorGetter = Callable[[str], "np.ndarray | None"]
"""``tensor(name) -> float32 array in numpy order, or None when the model has no such tensor``."""

_MAX_TIERS = 3  # ffn_*_exps_tier1..3 (docs/notes/FORMATS.md section 2)


# --------------------------------------------------------------------------------------------------
# resident weights


@dataclass(frozen=True, slots=True, eq=False)
class ResidentLayer:
    """The always-resident (non-streamed) MoE weights of one layer, dequantized to float32.

    Shapes are numpy order (ggml dims reversed). ``n_layer_experts`` is ``router.shape[0]``: the
    router's width, which a pruned mixed-tier layer may have smaller than ``hparams.n_expert``.

    Attributes:
        layer: the block index ``L``.
        router: ``blk.L.ffn_gate_inp.weight``, ``(n_layer_experts, n_embd)``.
        router_bias: ``blk.L.ffn_gate_inp.bias``, ``(n_layer_experts,)`` or None (gpt-oss).
        selection_bias: ``blk.L.exp_probs_b.bias``, ``(n_layer_experts,)`` or None (DeepSeek-V3,
            GLM-4.5): added to the probabilities for choosing only.
        gate_exps_bias, up_exps_bias: ``blk.L.ffn_{gate,up}_exps.bias``, ``(n_layer_experts, n_ff_exp)``
            or None (gpt-oss; a merged ``ffn_gate_up_exps.bias`` is split into the two).
        down_exps_bias: ``blk.L.ffn_down_exps.bias``, ``(n_layer_experts, n_embd)`` or None.
        shexp_gate, shexp_up: ``blk.L.ffn_{gate,up}_shexp.weight``, ``(n_ff_shexp, n_embd)`` or None.
        shexp_down: ``blk.L.ffn_down_shexp.weight``, ``(n_embd, n_ff_shexp)`` or None.
        shexp_gate_inp: ``blk.L.ffn_gate_inp_shexp.weight``, ``(n_embd,)`` or None: when present the
            shared output is multiplied by ``sigmoid(x . shexp_gate_inp)`` (Qwen2-MoE, Qwen3-Next).
        token_experts: ``blk.L.ffn_gate_tid2eid.weight``, ``(n_vocab, k)`` int32 or None: the experts
            of each token id in a hash-routed layer (DeepSeek-V4), in slot order.
        gate_exps_scale, up_exps_scale, down_exps_scale: ``blk.L.ffn_{gate,up,down}_exps.scale``,
            ``(n_layer_experts,)`` float32 or None: each expert's projection output is multiplied by
            its factor (qwen35moe; llama-graph.cpp ``build_lora_mm_id``).
        shexp_types: the ggml types of the shared expert's gate, up and down in the file, or None
            (float32 weights): under the default precision the shared expert's inputs are rounded
            as llama.cpp's products with those types round them
            (:func:`aioexperts._compute.activations.quantized_round_trip`).
        shexp_gate_scale, shexp_up_scale, shexp_down_scale: ``blk.L.ffn_{gate,up,down}_shexp.scale``
            (one value) or None: the shared expert's projections are multiplied by them (qwen35moe;
            ``build_lora_mm``).
    """

    layer: int
    router: np.ndarray
    router_bias: np.ndarray | None = None
    selection_bias: np.ndarray | None = None
    gate_exps_bias: np.ndarray | None = None
    up_exps_bias: np.ndarray | None = None
    down_exps_bias: np.ndarray | None = None
    shexp_gate: np.ndarray | None = None
    shexp_up: np.ndarray | None = None
    shexp_down: np.ndarray | None = None
    shexp_gate_inp: np.ndarray | None = None
    token_experts: np.ndarray | None = None
    gate_exps_scale: np.ndarray | None = None
    up_exps_scale: np.ndarray | None = None
    down_exps_scale: np.ndarray | None = None
    shexp_gate_scale: float | None = None
    shexp_up_scale: float | None = None
    shexp_down_scale: float | None = None
    shexp_types: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType] | None = None
    #: the router's one-token fan-out plans by (parts, task address) (:func:`router_row_logits`)
    _row_plans: dict[tuple[int, int], Any] = field(default_factory=dict, init=False, repr=False)

    def __getstate__(self) -> list[object]:
        # a copy (pickle, deepcopy) starts without the fan-out plans: they hold this one's addresses
        return [{} if f.name == "_row_plans" else getattr(self, f.name) for f in fields(self)]

    def __setstate__(self, state: list[object]) -> None:
        for f, value in zip(fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)

    def __post_init__(self) -> None:
        router = _f32_matrix("router", self.router, None)
        n_exp, n_embd = router.shape
        if n_exp == 0 or n_embd == 0:
            raise ConfigError(f"layer {self.layer}: empty router of shape {router.shape}")
        object.__setattr__(self, "router", router)
        for name in ("router_bias", "selection_bias", "gate_exps_scale", "up_exps_scale", "down_exps_scale"):
            object.__setattr__(self, name, _f32_vector(name, getattr(self, name), n_exp))
        table = self.token_experts
        if table is not None:
            if not isinstance(table, np.ndarray) or table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
                raise ConfigError(
                    f"layer {self.layer}: token_experts must be a 2-D integer array, got {describe(table)}"
                )
            if table.size and (int(table.min()) < 0 or int(table.max()) >= n_exp):
                raise FormatError(
                    f"layer {self.layer}: the token-to-expert table (ffn_gate_tid2eid) holds ids "
                    f"{int(table.min())}..{int(table.max())}, outside 0..{n_exp - 1}"
                )
            object.__setattr__(self, "token_experts", np.ascontiguousarray(table, dtype=np.int32))
        for name in ("gate_exps_bias", "up_exps_bias"):
            value = getattr(self, name)
            if value is not None:
                value = _f32_matrix(name, value, None)
                if value.shape[0] != n_exp:
                    raise ConfigError(f"layer {self.layer}: {name} has {value.shape[0]} rows, the router {n_exp}")
            object.__setattr__(self, name, value)
        gate_b, up_b = self.gate_exps_bias, self.up_exps_bias
        if (gate_b is None) != (up_b is None) or (
            gate_b is not None and up_b is not None and gate_b.shape != up_b.shape
        ):
            raise ConfigError(
                f"layer {self.layer}: gate and up expert biases must both be present with one shape, "
                f"got {_shape(self.gate_exps_bias)} and {_shape(self.up_exps_bias)}"
            )
        object.__setattr__(self, "down_exps_bias", _f32_matrix("down_exps_bias", self.down_exps_bias, (n_exp, n_embd)))
        shared = (self.shexp_gate, self.shexp_up, self.shexp_down)
        if any(t is not None for t in shared):
            if any(t is None for t in shared):
                raise ConfigError(
                    f"layer {self.layer}: the shared expert needs gate, up and down, got shapes "
                    f"{_shape(self.shexp_gate)}, {_shape(self.shexp_up)}, {_shape(self.shexp_down)}"
                )
            assert self.shexp_gate is not None
            gate = _f32_matrix("shexp_gate", self.shexp_gate, None)
            n_ff_sh = gate.shape[0]
            object.__setattr__(self, "shexp_gate", _f32_matrix("shexp_gate", gate, (n_ff_sh, n_embd)))
            object.__setattr__(self, "shexp_up", _f32_matrix("shexp_up", self.shexp_up, (n_ff_sh, n_embd)))
            object.__setattr__(self, "shexp_down", _f32_matrix("shexp_down", self.shexp_down, (n_embd, n_ff_sh)))
        gate_inp = self.shexp_gate_inp
        if gate_inp is not None:
            if isinstance(gate_inp, np.ndarray) and gate_inp.ndim == 2 and gate_inp.shape[0] == 1:
                gate_inp = gate_inp.reshape(-1)  # ggml {n_embd, 1}
            if self.shexp_gate is None:
                raise ConfigError(f"layer {self.layer}: ffn_gate_inp_shexp without a shared expert")
        object.__setattr__(self, "shexp_gate_inp", _f32_vector("shexp_gate_inp", gate_inp, n_embd))

    @property
    def n_layer_experts(self) -> int:
        """Router outputs of this layer (all banks together)."""
        return int(self.router.shape[0])

    @property
    def n_embd(self) -> int:
        """Hidden size."""
        return int(self.router.shape[1])

    @property
    def has_shared(self) -> bool:
        """Whether this layer has a shared expert."""
        return self.shexp_gate is not None

    @classmethod
    def from_tensors(
        cls,
        layer: int,
        tensor: TensorGetter,
        hparams: MoEHParams,
        token_experts: np.ndarray | None = None,
        tensor_type: Callable[[str], GGMLQuantizationType | None] | None = None,
    ) -> ResidentLayer:
        """Collect a layer's resident weights through ``tensor(name)``.

        Tensor names are those of docs/notes/FORMATS.md section 1: ``blk.L.ffn_gate_inp.weight`` (required),
        ``blk.L.ffn_gate_inp.bias``, ``blk.L.exp_probs_b.bias``, ``blk.L.ffn_{gate,up,down}_exps.bias``
        (mixed-tier banks: followed by ``..._exps_tierN.bias``, concatenated in bank order),
        ``blk.L.ffn_gate_up_exps.bias`` (split into gate and up halves),
        ``blk.L.ffn_{gate,up,down}_shexp.weight`` and ``blk.L.ffn_gate_inp_shexp.weight``.

        Args:
            layer: the block index ``L``.
            tensor: returns the named tensor as a float32 array in numpy order (ggml dims reversed),
                dequantized, or None when the model has no such tensor.
            hparams: the model's MoE parameters; used to refuse dense layers and check widths.
            token_experts: ``blk.L.ffn_gate_tid2eid.weight`` as ``(n_vocab, k)`` integers (ggml
                ``{k, n_vocab}`` I32), required for a hash-routed layer (``hparams.is_hash_layer``).
            tensor_type: the ggml type of the named tensor in the file (None: unknown, taken as F32):
                gives :attr:`shexp_types`.

        Returns:
            The layer's resident weights.

        Raises:
            ConfigError: the layer is one of the leading dense blocks or out of range, the router is
                missing, a tensor is not float32, or shapes disagree (the message has the numbers).
            FormatError: a hash-routed layer has no token table, or the table's shape or ids do not
                fit the layer.
        """
        if not hparams.is_moe_layer(layer):
            raise ConfigError(
                f"layer {layer} has no routed experts (leading dense blocks: {hparams.n_layer_dense_lead}, "
                f"layers: {hparams.n_layer})"
            )
        prefix = f"blk.{layer}."
        router = _router(layer, tensor, hparams)
        gate_b, up_b, down_b = _expert_biases(prefix, tensor)
        token_experts = _token_table(layer, hparams, token_experts)
        scaled = hparams.expert_scales

        def scale(name: str) -> np.ndarray | None:
            value = tensor(name) if scaled else None
            return None if value is None else value.reshape(-1)

        def one(name: str) -> float | None:
            return _one_value(name, tensor(name)) if scaled else None

        resident = cls(
            layer=layer,
            router=router,
            router_bias=tensor(prefix + "ffn_gate_inp.bias"),
            selection_bias=tensor(prefix + "exp_probs_b.bias"),
            gate_exps_bias=gate_b,
            up_exps_bias=up_b,
            down_exps_bias=down_b,
            shexp_gate=tensor(prefix + "ffn_gate_shexp.weight"),
            shexp_up=tensor(prefix + "ffn_up_shexp.weight"),
            shexp_down=tensor(prefix + "ffn_down_shexp.weight"),
            shexp_gate_inp=tensor(prefix + "ffn_gate_inp_shexp.weight"),
            token_experts=token_experts,
            gate_exps_scale=scale(prefix + "ffn_gate_exps.scale"),
            up_exps_scale=scale(prefix + "ffn_up_exps.scale"),
            down_exps_scale=scale(prefix + "ffn_down_exps.scale"),
            shexp_gate_scale=one(prefix + "ffn_gate_shexp.scale"),
            shexp_up_scale=one(prefix + "ffn_up_shexp.scale"),
            shexp_down_scale=one(prefix + "ffn_down_shexp.scale"),
            shexp_types=_shexp_types(prefix, tensor_type),
        )
        width = hparams.expert_width(layer)
        if resident.gate_exps_bias is not None and width and resident.gate_exps_bias.shape[1] != width:
            raise ConfigError(
                f"layer {layer}: expert biases are {resident.gate_exps_bias.shape[1]} wide, n_ff_exp is {width}"
            )
        return resident


def _router(layer: int, tensor: TensorGetter, hparams: MoEHParams) -> np.ndarray:
    """``blk.L.ffn_gate_inp.weight`` as ``(n_experts, n_embd)`` float32, checked against the hparams."""
    name = f"blk.{layer}.ffn_gate_inp.weight"
    router = tensor(name)
    if router is None:
        raise ConfigError(f"layer {layer}: missing router tensor {name}")
    router = _f32_matrix(name, router, None)
    if router.shape[1] != hparams.n_embd:
        raise ConfigError(f"layer {layer}: router is {router.shape}, expected (n_experts, {hparams.n_embd})")
    if router.shape[0] > hparams.n_expert:
        raise ConfigError(
            f"layer {layer}: router has {router.shape[0]} outputs, more than expert_count={hparams.n_expert}"
        )
    return router


def _expert_biases(prefix: str, tensor: TensorGetter) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The routed experts' gate, up and down biases: per bank (``_exps``, then ``_exps_tierN``,
    concatenated in bank order), or halves of the merged ``ffn_gate_up_exps.bias``."""

    def banked(proj: str) -> np.ndarray | None:
        first = tensor(f"{prefix}ffn_{proj}_exps.bias")
        if first is None:
            return None
        parts = [first]
        for tier in range(1, _MAX_TIERS + 1):
            part = tensor(f"{prefix}ffn_{proj}_exps_tier{tier}.bias")
            if part is None:
                break
            parts.append(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    gate_b, up_b, down_b = banked("gate"), banked("up"), banked("down")
    gate_up_b = tensor(prefix + "ffn_gate_up_exps.bias")
    if gate_up_b is not None:
        gate_up_b = _f32_matrix(prefix + "ffn_gate_up_exps.bias", gate_up_b, None)
        half = gate_up_b.shape[1] // 2
        gate_b, up_b = gate_up_b[:, :half], gate_up_b[:, half:]
    return gate_b, up_b, down_b


def _token_table(layer: int, hparams: MoEHParams, token_experts: np.ndarray | None) -> np.ndarray | None:
    """The token-to-experts table of a hash-routed layer (deepseek4), checked; None for other layers."""
    if not hparams.is_hash_layer(layer):
        return None
    name = f"blk.{layer}.ffn_gate_tid2eid.weight"
    if token_experts is None:
        raise FormatError(
            f"layer {layer} is hash-routed ({hparams.arch}.hash_layer_count={hparams.n_hash_layers}) "
            f"but the model has no {name}"
        )
    if token_experts.ndim != 2 or token_experts.shape[1] != hparams.n_expert_used:
        raise FormatError(
            f"{name} is {tuple(reversed(token_experts.shape))} (ggml order), "
            f"expected {{{hparams.n_expert_used}, n_vocab}}"
        )
    return token_experts


def _one_value(name: str, value: np.ndarray | None) -> float | None:
    """A one-value tensor (a per-tensor scale) as a float; None when absent."""
    if value is None:
        return None
    if value.size != 1:
        raise ConfigError(f"{name} has {value.size} values, expected 1")
    return float(value.reshape(-1)[0])


# --------------------------------------------------------------------------------------------------
# routing


def router_logits(x: np.ndarray, resident: ResidentLayer, *, invariant: bool = False) -> np.ndarray:
    """Router logits ``x @ router.T (+ router_bias)`` (``ffn_moe_logits``, ``ffn_moe_logits_biased``).

    Where numba serves, every row's sums are ggml-cpu's ``ggml_vec_dot_f32`` of the AVX2 build
    (:mod:`aioexperts._compute.kernels.floats`), whatever the batch: a decode row as a fan-out over
    the cores (:func:`router_row_logits`), several rows in one compiled call; so prefill, a decode
    row and a batched decode step route a row alike. Otherwise BLAS.

    Args:
        x: ``(n_tokens, n_embd)`` float32.
        resident: the layer's resident weights.
        invariant: each row bit for bit its one-row result also where BLAS serves (rows of several
            sequences' decode steps; always so with numba).

    Returns:
        ``(n_tokens, n_layer_experts)`` float32.

    Raises:
        InvalidRequestError: ``x`` is not a float32 ``(n_tokens, n_embd)`` array.
    """
    x = check_activations(x, resident.n_embd)
    logits = np.empty((x.shape[0], resident.router.shape[0]), dtype=np.float32)
    rows = _fused.compiled_kernel("floats", "matmat_f32_rows") if x.shape[0] > 1 else None
    if x.shape[0] > 1 and rows is None and not invariant:
        with np.errstate(over="ignore", invalid="ignore"):  # finite x, logits out of range: the caller refuses
            logits = _dense(resident.router, x)
    elif rows is None or not rows(resident.router.view(np.uint8), x, logits):
        for i in range(x.shape[0]):  # a decode row, or rows as they go alone (one not finite, or BLAS)
            _row_logits(x[i : i + 1], resident, logits[i])
    if resident.router_bias is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            logits += resident.router_bias
    return logits


def router_row_logits(x: np.ndarray, resident: ResidentLayer, out: np.ndarray) -> None:
    """One decode row's router logits without the bias: ``out = router @ x[0]``.

    Where numba serves, the router's rows are split over the compute pool's threads as one
    fan-out (:func:`aioexperts._compute.grouped.f32_split_plan`, each sum ggml's
    ``ggml_vec_dot_f32`` of the AVX2 build); else, or for a row that is not finite, BLAS
    (``np.matmul``). Either way a row's logits do not depend on the other rows of a call.

    Args:
        x: ``(1, n_embd)`` float32, C-contiguous.
        resident: the layer's resident weights.
        out: ``(n_layer_experts,)`` float32, C-contiguous, written.

    Raises:
        InvalidRequestError: ``x`` is not so shaped (the compiled product reads its memory as such).
        ConfigError: ``out`` is not.
    """
    router = resident.router
    if not (
        isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (1, router.shape[1]) and x.flags.c_contiguous
    ):
        raise InvalidRequestError(
            f"x must be a C-contiguous float32 array of shape (1, {router.shape[1]}), got {describe(x)}"
        )
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == np.float32
        and out.shape == (router.shape[0],)
        and out.flags.c_contiguous
    ):
        raise ConfigError(
            f"out must be a C-contiguous float32 array of shape ({router.shape[0]},), got {describe(out)}"
        )
    _row_logits(x, resident, out)


def prepare_router_row(resident: ResidentLayer) -> None:
    """Make the plan of :func:`router_row_logits` for the current compute pool now (at load), not
    in the first decode step. Nothing where numba does not serve."""
    _router_row_plan(resident)


def _router_row_plan(resident: ResidentLayer) -> Any:
    """The router's one-row split plan for the current compute pool (made once per pool size and
    kept on ``resident``), or None where numba does not serve."""
    task = f32_task()
    if task is None:
        return None
    pool = _pool_module._current_pool()
    key = (1 if pool is None else pool.n_threads, task.address)
    plan = resident._row_plans.get(key)
    if plan is None:
        plan = resident._row_plans.setdefault(key, f32_split_plan(resident.router, key[0]))
    return plan


def _row_logits(x: np.ndarray, resident: ResidentLayer, out: np.ndarray) -> None:
    """:func:`router_row_logits` of arguments already checked."""
    plan = _router_row_plan(resident)
    if plan is not None and plan.run(x, out):
        return
    with np.errstate(over="ignore", invalid="ignore"):  # the compiled product warns of nothing either
        np.matmul(x[0], resident.router.T, out=out)


def route(
    x: np.ndarray,
    resident: ResidentLayer,
    hparams: MoEHParams,
    token_ids: ArrayLike | None = None,
    *,
    invariant: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose the experts of each token: :func:`router_logits`, then :func:`select_experts`.

    In a hash-routed layer (``hparams.is_hash_layer``, DeepSeek-V4's first ``hash_layer_count``
    blocks) the ids are the rows of ``resident.token_experts`` for ``token_ids`` and no selection
    bias applies; the router still gives the weights (deepseek4.cpp: ``selected_experts =
    ggml_get_rows(ffn_gate_tid2eid, inp_tokens)``, ``exp_probs_b = nullptr``).

    Args:
        x: ``(n_tokens, n_embd)`` float32, the MoE block's input (after the FFN norm).
        resident: the layer's resident weights (router, optional router and selection biases).
        hparams: the model's MoE parameters.
        token_ids: ``(n_tokens,)`` integer token ids of the rows of ``x`` (any integer array-like:
            a list, a numpy array of any integer dtype); required in a hash-routed layer, ignored
            elsewhere.
        invariant: each row's choice and weights bit for bit those it gets alone (the router
            product through :func:`aioexperts._compute.fused.linear_rows`; the selection is per row).

    Returns:
        ``(ids, weights)``, both ``(n_tokens, n_expert_used)``: int32 ids in llama.cpp's order and
        float32 routing weights (normalised and scaled as the model says).

    Raises:
        InvalidRequestError: ``x`` has the wrong dtype or shape; in a hash-routed layer
            ``token_ids`` is missing, not ``(n_tokens,)`` integers, or a token id is outside the
            table's vocabulary.
        ConfigError: ``hparams`` does not fit the router (``n_embd``, k, groups), or a hash-routed
            layer has no token table.
    """
    if resident.n_embd != hparams.n_embd:
        raise ConfigError(f"resident layer has n_embd={resident.n_embd}, hparams n_embd={hparams.n_embd}")
    if not hparams.is_hash_layer(resident.layer):
        return select_experts(router_logits(x, resident, invariant=invariant), hparams, resident.selection_bias)
    table = resident.token_experts
    if table is None:
        raise ConfigError(f"layer {resident.layer} is hash-routed but its resident weights have no token table")
    x = check_activations(x, resident.n_embd)
    ids = check_token_ids(token_ids, len(x), table.shape[0], resident.layer)
    return select_experts(router_logits(x, resident, invariant=invariant), hparams, None, selected=table[ids])


def check_token_ids(token_ids: object, n_tokens: int, n_vocab: int, layer: int) -> np.ndarray:
    """``token_ids`` as ``(n_tokens,)`` int64 ids in ``0..n_vocab-1``, or InvalidRequestError.

    Args:
        token_ids: the token ids of the rows of a hash-routed layer's input (any integer array-like).
        n_tokens: rows of the input.
        n_vocab: rows of the layer's token table (``ffn_gate_tid2eid``).
        layer: the block index, for the message.

    Raises:
        InvalidRequestError: missing, not integers (floats, bools, strings), the wrong length, or an
            id out of range.
    """
    if token_ids is None:
        raise InvalidRequestError(
            f"layer {layer} routes by token id (hash-routed, ffn_gate_tid2eid): pass the token ids of the rows, "
            "token_ids=..."
        )
    ids = as_int_array(token_ids, "token_ids", (n_tokens,))
    if n_tokens and (int(ids.min()) < 0 or int(ids.max()) >= n_vocab):
        raise InvalidRequestError(
            f"layer {layer}: token ids must be in 0..{n_vocab - 1} (the table's vocabulary), "
            f"got {int(ids.min())}..{int(ids.max())}"
        )
    return ids


# --------------------------------------------------------------------------------------------------
# the MoE block


@dataclass(frozen=True, slots=True, eq=False)
class MoEOutput:
    """What :func:`moe_forward` computes for a batch of tokens.

    Attributes:
        moe_out: ``(n_tokens, n_embd)`` float32, the routed experts' weighted sum (``ffn_moe_out``).
        shared_out: ``(n_tokens, n_embd)`` float32, the shared expert's output after its gate, or
            None when the layer has no shared expert.
        ffn_out: ``(n_tokens, n_embd)`` float32, ``moe_out + shared_out`` (the same array as
            ``moe_out`` when there is no shared expert).
        expert_out: ``(n_tokens, k, n_embd)`` float32, each slot's expert output before weighting
            (``ffn_moe_down`` plus bias), zeros for inactive slots; None unless asked for.
    """

    moe_out: np.ndarray
    shared_out: np.ndarray | None
    ffn_out: np.ndarray
    expert_out: np.ndarray | None = None


def moe_forward(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: Mapping[int, ExpertView],
    resident: ResidentLayer,
    hparams: MoEHParams,
    *,
    expert_out: bool = False,
) -> MoEOutput:
    """Run the MoE block on a batch of tokens: routed experts plus the shared expert.

    Per selected expert ``e`` and token ``t`` (llama.cpp ``build_moe_ffn``):
    ``g = W_gate[e] x_t (+ b_gate[e])``, ``u = W_up[e] x_t (+ b_up[e])`` (``ffn_moe_gate``,
    ``ffn_moe_up``, ``ffn_moe_*_biased``); ``a = act(g, u)`` with SwiGLU ``silu(g) * u``
    (``ggml_swiglu_split``) or gpt-oss ``swiglu_oai`` (``g = min(g, limit)``,
    ``u = clip(u, -limit, limit)``, ``g * sigmoid(alpha * g) * (u + 1)``) or GeGLU ``gelu(g) * u``
    (``ggml_geglu_split``, grok); ``a`` is zero-padded to the
    down projection's width when that is wider (docs/notes/FORMATS.md section 2); ``y = W_down[e] a (+ b_down[e])``
    (``ffn_moe_down``); ``moe_out_t = sum_i weights[t, i] * y_i`` over the k slots in slot order
    (``ffn_moe_weighted``, ``ffn_moe_out``). A slot with id ``-1`` is inactive: it needs no view and
    contributes zero. The weights come from :func:`route` and already include the model's weight
    scale; nothing here rescales, so the scale touches the routed part only, never the shared part.
    With ``hparams.weights_before_experts`` (llama4, ``weight_before_ffn``) each slot's input is
    ``weights[t, i] * x_t`` and the slot outputs are summed unweighted.

    Shared expert (``build_ffn(.., LLM_FFN_SILU, LLM_FFN_PAR)``): ``s = W_down_sh (silu(W_gate_sh x) *
    (W_up_sh x))``, times ``sigmoid(x . w_gate_inp_shexp)`` when the layer has that gate (Qwen2-MoE;
    llama.cpp writes it ``silu(v) / v``). ``ffn_out = moe_out + shared_out``.

    Each selected expert is dequantized once per call, however many tokens chose it (tokens are
    grouped by expert and run as one matrix product). Every ``ExpertView`` carries its own ggml types
    and shapes, so experts of a mixed-tier layer may come from banks of different types.

    Args:
        x: ``(n_tokens, n_embd)`` float32, the MoE block's input.
        ids: ``(n_tokens, k)`` integer expert ids (global, i.e. router output indices), ``-1`` for an
            inactive slot.
        weights: ``(n_tokens, k)`` float32 routing weights.
        experts: global expert id -> its pinned :class:`~aioexperts._format.views.ExpertView`; must hold
            every active id of ``ids`` (extra entries are ignored).
        resident: the layer's resident weights (expert biases, shared expert).
        hparams: the model's MoE parameters (activation, widths).
        expert_out: also return each slot's unweighted expert output (for tests; costs
            ``n_tokens * k * n_embd * 4`` bytes).

    Returns:
        The routed, shared and total outputs.

    Raises:
        InvalidRequestError: ``x``, ``ids`` or ``weights`` has the wrong dtype or shape, an id is out
            of range, an active id has no view in ``experts``, or a view's layer, id or shapes do not
            fit this layer (the message has the numbers).
        ConfigError: ``resident`` and ``hparams`` disagree.
    """
    plan = plan_moe(x, ids, weights, resident, hparams)
    outputs = expert_outputs([plan], experts, plan.experts, shared=True)[0]
    return combine_moe(plan, outputs, expert_out=expert_out)


@dataclass(frozen=True, slots=True, eq=False)
class MoEPlan:
    """One call's rows grouped by expert (:func:`plan_moe`), checked, before any expert is read.

    Attributes:
        x: ``(n_tokens, n_embd)`` float32 input.
        ids: ``(n_tokens, k)`` int64 expert ids (``-1``: inactive slot).
        weights: ``(n_tokens, k)`` float32 routing weights.
        positions: expert id -> its flat ``token * k + slot`` positions, tokens ascending; experts
            ascending (the order :func:`moe_forward` computes them in).
        resident: the layer's resident weights.
        hparams: the model's MoE parameters.
    """

    x: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    positions: dict[int, np.ndarray]
    resident: ResidentLayer
    hparams: MoEHParams

    @property
    def experts(self) -> list[int]:
        """The distinct active experts, ascending."""
        return list(self.positions)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertOutputs:
    """What :func:`expert_outputs` computed for one :class:`MoEPlan`.

    Attributes:
        rows: expert id -> ``(n_positions, n_embd)`` float32, the expert's output for each of its
            positions (in the plan's order).
        shared_out: ``(n_tokens, n_embd)`` float32 shared expert output, or None (none asked for,
            or the layer has none).
    """

    rows: dict[int, np.ndarray]
    shared_out: np.ndarray | None = None


def plan_moe(
    x: np.ndarray, ids: np.ndarray, weights: np.ndarray, resident: ResidentLayer, hparams: MoEHParams
) -> MoEPlan:
    """Check one call's input and routing and group its ``(token, slot)`` pairs by expert.

    Args:
        x, ids, weights, resident, hparams: as :func:`moe_forward`.

    Returns:
        The plan; no expert view is needed yet.

    Raises:
        InvalidRequestError: ``x``, ``ids`` or ``weights`` has the wrong dtype or shape, or an id is
            out of range.
        ConfigError: ``resident`` and ``hparams`` disagree.
    """
    n_embd = hparams.n_embd
    if resident.n_embd != n_embd:
        raise ConfigError(f"resident layer has n_embd={resident.n_embd}, hparams n_embd={n_embd}")
    x = check_activations(x, n_embd)
    ids, weights = _check_routing(ids, weights, x.shape[0], resident.n_layer_experts)
    flat = ids.reshape(-1)
    if ids.shape[0] == 1:  # a decode row: no sort, no unique (the same dict, the same arrays' values)
        one = _one_row_positions(flat.tolist())
        if one is not None:
            return MoEPlan(x, ids, weights, one, resident, hparams)
    positions = np.flatnonzero(flat >= 0)
    by_expert: dict[int, np.ndarray] = {}
    if positions.size:
        # group the (token, slot) pairs by expert; a stable sort keeps tokens ascending per expert
        chosen = flat[positions]
        order = np.argsort(chosen, kind="stable")
        positions, chosen = positions[order], chosen[order]
        uniq, starts = np.unique(chosen, return_index=True)
        ends = np.append(starts[1:], chosen.size)
        for e, lo, hi in zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True):
            by_expert[e] = positions[lo:hi]
    return MoEPlan(x, ids, weights, by_expert, resident, hparams)


def plan_routed_row(
    x: np.ndarray, ids: np.ndarray, weights: np.ndarray, resident: ResidentLayer, hparams: MoEHParams
) -> MoEPlan | None:
    """:func:`plan_moe` of one token routed by :func:`route` from ``x`` (checked by the caller; its
    ``k`` ids distinct and in range, its weights float32 ``(1, k)``), without checking them again:
    the same plan; None when the ids are not ``k`` distinct active ones (the caller takes
    :func:`plan_moe`)."""
    one = _one_row_positions(ids[0].tolist())
    if one is None:
        return None
    return MoEPlan(x, np.ascontiguousarray(ids, dtype=np.int64), weights, one, resident, hparams)


_SLOT_POSITIONS: dict[int, tuple[np.ndarray, ...]] = {}


def _one_row_positions(row: list[int]) -> dict[int, np.ndarray] | None:
    """:func:`plan_moe`'s ``positions`` of a one-token routing whose ``k`` ids are active and
    distinct (else None): expert id ascending -> its slot, as a read-only one-element intp array
    shared by every call (built once per ``k``)."""
    k = len(row)
    if min(row) < 0 or len(set(row)) != k:
        return None
    slots = _SLOT_POSITIONS.get(k)
    if slots is None:
        base = np.arange(k, dtype=np.intp)
        base.flags.writeable = False
        slots = _SLOT_POSITIONS[k] = tuple(base[i : i + 1] for i in range(k))
    return {row[i]: slots[i] for i in sorted(range(k), key=row.__getitem__)}


def expert_outputs(
    plans: Sequence[MoEPlan], experts: Mapping[int, ExpertView], wanted: Iterable[int], *, shared: bool
) -> list[ExpertOutputs]:
    """Compute the ``wanted`` experts' outputs for every plan (one layer), and the shared expert.

    Every view is checked before any work. Each distinct expert is one job on the compute pool that
    runs the rows of every plan that chose it, plan by plan, with the kernel that plan alone would
    use (so each plan's numbers are those of :func:`moe_forward` on that plan alone, whatever the
    other plans); the shared expert is one job per plan.

    Args:
        plans: calls of one layer (:func:`plan_moe`), all with the same ``resident`` and ``hparams``.
        experts: expert id -> pinned view; must hold every wanted expert some plan chose.
        wanted: the experts to compute now (others are skipped: computed by another call).
        shared: also compute the shared expert of each plan (when the layer has one).

    Returns:
        One :class:`ExpertOutputs` per plan, holding the wanted experts that plan chose.

    Raises:
        InvalidRequestError: a wanted, chosen expert has no view, or a view does not fit the layer.
    """
    if not plans:
        return []
    resident, hparams = plans[0].resident, plans[0].hparams
    n_embd = hparams.n_embd
    chosen = sorted({e for e in wanted if any(e in p.positions for p in plans)})
    views = _lookup_views(experts, np.asarray(chosen, dtype=np.int64), resident.layer)
    width = hparams.expert_width(resident.layer)
    for e, view in zip(chosen, views, strict=True):
        _check_view(view, e, n_embd, width)  # every view, before any work
    with_shared = shared and resident.has_shared
    classes = _group_classes(resident, hparams, views) if len(plans) == 1 and len(plans[0].x) == 1 else None
    if classes is not None:
        return [_grouped_outputs(plans[0], chosen, views, classes, with_shared)]
    jobs: list[tuple[int, ExpertView | None]] = [(e, v) for e, v in zip(chosen, views, strict=True)]
    if len(plans) == 1 and len(plans[0].x) > 1:
        # a prefill: the experts with the most tokens first, so the pool's threads end together
        # (the workers take the jobs in order; each expert's numbers do not depend on it)
        positions = plans[0].positions
        jobs.sort(key=lambda job: -len(positions[job[0]]))
    if with_shared:
        jobs.extend((-1 - i, None) for i in range(len(plans)))

    def run(job: tuple[int, ExpertView | None]) -> list[np.ndarray]:
        # float32 overflow (inputs far out of the model's range) gives inf/NaN like ggml, no warning:
        # the runner refuses a non-finite output with InvalidRequestError
        e, view = job
        with np.errstate(over="ignore", invalid="ignore"):
            if view is None:
                p = plans[-1 - e]
                return [_shared_forward(p.x, resident, hparams.shared_clamp(resident.layer))]
            return expert_rows(plans, e, view)

    # spread over the compute pool's idle workers; each result is computed by one thread, so the
    # numbers do not depend on the spread
    results = compute_pool().map(run, jobs)
    found: list[ExpertOutputs] = [ExpertOutputs({}) for _ in plans]
    for (e, job_view), ys in zip(jobs, results, strict=True):
        if job_view is None:
            i = -1 - e
            found[i] = ExpertOutputs(found[i].rows, ys[0])
            continue
        chose = (i for i, p in enumerate(plans) if e in p.positions)
        for i, y in zip(chose, ys, strict=True):
            found[i].rows[e] = y
    return found


def _group_classes(resident: ResidentLayer, hparams: MoEHParams, views: Sequence[ExpertView]) -> list[list[int]] | None:
    """:func:`~aioexperts._compute.decode_experts.group_classes` of one token's experts, or None
    (the per-expert path) where the layer has per-expert scales or biases or scales the input."""
    if not _groups_serve(resident, hparams):
        return None
    return group_classes(views)


def _groups_serve(resident: ResidentLayer, hparams: MoEHParams) -> bool:
    """Whether a layer's experts may go as groups (:func:`expert_group`, a :class:`RowStep`): no
    per-expert scales or biases, no weights applied to the input."""
    return not (
        hparams.weights_before_experts
        or resident.gate_exps_scale is not None
        or resident.up_exps_scale is not None
        or resident.down_exps_scale is not None
        or resident.gate_exps_bias is not None
        or resident.up_exps_bias is not None
        or resident.down_exps_bias is not None
    )


def _grouped_outputs(
    plan: MoEPlan, chosen: list[int], views: list[ExpertView], classes: list[list[int]], with_shared: bool
) -> ExpertOutputs:
    """:func:`expert_outputs` of a one-token plan through expert groups: each class of experts of
    one type is one :func:`~aioexperts._compute.decode_experts.expert_group` call, whose products
    spread over the cores as one fan-out each (no compute-pool item per expert); the shared expert
    after them. A class that meets a non-finite value takes the general path."""
    resident, hparams = plan.resident, plan.hparams
    x = np.ascontiguousarray(plan.x, dtype=np.float32)
    activation = expert_activation(hparams, resident.layer)
    rows: dict[int, np.ndarray] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for members in classes:
            ys = expert_group(x, [views[i] for i in members], activation)
            if ys is None:
                ys = np.concatenate([expert_rows([plan], chosen[i], views[i])[0] for i in members])
            for j, i in enumerate(members):
                rows[chosen[i]] = ys[j : j + 1]
        shared = _shared_forward(x, resident, hparams.shared_clamp(resident.layer)) if with_shared else None
    return ExpertOutputs(rows, shared)


#: a layer's :class:`~aioexperts._compute.decode_experts.RowStep`, or None where none serves
RowSteps = dict[int, RowStep | None]


def row_ffn_out(plan: MoEPlan, views: Sequence[ExpertView], steps: RowSteps) -> np.ndarray | None:
    """``ffn_out`` of a one-token plan whose ``k`` slots hold ``k`` distinct experts, through its
    layer's prepared :class:`~aioexperts._compute.decode_experts.RowStep` (made on the layer's first
    call and kept in ``steps``): the bits of :func:`expert_outputs` then :func:`combine_moe`,
    with about a tenth of their Python.

    Args:
        plan: the call (:func:`plan_moe`).
        views: the pinned views of the plan's experts in slot order.
        steps: the caller's steps by layer (one precision and kernel backend).

    Returns:
        ``(1, n_embd)`` float32 (not checked finite); None where the step does not serve (more
        than one token, repeated or inactive slots, per-expert scales or biases, several classes of
        experts, a busy step, a non-finite value): the caller takes the general path.

    Raises:
        InvalidRequestError: a view does not fit the layer (as :func:`expert_outputs`).
    """
    ids = plan.ids
    if ids.shape[0] != 1 or len(plan.positions) != ids.shape[1] or len(views) != ids.shape[1]:
        return None
    resident = plan.resident
    layer = resident.layer
    step = steps.get(layer, _NO_STEP)
    if step is _NO_STEP:
        step = _new_row_step(plan, views)
        steps[layer] = step
    if step is None or not step.fits(views):
        return None
    return _with_shared(plan, step.run(plan.x, views, plan.weights[0]))


def row_ffn_out_at(plan: MoEPlan, table: ExpertTable, steps: RowSteps) -> np.ndarray | None:
    """:func:`row_ffn_out` of a plan whose experts ``table`` locates (every expert of the layer held
    in place: :meth:`aioexperts.ExpertStore.hold_resident`), through the step :func:`row_ffn_out`
    prepared: the same bits, without a view per expert.

    Args:
        plan: the call (:func:`plan_moe`).
        table: the plan's layer's table, valid for the call.
        steps: the caller's steps by layer, as given to :func:`row_ffn_out`.

    Returns:
        As :func:`row_ffn_out`; also None when the layer has no prepared step yet or it serves
        another layout (the caller goes on with views).

    Raises:
        ConfigError: an expert id outside the table.
    """
    ids = plan.ids
    if ids.shape[0] != 1 or len(plan.positions) != ids.shape[1] or ids.dtype != np.int64:
        return None
    step = steps.get(plan.resident.layer)
    if step is None:  # made after a prefill (ResidentPass.prepare), else here
        step = prepare_row_step(plan.resident, plan.hparams, ids.shape[1], table, steps)
    if step is None or step is _NO_STEP or step.n != ids.shape[1] or step.layout != table.layout:
        return None
    return _with_shared(plan, step.run_at(plan.x, ids[0], table.addresses, plan.weights[0]))


def prepare_row_step(
    resident: ResidentLayer, hparams: MoEHParams, k: int, table: ExpertTable, steps: RowSteps
) -> RowStep | None:
    """The decode step :func:`row_ffn_out_at` runs for ``k`` experts of ``resident``'s layer located
    by ``table``: the one in ``steps``, or one made now from the table's layout (no views) and kept
    there; None where the layer has no such step (the views path serves it).

    A prefill of a model held whole calls this for every layer (:meth:`aioexperts._executor.ResidentPass.prepare`)
    so that the first decode token makes none.
    """
    layer = resident.layer
    step = steps.get(layer)
    if step is None and layer not in steps:  # no step yet: made from the table's layout, no views
        step = _row_step_for_layout(resident, hparams, k, table.layout)
        if step is not None:
            steps[layer] = step
    return None if step is _NO_STEP else step


def _with_shared(plan: MoEPlan, y: np.ndarray | None) -> np.ndarray | None:
    """A row step's output ``y`` plus the plan's shared expert, if the layer has one."""
    resident = plan.resident
    if y is None or not resident.has_shared:
        return y
    with np.errstate(over="ignore", invalid="ignore"):
        out: np.ndarray = y + _shared_forward(plan.x, resident, plan.hparams.shared_clamp(resident.layer))
    return out


_NO_STEP: RowStep | None = object()  # type: ignore[assignment]


def _row_step_for_layout(resident: ResidentLayer, hparams: MoEHParams, k: int, layout: LayoutKey) -> RowStep | None:
    """:func:`_new_row_step` for ``k`` experts of ``layout`` (a layer's table), or None (not kept: the
    views path then makes the step, or raises what a view that does not fit raises) where it would
    not give one, or where the layout's shapes do not fit the layer as :func:`_check_view` wants."""
    if not _groups_serve(resident, hparams):
        return None
    _, (gate_shape, up_shape, down_shape), _ = layout
    n_embd, width = hparams.n_embd, hparams.expert_width(resident.layer)
    rows = gate_shape[0]
    if gate_shape != (rows, n_embd) or up_shape != gate_shape or (width and rows != width):
        return None
    if len(down_shape) != 2 or down_shape[0] != n_embd or down_shape[1] < rows:
        return None
    return row_step_for_layout(layout, k, expert_activation(hparams, resident.layer))


def _new_row_step(plan: MoEPlan, views: Sequence[ExpertView]) -> RowStep | None:
    resident, hparams = plan.resident, plan.hparams
    width = hparams.expert_width(resident.layer)
    for e, view in zip(plan.ids[0].tolist(), views, strict=True):
        _check_view(view, e, hparams.n_embd, width)
    if _group_classes(resident, hparams, views) is None:
        return None
    return row_step(views, expert_activation(hparams, resident.layer))


def expert_rows(plans: Sequence[MoEPlan], expert: int, view: ExpertView) -> list[np.ndarray]:
    """One expert's outputs for the rows every plan sent it: the batched path's one per-expert compute.

    Plans of one token each (decode steps, the only ones cross-request batching takes) go through
    the expert together, each projection one batch-invariant product
    (:func:`aioexperts._compute.fused.linear_rows`: each weight block decoded once for several
    rows, each row bit for bit its one-token result); other plans go one by one through the kernel
    that plan alone would use. Either way each plan's numbers are those of :func:`moe_forward` on
    that plan alone, whatever the other plans.

    Args:
        plans: calls of one layer (:func:`plan_moe`), all with the same ``resident`` and ``hparams``.
        expert: the expert id; plans that did not choose it are skipped.
        view: the expert's pinned, checked view (:func:`expert_outputs` checks it).

    Returns:
        One ``(n_positions, n_embd)`` float32 array per plan that chose ``expert``, in plan order.
    """
    chosen = [(p, pos) for p in plans if (pos := p.positions.get(expert)) is not None]
    if len(chosen) > 1 and all(len(p.x) == 1 for p, _ in chosen):
        p0 = chosen[0][0]
        x = np.concatenate([p.x[pos // p.ids.shape[1]] for p, pos in chosen])
        in_scale = (
            np.concatenate([p.weights.reshape(-1)[pos] for p, pos in chosen])
            if p0.hparams.weights_before_experts
            else None
        )
        rows = np.arange(len(x))
        y = _expert_forward(x, rows, expert, view, p0.resident, p0.hparams, _workspace(), in_scale, invariant=True)
        return [y[i : i + 1] for i in range(len(chosen))]
    out: list[np.ndarray] = []
    for p, pos in chosen:
        resident, hparams = p.resident, p.hparams
        k = p.ids.shape[1]
        # llama4 (weight_before_ffn): each slot's input is scaled by its weight, outputs sum unweighted
        in_scale = p.weights.reshape(-1)[pos] if hparams.weights_before_experts else None
        out.append(_expert_forward(p.x, pos // k, expert, view, resident, hparams, _workspace(), in_scale))
    return out


def combine_moe(
    plan: MoEPlan, parts: ExpertOutputs | Sequence[ExpertOutputs], *, expert_out: bool = False
) -> MoEOutput:
    """The weighted sum over the k slots in slot order, plus the shared expert: one plan's output.

    The expert outputs may come in several parts (computed at different times, e.g. the resident
    experts first); they are placed by ``(token, slot)`` before any sum, so the result does not
    depend on how they were split or in which order they arrived.

    Args:
        plan: the call (:func:`plan_moe`).
        parts: the outputs of every expert the plan chose, in one or more parts.
        expert_out: as :func:`moe_forward`.

    Raises:
        InvalidRequestError: an expert the plan chose is in no part.
    """
    parts = [parts] if isinstance(parts, ExpertOutputs) else list(parts)
    x, ids, weights, hparams = plan.x, plan.ids, plan.weights, plan.hparams
    n_tokens, k = ids.shape
    if n_tokens == 1 and not expert_out and not hparams.weights_before_experts and len(plan.positions) == k:
        fast = _combine_one_row(plan, parts)  # a decode row, every slot active and distinct
        if fast is not None:
            return fast
    # every slot's expert output, then the weighted sum over the k slots in slot order, as
    # llama.cpp adds them (ffn_moe_weighted, then ggml_add of slot 0, 1, ..., k-1)
    slot_out = np.zeros((n_tokens, k, x.shape[1]), dtype=np.float32)
    shared_out = None
    rows: dict[int, np.ndarray] = {}
    for part in parts:
        rows.update(part.rows)
        if part.shared_out is not None:
            shared_out = part.shared_out
    missing = [e for e in plan.positions if e not in rows]
    if missing:
        raise InvalidRequestError(f"layer {plan.resident.layer}: no output for selected expert(s) {missing}")
    for e, pos in plan.positions.items():
        slot_out[pos // k, pos % k] = rows[e]

    slot_weights = np.float32(1.0) if hparams.weights_before_experts else weights
    active_weights = np.where(ids >= 0, slot_weights, np.float32(0.0))  # an inactive slot never counts
    weighted = slot_out * active_weights[:, :, None]
    moe_out = weighted[:, 0].copy()
    for i in range(1, k):
        moe_out += weighted[:, i]

    ffn_out = moe_out if shared_out is None else moe_out + shared_out
    return MoEOutput(
        moe_out=moe_out, shared_out=shared_out, ffn_out=ffn_out, expert_out=slot_out if expert_out else None
    )


def _combine_one_row(plan: MoEPlan, parts: list[ExpertOutputs]) -> MoEOutput | None:
    """:func:`combine_moe` of a one-token plan whose ``k`` slots hold ``k`` distinct experts, bit for
    bit: the slots' rows stacked ``(k, n_embd)`` and multiplied by their weights in one call each,
    then added in slot order (the same float32 products and sums as the general path, without its
    zeroed ``(1, k, n_embd)`` slot array and mask; ``np.add.accumulate`` would be slower: it loops
    over the slots per column); None when an expert's output is missing (the general path raises)."""
    rows: dict[int, np.ndarray] = parts[0].rows if len(parts) == 1 else {}
    shared_out = None
    if len(parts) > 1:
        for part in parts:
            rows.update(part.rows)
    for part in parts:
        if part.shared_out is not None:
            shared_out = part.shared_out
    ids, weights = plan.ids[0].tolist(), plan.weights[0]
    try:
        ys = [rows[e] for e in ids]
    except KeyError:
        return None
    weighted = np.concatenate(ys)
    if weighted.dtype != np.float32 or weighted.shape[0] != len(ys):
        return None
    weighted *= weights[:, None]
    moe_out = weighted[0:1].copy()
    for i in range(1, len(ys)):
        moe_out += weighted[i]
    ffn_out = moe_out if shared_out is None else moe_out + shared_out
    return MoEOutput(moe_out=moe_out, shared_out=shared_out, ffn_out=ffn_out)


# --------------------------------------------------------------------------------------------------
# internals


def _expert_forward(
    x: np.ndarray,
    rows: np.ndarray,
    expert: int,
    view: ExpertView,
    resident: ResidentLayer,
    hparams: MoEHParams,
    ws: _Workspace,
    in_scale: np.ndarray | None = None,
    invariant: bool = False,
) -> np.ndarray:
    """``down(act(gate x) * up x)`` of one expert for the tokens ``rows``; a fresh (n, n_embd) array.

    ``in_scale`` (``(n,)`` float32, llama4's ``weight_before_ffn``) multiplies each row of ``x`` first.
    ``invariant``: each row's result bit for bit the one it gets alone (the products are
    :func:`aioexperts._compute.fused.linear_rows`; everything else is elementwise).
    """
    n_embd = hparams.n_embd
    n_ff_exp, n_ff_down = _check_view(view, expert, n_embd, hparams.expert_width(resident.layer))
    n = rows.size
    xs = ws.take(x, rows, "xs")
    if in_scale is not None:
        xs = xs * in_scale[:, None]

    g = _project(view.gate, xs, ws.buf("g", (n, n_ff_exp)), invariant)
    u = _project(view.up, xs, ws.buf("u", (n, n_ff_exp)), invariant)
    if resident.gate_exps_scale is not None:  # build_lora_mm_id: before the bias
        g *= resident.gate_exps_scale[expert]
    if resident.up_exps_scale is not None:
        u *= resident.up_exps_scale[expert]
    if resident.gate_exps_bias is not None and resident.up_exps_bias is not None:  # both or neither
        g += resident.gate_exps_bias[expert]
        u += resident.up_exps_bias[expert]

    if n_ff_down > n_ff_exp:
        act = ws.buf("act", (n, n_ff_down))
        act[:, n_ff_exp:] = 0.0
        act_view = act[:, :n_ff_exp]
    else:
        act = act_view = ws.buf("act", (n, n_ff_exp))
    tmp = ws.buf("tmp", (n, n_ff_exp))
    expert_activation(hparams, resident.layer)(g, u, tmp, act_view)

    out = _project(view.down, act, None, invariant)
    if resident.down_exps_scale is not None:
        out *= resident.down_exps_scale[expert]
    if resident.down_exps_bias is not None:
        out += resident.down_exps_bias[expert]
    return out


def _shexp_types(
    prefix: str, tensor_type: Callable[[str], GGMLQuantizationType | None] | None
) -> tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType] | None:
    if tensor_type is None:
        return None
    gate, up, down = (tensor_type(f"{prefix}ffn_{p}_shexp.weight") for p in ("gate", "up", "down"))
    if gate is None or up is None or down is None:
        return None
    return gate, up, down


def _llama_rounded(x: np.ndarray, weight_type: GGMLQuantizationType | None) -> np.ndarray:
    """``x`` as llama.cpp's product with ``weight_type`` weights sees it (the default precision), for a
    product with those weights dequantized to float32; ``x`` itself under ``"float"``."""
    if weight_type is None or _fused.precision() != "int8":
        return x
    return quantized_round_trip(x, weight_type)


def _shared_forward(x: np.ndarray, resident: ResidentLayer, limit: float = 0.0) -> np.ndarray:
    """Shared expert: ``build_ffn(x, up_shexp, gate_shexp, down_shexp, LLM_FFN_SILU, LLM_FFN_PAR)``,
    times ``sigmoid(x . ffn_gate_inp_shexp)`` when the layer has that gate; each projection times its
    ``*_shexp.scale`` when the layer has one; ``ggml_swiglu_clamp`` when ``limit`` is set (DeepSeek-V4)."""
    gate_w, up_w, down_w = resident.shexp_gate, resident.shexp_up, resident.shexp_down
    assert gate_w is not None and up_w is not None and down_w is not None  # has_shared
    gate_t, up_t, down_t = resident.shexp_types or (None, None, None)
    xg = _llama_rounded(x, gate_t)
    g = _dense(gate_w, xg)
    u = _dense(up_w, xg if up_t == gate_t else _llama_rounded(x, up_t))
    if resident.shexp_up_scale is not None:
        u *= np.float32(resident.shexp_up_scale)
    if resident.shexp_gate_scale is not None:
        g *= np.float32(resident.shexp_gate_scale)
    tmp = np.empty_like(g)
    if limit:
        swiglu_clamp(g, u, tmp, g, limit)
    else:
        swiglu(g, u, tmp, g)
    out = _dense(down_w, _llama_rounded(g, down_t))
    if resident.shexp_down_scale is not None:
        out *= np.float32(resident.shexp_down_scale)
    if resident.shexp_gate_inp is not None:
        # llama.cpp (qwen2moe.cpp): silu(v) / v, i.e. sigmoid(v); computed directly (no 0/0 at v == 0)
        v = _dense(resident.shexp_gate_inp[None, :], x)[:, 0]
        np.negative(v, out=v)
        with np.errstate(over="ignore"):
            np.exp(v, out=v)
        v += np.float32(1.0)
        np.reciprocal(v, out=v)
        out *= v[:, None]
    return out


def _project(proj: ProjectionView, x: np.ndarray, out: np.ndarray | None, invariant: bool = False) -> np.ndarray:
    """``x @ W.T`` for a projection's raw ggml bytes (``ggml_mul_mat``), into ``out`` if given;
    ``invariant``: each row as it is alone (:func:`aioexperts._compute.fused.linear_rows`)."""
    # through the module attribute so the kernel dispatch (and test counters) is picked up at call time
    product = _fused.linear_rows if invariant else _fused.linear
    return product(proj.data, proj.ggml_type, proj.shape, x, out=out)


def _dense(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ weights.T`` for a resident float32 matrix (routers, shared experts), a fresh array."""
    return _fused.linear(weights, GGMLQuantizationType.F32, weights.shape, x)


def _lookup_views(experts: Mapping[int, ExpertView], uniq: np.ndarray, layer: int) -> list[ExpertView]:
    views: list[ExpertView] = []
    missing: list[int] = []
    for e in uniq.tolist():
        view = experts.get(e)
        if view is None:
            missing.append(e)
            continue
        if view.expert != e or view.layer != layer:
            raise InvalidRequestError(
                f"the view given for expert {e} of layer {layer} is expert {view.expert} of layer {view.layer}"
            )
        views.append(view)
    if missing:
        raise InvalidRequestError(
            f"layer {layer}: no expert view for selected expert(s) {missing}; views were given for {sorted(experts)}"
        )
    return views


def _check_view(view: ExpertView, expert: int, n_embd: int, n_ff_exp: int) -> tuple[int, int]:
    gate, up, down = view.gate, view.up, view.down
    width = gate.shape[0]
    if gate.shape != (width, n_embd) or up.shape != (width, n_embd):
        raise InvalidRequestError(
            f"expert {expert} (layer {view.layer}, bank {view.bank}): gate {gate.shape} and up {up.shape} "
            f"must both be (n_ff_exp, n_embd={n_embd})"
        )
    if n_ff_exp and width != n_ff_exp:
        raise InvalidRequestError(
            f"expert {expert} (layer {view.layer}, bank {view.bank}): gate/up have {width} rows, n_ff_exp is {n_ff_exp}"
        )
    if len(down.shape) != 2 or down.shape[0] != n_embd or down.shape[1] < width:
        raise InvalidRequestError(
            f"expert {expert} (layer {view.layer}, bank {view.bank}): down is {down.shape}, expected "
            f"(n_embd={n_embd}, n_ff_down >= {width})"
        )
    return width, down.shape[1]


def _check_routing(
    ids: np.ndarray, weights: np.ndarray, n_tokens: int, n_layer_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    if (
        not isinstance(ids, np.ndarray)
        or ids.ndim != 2
        or ids.shape[0] != n_tokens
        or ids.dtype.kind not in "iu"  # np.issubdtype(dtype, np.integer), one attribute
    ):
        raise InvalidRequestError(f"ids must be an integer array of shape ({n_tokens}, k), got {describe(ids)}")
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.shape != ids.shape:
        raise InvalidRequestError(
            f"weights must be a float32 array of shape {ids.shape} like ids, got {describe(weights)}"
        )
    if ids.shape[1] == 0:
        raise InvalidRequestError("ids has no slots (k == 0)")
    if ids.size:
        if ids.shape[0] == 1:  # a decode row: its k ids as Python ints (two numpy reductions cost more)
            row = ids[0].tolist()
            lo, hi = min(row), max(row)
        else:
            lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= n_layer_experts:
            raise InvalidRequestError(f"expert ids must be in -1..{n_layer_experts - 1} (-1: inactive), got {lo}..{hi}")
    return np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(weights)


@overload
def _f32_matrix(name: str, value: np.ndarray, shape: tuple[int, int] | None) -> np.ndarray: ...
@overload
def _f32_matrix(name: str, value: np.ndarray | None, shape: tuple[int, int] | None) -> np.ndarray | None: ...
def _f32_matrix(name: str, value: np.ndarray | None, shape: tuple[int, int] | None) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 2:
        raise ConfigError(f"{name} must be a 2-D float32 array, got {describe(value)}")
    if shape is not None and value.shape != shape:
        raise ConfigError(f"{name} has shape {value.shape}, expected {shape}")
    return np.ascontiguousarray(value)


def _f32_vector(name: str, value: np.ndarray | None, n: int) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.shape != (n,):
        raise ConfigError(f"{name} must be a float32 array of shape ({n},), got {describe(value)}")
    return np.ascontiguousarray(value)


def _shape(a: np.ndarray | None) -> tuple[int, ...] | None:
    return None if a is None else tuple(a.shape)


class _Workspace:
    """Grow-only float32 scratch buffers, one set per thread, reused across calls."""

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def buf(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        size = shape[0] * shape[1]
        flat = self._bufs.get(name)
        if flat is None or flat.size < size:
            flat = np.empty(max(size, 1), dtype=np.float32)
            self._bufs[name] = flat
        return flat[:size].reshape(shape)

    def take(self, x: np.ndarray, rows: np.ndarray, name: str) -> np.ndarray:
        n = x.shape[0]
        if rows.size == n and rows[0] == 0 and (n == 1 or bool(np.all(rows[1:] > rows[:-1]))):
            return x  # sorted, distinct, n of them, starting at 0: exactly 0..n-1, every token
        out = self.buf(name, (rows.size, x.shape[1]))
        np.take(x, rows, axis=0, out=out)
        return out


_local = threading.local()


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws
