"""Load the resident (always-in-memory) weights of every MoE layer: routers, biases, shared experts."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from .._format.dequant import dequantize
from .._format.hparams import MoEHParams
from .._format.layout import ExpertLayout
from .._format.model import GGUFModel
from .fused import WarmupReport, warmup
from .moe import ResidentLayer

__all__ = ("kernel_types", "load_residents", "warmup_kernels")


def load_residents(model: GGUFModel, layout: ExpertLayout, hparams: MoEHParams) -> dict[int, ResidentLayer]:
    """Read and dequantize (once) the resident tensors of every MoE layer of ``layout``.

    Blocking (plain ``pread`` of small tensors): call from a worker thread under an event loop.

    Returns:
        block index -> :class:`ResidentLayer` (float32 arrays).

    Raises:
        FormatError: a tensor is truncated.
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
        return dequantize(raw, info.ggml_type, info.shape)

    return {layer: ResidentLayer.from_tensors(layer, tensor, hparams) for layer in layout.layers}


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


def warmup_kernels(layout: ExpertLayout) -> WarmupReport:
    """Compile or load the kernels of :func:`kernel_types` (blocking; see :func:`fused.warmup`)."""
    return warmup(kernel_types(layout))
