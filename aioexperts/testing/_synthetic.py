"""Write valid MoE GGUF files of any geometry, for benchmarks and tests.

The files are written with the ``gguf`` package's ``GGUFWriter`` (split sets with its
``split_max_tensors``). Weights are random but numerically sane: for ``Q4_K`` and the types
``gguf.quants`` can quantize, every block is the quantization of zero-mean normal data, drawn
from a small pool (``aioexperts/testing/_blocks.py``) with its scales set so that each matrix's weights have a
standard deviation of about ``1 / sqrt(ne0)`` (a matrix product keeps the size of its input, as
in a trained model). Other quantized types get random quant bytes with finite scales rescaled the
same way; float tensors get small normal values. The default :class:`SyntheticSpec` is the
Qwen3-30B-A3B expert geometry.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from .._errors import ConfigError
from ._blocks import draw_blocks

__all__ = ("BENCH_SPEC", "SyntheticSpec", "tiny_moe_writer", "write_synthetic_model")

Q = GGMLQuantizationType
#: Byte offsets of the scale fields in one block: ``(offset, "f16" | "e8m0")`` (ggml-common.h).
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, str], ...]] = {
    Q.Q4_0: ((0, "f16"),),
    Q.Q4_1: ((0, "f16"), (2, "f16")),
    Q.Q5_0: ((0, "f16"),),
    Q.Q5_1: ((0, "f16"), (2, "f16")),
    Q.Q8_0: ((0, "f16"),),
    Q.Q2_K: ((80, "f16"), (82, "f16")),
    Q.Q3_K: ((108, "f16"),),
    Q.Q4_K: ((0, "f16"), (2, "f16")),
    Q.Q5_K: ((0, "f16"), (2, "f16")),
    Q.Q6_K: ((208, "f16"),),
    Q.IQ4_NL: ((0, "f16"),),
    Q.IQ4_XS: ((0, "f16"),),
    Q.MXFP4: ((0, "e8m0"),),
}
_FLOAT_DTYPES = {Q.F32: np.float32, Q.F16: np.float16}

#: ``(bytes written so far, total bytes)``.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SyntheticSpec:
    """Geometry and types of a synthetic MoE model.

    Attributes:
        arch: ``general.architecture``.
        n_layer: MoE layers (blocks ``leading_dense .. leading_dense + n_layer - 1``).
        n_embd, n_ff_exp: expert matrix sizes; gate/up are ``(n_ff_exp, n_embd)``.
        n_expert, n_expert_used: experts per layer and top-k.
        expert_type: ggml type of gate and up (and down unless ``down_type``).
        down_type: ggml type of down, if different.
        tiers: mixed-tier banks after the base bank, as ``(n_experts, type)``; the base bank
            gets what is left of ``n_expert``.
        merged_gate_up: store gate and up as one ``ffn_gate_up_exps`` tensor.
        leading_dense: dense blocks before the first MoE block (no tensors are written for them).
        alignment: ``general.alignment`` in bytes (32 is the GGUF default and is not written).
        seed: random seed of the weights.
    """

    arch: str = "qwen3moe"
    n_layer: int = 8
    n_embd: int = 2048
    n_ff_exp: int = 768
    n_expert: int = 128
    n_expert_used: int = 8
    expert_type: GGMLQuantizationType = Q.Q4_K
    down_type: GGMLQuantizationType | None = None
    tiers: tuple[tuple[int, GGMLQuantizationType], ...] = field(default=())
    merged_gate_up: bool = False
    leading_dense: int = 0
    alignment: int = 32
    seed: int = 0

    def with_(self, **changes: object) -> SyntheticSpec:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def expert_bytes(self) -> int:
        """Bytes of one base-bank expert (gate + up + down)."""
        return 2 * _tensor_bytes(self.expert_type, self.n_embd, self.n_ff_exp) + _tensor_bytes(
            self.down_type or self.expert_type, self.n_ff_exp, self.n_embd
        )


#: The bench model: Qwen3-30B-A3B expert geometry, Q4_K, 8 MoE layers (about 2.7 GB).
BENCH_SPEC = SyntheticSpec()


def _tensor_bytes(ggml_type: GGMLQuantizationType, ne0: int, ne1: int, ne2: int = 1) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if ne0 % block_size:
        raise ConfigError(f"{ggml_type.name} needs rows that are a multiple of {block_size}, got {ne0}")
    return ne0 // block_size * type_size * ne1 * ne2


def _random_weights(
    rng: np.random.Generator, ggml_type: GGMLQuantizationType, ne0: int, ne1: int, ne2: int
) -> np.ndarray:
    """Random tensor data as GGUFWriter wants it: float arrays, or uint8 ``(ne2, ne1, row_bytes)``."""
    if ggml_type in _FLOAT_DTYPES:
        return (rng.standard_normal((ne2, ne1, ne0), dtype=np.float32) * 0.02).astype(_FLOAT_DTYPES[ggml_type])
    n_bytes = _tensor_bytes(ggml_type, ne0, ne1, ne2)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    drawn = draw_blocks(rng, ggml_type, n_bytes // type_size, ne0**-0.5)
    if drawn is not None:
        return drawn.reshape(ne2, ne1, ne0 // block_size * type_size)
    raw = np.frombuffer(bytearray(rng.bytes(n_bytes)), dtype=np.uint8)
    if ggml_type == Q.BF16:
        values = (rng.standard_normal(n_bytes // 2, dtype=np.float32) * 0.02).view(np.uint32)
        raw = (values >> 16).astype(np.uint16).view(np.uint8).copy()
    blocks = raw.reshape(-1, type_size)
    fields = _SCALE_FIELDS.get(ggml_type, ())
    for offset, kind in fields:
        if kind == "f16":
            scale = (rng.random(len(blocks), dtype=np.float32) + 0.5).astype(np.float16)
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        else:
            blocks[:, offset] = rng.integers(118, 124, len(blocks), dtype=np.uint8)
    if fields and fields[0][1] == "f16":
        _rescale(blocks, ggml_type, fields, target_std=ne0**-0.5)
    return raw.reshape(ne2, ne1, ne0 // block_size * type_size)


def _rescale(
    blocks: np.ndarray,
    ggml_type: GGMLQuantizationType,
    fields: tuple[tuple[int, str], ...],
    target_std: float,
) -> None:
    """Scale the f16 scale fields so the weights' standard deviation is about ``target_std``.

    Every value of these types is linear in its f16 scales (``d * sc * q - dmin * m``), so
    multiplying them all by one factor scales the weights by it: like a trained layer, the output
    of a matrix product keeps the size of its input.
    """
    from .._format.dequant import dequantize

    sample = np.ascontiguousarray(blocks[: min(len(blocks), 4096)])
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    std = float(dequantize(sample.reshape(-1), ggml_type, (len(sample), block_size)).std())
    if not np.isfinite(std) or std == 0:
        return
    for offset, _kind in fields:
        scale = blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32)
        blocks[:, offset : offset + 2] = (scale * (target_std / std)).astype(np.float16).view(np.uint8).reshape(-1, 2)


def _layer_tensors(
    spec: SyntheticSpec, rng: np.random.Generator, block: int
) -> list[tuple[str, Callable[[], np.ndarray], GGMLQuantizationType, int]]:
    """``(name, make_data, type, n_bytes)`` for one MoE block, in file order."""
    out: list[tuple[str, Callable[[], np.ndarray], GGMLQuantizationType, int]] = []
    n_tier = sum(n for n, _ in spec.tiers)
    n_base = spec.n_expert - n_tier
    if n_base < 1:
        raise ConfigError(f"tiers hold {n_tier} of {spec.n_expert} experts; the base bank needs at least one")
    e, f = spec.n_embd, spec.n_ff_exp
    out.append(
        (
            f"blk.{block}.ffn_gate_inp.weight",
            lambda: rng.standard_normal((spec.n_expert, e), dtype=np.float32),
            Q.F32,
            4 * e * spec.n_expert,
        )
    )
    banks = [
        (n_base, spec.expert_type, spec.down_type or spec.expert_type),
        *((n, t, t) for n, t in spec.tiers),
    ]
    for tier, (n, up_type, down_type) in enumerate(banks):
        suffix = f"_tier{tier}" if tier else ""
        if spec.merged_gate_up:
            projections = [("gate_up", up_type, e, 2 * f)]
        else:
            projections = [("gate", up_type, e, f), ("up", up_type, e, f)]
        projections.append(("down", down_type, f, e))
        for proj, t, ne0, ne1 in projections:
            out.append(
                (
                    f"blk.{block}.ffn_{proj}_exps{suffix}.weight",
                    functools.partial(_random_weights, rng, t, ne0, ne1, n),
                    t,
                    _tensor_bytes(t, ne0, ne1, n),
                )
            )
    return out


def write_synthetic_model(
    path: str | os.PathLike[str],
    spec: SyntheticSpec = BENCH_SPEC,
    *,
    shards: int = 1,
    progress: Progress | None = None,
) -> list[Path]:
    """Write a valid MoE GGUF (or a split set of ``shards`` files) for ``spec``.

    With ``shards > 1``, ``path`` names the set (``model.gguf`` gives ``model-00001-of-0000n.gguf``
    and so on), split by tensor count with ``GGUFWriter(split_max_tensors=...)``.

    Returns:
        The paths written, in shard order.

    Raises:
        ConfigError: an inconsistent spec (rows not a multiple of the block size, tiers too big).
    """
    rng = np.random.default_rng(spec.seed)
    tensors = [t for layer in range(spec.n_layer) for t in _layer_tensors(spec, rng, spec.leading_dense + layer)]
    if shards < 1 or shards > len(tensors):
        raise ConfigError(f"shards must be in 1..{len(tensors)}, got {shards}")
    if shards > 1 and spec.alignment != 32:
        # GGUFWriter writes general.alignment into the first shard only, while it pads every
        # shard's data to it: the other shards would be read with the default 32.
        raise ConfigError("a split set can only be written with the default alignment of 32")
    split = -(-len(tensors) // shards) if shards > 1 else 0
    writer = GGUFWriter(os.fspath(path), spec.arch, split_max_tensors=split)
    writer.add_name("aioexperts synthetic MoE")
    if spec.alignment != 32:
        writer.add_custom_alignment(spec.alignment)
    n_blocks = spec.leading_dense + spec.n_layer
    writer.add_block_count(n_blocks)
    writer.add_context_length(4096)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
    writer.add_head_count(32)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.leading_dense:
        writer.add_leading_dense_block_count(spec.leading_dense)
    total = sum(n for *_, n in tensors)
    written = 0
    for name, _make, ggml_type, n_bytes in tensors:
        writer.add_tensor_info(name, _numpy_shape(spec, name), np.dtype(np.float32), n_bytes, raw_dtype=ggml_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, make, _type, n_bytes in tensors:
            data = make()
            assert data.nbytes == n_bytes, (name, data.nbytes, n_bytes)
            writer.write_tensor_data(data)
            written += n_bytes
            if progress is not None:
                progress(written, total)
    finally:
        writer.close()
    return [Path(p) for p in writer.format_shard_names(Path(path))] if shards > 1 else [Path(path)]


def _numpy_shape(spec: SyntheticSpec, name: str) -> tuple[int, ...]:
    """Element shape in numpy order that GGUFWriter records as the tensor's dims."""
    e, f = spec.n_embd, spec.n_ff_exp
    if name.endswith("ffn_gate_inp.weight"):
        return (spec.n_expert, e)
    n = _bank_size(spec, name)
    if "gate_up" in name:
        return (n, 2 * f, e)
    if "_down_" in name:
        return (n, e, f)
    return (n, f, e)


def _bank_size(spec: SyntheticSpec, name: str) -> int:
    for tier, (n, _) in enumerate(spec.tiers, start=1):
        if name.endswith(f"_tier{tier}.weight"):
            return n
    return spec.n_expert - sum(n for n, _ in spec.tiers)


def tiny_moe_writer(path: str | os.PathLike[str], rng: np.random.Generator) -> GGUFWriter:
    """A ``GGUFWriter`` for ``path`` holding a one-layer qwen3moe MoE already (2 experts, ``n_embd`` 256,
    F32), for files that exist to carry other tensors (row tables); the caller adds those and writes."""
    w = GGUFWriter(os.fspath(path), "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_expert_count(2)
    w.add_expert_used_count(1)
    w.add_expert_feed_forward_length(256)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((2, 256), dtype=np.float32))
    for proj in ("gate", "up", "down"):
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", rng.standard_normal((2, 256, 256), dtype=np.float32))
    return w
