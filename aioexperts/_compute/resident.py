"""Load the resident (always-in-memory) weights of every MoE layer: routers, biases, shared experts."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from gguf import GGMLQuantizationType

from .._errors import FormatError, UnsupportedTypeError
from .._format.dequant import dequantize
from .._format.hparams import MoEHParams
from .._format.layout import ExpertLayout
from .._format.model import GGUFModel
from .fused import WarmupReport, warmup
from .grouped import product_task
from .moe import ResidentLayer

__all__ = ("kernel_types", "load_residents", "warmup_kernels")

#: resident MoE tensors refused at load when not finite: the router, its bias, the selection bias,
#: the per-expert scales (small; the shared expert's matrices are not scanned)
_CHECKED_FINITE = ("ffn_gate_inp.weight", "ffn_gate_inp.bias", "exp_probs_b.bias", "_exps.scale")


def load_residents(model: GGUFModel, layout: ExpertLayout, hparams: MoEHParams) -> dict[int, ResidentLayer]:
    """Read and dequantize (once) the resident tensors of every MoE layer of ``layout``.

    Blocking (plain ``pread`` of small tensors): call from a worker thread under an event loop.

    Returns:
        block index -> :class:`ResidentLayer` (float32 arrays).

    Raises:
        FormatError: a tensor is truncated; the router, its bias, the selection bias or an
            expert scale holds NaN or inf; a token-to-expert table (``ffn_gate_tid2eid``) has
            not one row per token of the vocabulary.
        ConfigError: a tensor has the wrong shape for the layer.
        UnsupportedTypeError: a tensor changes the MoE block in a way the executor does not compute
            (:meth:`MoEHParams.check_tensors`).
    """

    hparams.check_tensors(model.tensors)  # per-expert scales, grok's dense FFN: refused, not ignored

    def tensor(name: str) -> np.ndarray | None:
        info = model.tensors.get(name)
        if info is None:
            return None
        raw = np.frombuffer(model.read_tensor_bytes(name), dtype=np.uint8)
        values = dequantize(raw, info.ggml_type, info.shape)
        if name.endswith(_CHECKED_FINITE) and not np.isfinite(values).all():
            # a NaN in the router or its biases makes the choice of experts arbitrary
            raise FormatError(f"{model.path}: tensor {name!r} holds NaN or inf")
        return values

    def tensor_type(name: str) -> GGMLQuantizationType | None:
        info = model.tensors.get(name)
        return None if info is None else info.ggml_type

    def token_table(layer: int) -> np.ndarray | None:
        """``blk.L.ffn_gate_tid2eid.weight``: I32 ``{k, n_vocab}`` in ggml order, ``(n_vocab, k)`` here."""
        name = f"blk.{layer}.ffn_gate_tid2eid.weight"
        info = model.tensors.get(name)
        if info is None or not hparams.is_hash_layer(layer):
            return None
        if info.ggml_type != GGMLQuantizationType.I32 or len(info.shape) != 2:
            raise FormatError(f"tensor {name!r} must be a 2-D I32 table, got {info.ggml_type.name} {info.shape}")
        embd = model.tensors.get("token_embd.weight")
        if embd is not None and info.shape[0] != embd.shape[0]:  # ggml_get_rows by any token id of the vocabulary
            raise FormatError(
                f"tensor {name!r} has {info.shape[0]} rows, the vocabulary (token_embd.weight) {embd.shape[0]}"
            )
        raw = model.read_tensor_bytes(name)
        return np.frombuffer(raw, dtype="<i4").reshape(info.shape)

    for layer in layout.layers:
        merged = f"blk.{layer}.ffn_gate_up_exps.weight" in model.tensors
        for proj in ("gate", "up"):
            name = f"blk.{layer}.ffn_{proj}_exps.scale"
            if merged and name in model.tensors:  # llama.cpp creates no up/gate scale for a merged bank
                raise UnsupportedTypeError(
                    f"tensor {name!r} scales a merged ffn_gate_up_exps bank, which llama.cpp does not load"
                )

    return {
        layer: ResidentLayer.from_tensors(
            layer, tensor, hparams, token_experts=token_table(layer), tensor_type=tensor_type
        )
        for layer in layout.layers
    }


def kernel_types(layout: ExpertLayout) -> frozenset[GGMLQuantizationType]:
    """The ggml types the executor multiplies by for this layout.

    The routed experts' types (every bank, gate, up and down) and F32: the resident weights
    (routers, shared experts) are dequantized to float32 when they are loaded.
    """
    types = {GGMLQuantizationType.F32}
    for moe in layout.layers.values():
        for bank in moe.banks:
            types.update((bank.gate.ggml_type, bank.up.ggml_type, bank.down.ggml_type))
    return frozenset(types)


def warmup_kernels(layout: ExpertLayout, also: Iterable[GGMLQuantizationType] = ()) -> WarmupReport:
    """Compile or load the kernels of :func:`kernel_types` and of the types ``also`` (the miss
    tier's: its first low-tier expert would otherwise load them mid-token), blocking (see
    :func:`fused.warmup`), and the group calls of a decode step's experts
    (:func:`aioexperts._compute.grouped.product_task`)."""
    types = kernel_types(layout) | frozenset(also)
    report = warmup(types)
    for t in types:
        product_task(t)
    return report
