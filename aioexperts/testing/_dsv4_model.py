"""A built-in DeepSeek-V4-geometry model: every tensor of a ``deepseek4`` GGUF, random weights.

For measuring the whole-model path on the architecture this project streams (compressed attention,
hyper-connections, hash-routed layers) without a download: :data:`DSV4_SPEC` has DeepSeek-V4-Flash's
shapes (hidden 4096, 64 heads of 512 with one K = V head and RoPE on 64 dims, q LoRA 1024, output
LoRA 8 groups of 1024, 256 routed experts of width 2048 (top-6) plus one shared expert, the indexer's
64 heads of 128 and top 512, window 128, 4 hyper-connection streams with 20 Sinkhorn iterations,
compress ratios ``0, 0, 4, 128, 4, 128, ...``, the first 3 layers hash-routed) with fewer layers so
that it fits a disk. Its text is random.

- matrices are ``dense_type`` (Q8_0), the routed experts ``expert_type`` (Q2_K: about 8.3 MB per
  expert), norms, sinks, routers, biases, the hyper-connection scales and bases and the compressors'
  position tables F32, the hash tables I32;
- every matrix has standard deviation ``1 / sqrt(ne0)`` (the projections that add to the residual
  streams a further ``1 / sqrt(2 n_layer)``); norms about 1; the vocabulary and the ChatML template
  are the built-in full model's (:mod:`aioexperts.testing._full_model`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from .._errors import ConfigError
from ._blocks import draw_blocks
from ._full_model import Progress, add_vocabulary, train_vocabulary, write_tensors

__all__ = ("DSV4_SPEC", "TINY_DSV4_SPEC", "DSV4Spec", "write_dsv4_model")

Q = GGMLQuantizationType
ARCH = "deepseek4"


@dataclass(frozen=True, slots=True)
class DSV4Spec:
    """Geometry and types of a DeepSeek-V4-shaped model (default: DeepSeek-V4-Flash, 4 layers).

    Attributes:
        n_layer: blocks; ``compress_ratios`` gives each one's attention (0, 4 or 128).
        n_embd, n_head, head_dim, n_rot: hidden size, attention heads, head size, rotated dims.
        q_lora_rank, o_groups, o_lora_rank: the q LoRA rank, output LoRA groups and rank.
        n_expert, n_expert_used, n_ff_exp, n_hash_layers: experts, top-k, expert width, hash-routed layers.
        idx_heads, idx_dim, idx_top_k: the lightning indexer's heads, head size and top-k.
        window: sliding window; n_hc, sinkhorn_iters: hyper-connection streams and iterations.
        vocab_size: ids of the trained vocabulary; context_length: the file's context length.
        dense_type, expert_type: ggml types of the matrices and of the routed experts.
        seed: seed of the weights.
    """

    n_layer: int = 4
    n_embd: int = 4096
    n_head: int = 64
    head_dim: int = 512
    n_rot: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_expert: int = 256
    n_expert_used: int = 6
    n_ff_exp: int = 2048
    n_hash_layers: int = 3
    idx_heads: int = 64
    idx_dim: int = 128
    idx_top_k: int = 512
    window: int = 128
    n_hc: int = 4
    sinkhorn_iters: int = 20
    vocab_size: int = 4096
    context_length: int = 65536
    dense_type: GGMLQuantizationType = Q.Q8_0
    expert_type: GGMLQuantizationType = Q.Q2_K
    seed: int = 0

    def with_(self, **changes: object) -> DSV4Spec:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def compress_ratios(self) -> list[int]:
        """DeepSeek-V4-Flash's pattern: two window-only layers, then CSA (4) and HCA (128) alternating."""
        return [0 if il < 2 else (4 if il % 2 == 0 else 128) for il in range(self.n_layer)]

    def check(self) -> None:
        """Raises ConfigError for an inconsistent spec (the message names the field)."""
        for name in ("n_layer", "n_embd", "n_head", "head_dim", "n_rot", "q_lora_rank", "o_groups", "o_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DSV4Spec.{name} must be a positive int, got {value!r}")
        if self.n_head % self.o_groups or self.n_rot % 2 or self.n_rot > min(self.head_dim, self.idx_dim):
            raise ConfigError("DSV4Spec: o_groups must divide n_head, n_rot be even and at most the head sizes")
        if not 0 < self.n_expert_used <= self.n_expert or self.n_hash_layers > self.n_layer:
            raise ConfigError("DSV4Spec: n_expert_used must be in 1..n_expert, n_hash_layers at most n_layer")
        for name, ggml_type, ne0 in (
            ("dense_type", self.dense_type, self.n_embd),
            ("dense_type", self.dense_type, self.q_lora_rank),
            ("dense_type", self.dense_type, self.n_head * self.head_dim // self.o_groups),
            ("expert_type", self.expert_type, self.n_embd),
            ("expert_type", self.expert_type, self.n_ff_exp),
        ):
            if ne0 % GGML_QUANT_SIZES[ggml_type][0]:
                raise ConfigError(f"DSV4Spec.{name}={ggml_type.name} needs rows of a multiple of its block, got {ne0}")
            if draw_blocks(np.random.default_rng(0), ggml_type, 1, 1.0) is None:
                raise ConfigError(f"DSV4Spec.{name}={ggml_type.name}: no block pool for this type")

    def file_name(self) -> str:
        """A cache file name that changes with the geometry."""
        t = f"{self.dense_type.name.lower()}-{self.expert_type.name.lower()}"
        if self == DSV4_SPEC.with_(n_layer=self.n_layer):
            dims = ""
        else:
            values = {f.name: getattr(self, f.name) for f in fields(self)}
            values = {k: (v.name if isinstance(v, GGMLQuantizationType) else v) for k, v in values.items()}
            dims = (
                "-custom"
                + hashlib.sha256(json.dumps(values, sort_keys=True, allow_nan=False).encode()).hexdigest()[:10]
            )
        return f"deepseek-v4-flash-geometry-{t}-{self.n_layer}l{dims}-v1.gguf"


#: DeepSeek-V4-Flash's geometry, 4 layers (window, window, CSA, HCA): about 9.1 GB with Q2_K experts.
DSV4_SPEC = DSV4Spec()

#: DeepSeek-V4-Flash's layout at a test size (about 3 MB, written in about a second): the window,
#: CSA and HCA layers, hash-routed and router-routed layers, small dimensions and vocabulary.
TINY_DSV4_SPEC = DSV4Spec(
    n_layer=4, n_embd=256, n_head=4, head_dim=128, n_rot=32, q_lora_rank=256, o_groups=2, o_lora_rank=128,
    n_expert=8, n_expert_used=3, n_ff_exp=256, n_hash_layers=3, idx_heads=8, idx_dim=64, idx_top_k=4,
    window=16, sinkhorn_iters=5, vocab_size=512, context_length=4096,
)  # fmt: skip

_Tensor = tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]


def _tensors(spec: DSV4Spec, n_vocab: int, rng: np.random.Generator) -> list[_Tensor]:
    """``(name, numpy shape, type, make_data)`` in file order (deepseek4.cpp ``load_arch_tensors``)."""
    e, hd, f, hc = spec.n_embd, spec.head_dim, spec.n_ff_exp, spec.n_hc
    residual = (2 * spec.n_layer) ** -0.5
    dense, experts = spec.dense_type, spec.expert_type
    n_mix, group_dim = (2 + hc) * hc, spec.n_head * hd // spec.o_groups

    def f32(shape: tuple[int, ...], mean: float, std: float) -> Callable[[], np.ndarray]:
        return lambda: (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def matrix(t: GGMLQuantizationType, shape: tuple[int, ...], std: float) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            block_size, type_size = GGML_QUANT_SIZES[t]
            drawn = draw_blocks(rng, t, int(np.prod(shape)) // block_size, std)
            assert drawn is not None  # checked by DSV4Spec.check
            return drawn.reshape(*shape[:-1], shape[-1] // block_size * type_size)

        return make

    def mat(name: str, rows: int, cols: int, scale: float = 1.0) -> _Tensor:
        return (name, (rows, cols), dense, matrix(dense, (rows, cols), scale * cols**-0.5))

    def vec(name: str, n: int, mean: float = 1.0, std: float = 0.02) -> _Tensor:
        return (name, (n,), Q.F32, f32((n,), mean, std))

    def hash_table() -> np.ndarray:  # distinct experts per token id
        rows = [rng.choice(spec.n_expert, spec.n_expert_used, replace=False) for _ in range(n_vocab)]
        return np.stack(rows).astype(np.int32)

    out: list[_Tensor] = [mat("token_embd.weight", n_vocab, e, e**0.5)]
    for il, ratio in enumerate(spec.compress_ratios):
        b = f"blk.{il}."
        out += [
            vec(b + "attn_norm.weight", e),
            vec(b + "attn_sinks.weight", spec.n_head, 0.0, 1.0),
            mat(b + "attn_q_a.weight", spec.q_lora_rank, e),
            vec(b + "attn_q_a_norm.weight", spec.q_lora_rank),
            mat(b + "attn_q_b.weight", spec.n_head * hd, spec.q_lora_rank),
            mat(b + "attn_kv.weight", hd, e),
            vec(b + "attn_kv_a_norm.weight", hd),
            mat(b + "attn_output_a.weight", spec.o_groups * spec.o_lora_rank, group_dim),
            mat(b + "attn_output_b.weight", e, spec.o_groups * spec.o_lora_rank, residual),
        ]
        for kind in ("attn", "ffn"):
            out += [
                mat(b + f"hc_{kind}_fn.weight", n_mix, hc * e),
                vec(b + f"hc_{kind}_base.weight", n_mix, 0.0, 0.1),
                vec(b + f"hc_{kind}_scale.weight", 3, 1.0, 0.0),
            ]
        if ratio:
            width = (2 if ratio == 4 else 1) * hd
            out += [
                mat(b + "attn_compressor_kv.weight", width, e),
                mat(b + "attn_compressor_gate.weight", width, e),
                (b + "attn_compressor_ape.weight", (ratio, width), Q.F32, f32((ratio, width), 0.0, 0.1)),
                vec(b + "attn_compressor_norm.weight", hd),
            ]
        if ratio == 4:
            di = spec.idx_dim
            out += [
                mat(b + "indexer.proj.weight", spec.idx_heads, e),
                mat(b + "indexer.attn_q_b.weight", spec.idx_heads * di, spec.q_lora_rank),
                mat(b + "indexer_compressor_kv.weight", 2 * di, e),
                mat(b + "indexer_compressor_gate.weight", 2 * di, e),
                (b + "indexer_compressor_ape.weight", (4, 2 * di), Q.F32, f32((4, 2 * di), 0.0, 0.1)),
                vec(b + "indexer_compressor_norm.weight", di),
            ]
        out.append((b + "ffn_gate_inp.weight", (spec.n_expert, e), Q.F32, f32((spec.n_expert, e), 0.0, e**-0.5)))
        if il < spec.n_hash_layers:
            out.append((b + "ffn_gate_tid2eid.weight", (n_vocab, spec.n_expert_used), Q.I32, hash_table))
        else:
            out.append(vec(b + "exp_probs_b.bias", spec.n_expert, 0.0, 0.1))
        out += [
            vec(b + "ffn_norm.weight", e),
            (
                b + "ffn_gate_exps.weight",
                (spec.n_expert, f, e),
                experts,
                matrix(experts, (spec.n_expert, f, e), e**-0.5),
            ),
            (b + "ffn_up_exps.weight", (spec.n_expert, f, e), experts, matrix(experts, (spec.n_expert, f, e), e**-0.5)),
            (
                b + "ffn_down_exps.weight",
                (spec.n_expert, e, f),
                experts,
                matrix(experts, (spec.n_expert, e, f), f**-0.5 * residual),
            ),
            mat(b + "ffn_gate_shexp.weight", f, e),
            mat(b + "ffn_up_shexp.weight", f, e),
            mat(b + "ffn_down_shexp.weight", e, f, residual),
        ]
    out += [
        mat("output_hc_fn.weight", hc, hc * e),
        vec("output_hc_base.weight", hc, 0.0, 0.1),
        vec("output_hc_scale.weight", 1, 1.0, 0.0),
        vec("output_norm.weight", e),
        mat("output.weight", n_vocab, e, 3.0),
    ]
    return out


def _tensor_bytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    if ggml_type in (Q.F32, Q.I32):
        return 4 * int(np.prod(shape))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(shape)) // block_size * type_size


def _keys(writer: GGUFWriter, spec: DSV4Spec) -> None:
    u32, f32, arr = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.ARRAY
    n = spec.n_layer
    keys: dict[str, tuple[object, GGUFValueType]] = {
        "context_length": (spec.context_length, u32),
        "embedding_length": (spec.n_embd, u32),
        "block_count": (n, u32),
        "attention.head_count": (spec.n_head, u32),
        "attention.head_count_kv": (1, u32),
        "attention.key_length": (spec.head_dim, u32),
        "attention.value_length": (spec.head_dim, u32),
        "rope.dimension_count": (spec.n_rot, u32),
        "rope.freq_base": (10000.0, f32),
        "rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (16.0, f32),
        "rope.scaling.original_context_length": (spec.context_length, u32),
        "attention.layer_norm_rms_epsilon": (1e-6, f32),
        "attention.q_lora_rank": (spec.q_lora_rank, u32),
        "attention.sliding_window": (spec.window, u32),
        "expert_count": (spec.n_expert, u32),
        "expert_used_count": (spec.n_expert_used, u32),
        "expert_feed_forward_length": ([spec.n_ff_exp] * n, arr),
        "expert_shared_count": (1, u32),
        "expert_weights_scale": (1.5, f32),
        "expert_weights_norm": (True, GGUFValueType.BOOL),
        "expert_gating_func": (4, u32),
        "swiglu_clamp_exp": ([10.0] * n, arr),
        "swiglu_clamp_shexp": ([10.0] * n, arr),
        "attention.indexer.head_count": (spec.idx_heads, u32),
        "attention.indexer.key_length": (spec.idx_dim, u32),
        "attention.indexer.top_k": (spec.idx_top_k, u32),
        "attention.output_group_count": (spec.o_groups, u32),
        "attention.output_lora_rank": (spec.o_lora_rank, u32),
        "attention.compress_ratios": (spec.compress_ratios, arr),
        "attention.compress_rope_freq_base": (160000.0, f32),
        "hyper_connection.count": (spec.n_hc, u32),
        "hyper_connection.sinkhorn_iterations": (spec.sinkhorn_iters, u32),
        "hyper_connection.epsilon": (1e-6, f32),
        "hash_layer_count": (spec.n_hash_layers, u32),
    }
    for key, (value, vtype) in keys.items():
        writer.add_key_value(f"{ARCH}.{key}", value, vtype)


def write_dsv4_model(
    path: str | os.PathLike[str], spec: DSV4Spec = DSV4_SPEC, *, progress: Progress | None = None
) -> Path:
    """Write the DeepSeek-V4-shaped model of ``spec`` (see the module docstring) to ``path``.

    Args:
        path: the GGUF file to write.
        spec: the geometry (tests pass a small one).
        progress: ``(bytes written, total bytes)`` after each tensor.

    Returns:
        ``path``.

    Raises:
        ConfigError: an inconsistent spec, or ``tokenizers`` is missing.
        OSError: the file cannot be written.
    """
    spec.check()
    tokens, merges = train_vocabulary(spec.vocab_size)
    rng = np.random.default_rng(spec.seed)
    tensors = _tensors(spec, len(tokens), rng)
    writer = GGUFWriter(os.fspath(path), ARCH)
    writer.add_name("aioexperts built-in DeepSeek-V4-geometry model (random weights)")
    _keys(writer, spec)
    add_vocabulary(writer, tokens, merges, pad=False)
    write_tensors(writer, tensors, [_tensor_bytes(t, shape) for _, shape, t, _ in tensors], progress)
    return Path(path)
