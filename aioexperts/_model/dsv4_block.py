"""The deepseek4 attention block: window + compressed-row attention with the lightning indexer.

Registered as block ``"dsv4"`` (:func:`~aioexperts._model.blocks.register_block`). llama.cpp
src/models/deepseek4.cpp ``build_attention_impl``: q LoRA (``attn_q_a`` + norm, ``attn_q_b``, a
weightless RMSNorm per head), one K = V head (``attn_kv`` + ``attn_kv_a_norm``), RoPE (NORM pairs) on
the last ``rope.dimension_count`` dims of each head, raw keys in a sliding window, the layer's
compressed rows (``attention.compress_ratios``: 0 none, 128 every finished row, 4 the indexer's
``top_k`` best), sinks, the heads rotated back, the grouped output LoRA (``attn_output_a`` per
group, ``attn_output_b``). The maths is :mod:`aioexperts._compute.compressed_attention`.

What a sequence keeps per position (its KV cache, ``(n_ctx, *shape)`` each): the rotated key
``kv``; in a compressed layer each position's compressor values and scores (``comp_kv``,
``comp_score``) and, at index ``b``, the finished row ``b`` (``rows``); in a CSA layer the same for
the indexer (``idx_kv``, ``idx_score``, ``idx_rows``); a rows array of ``ceil(d / ratio)`` floats per
position is read as ``n_ctx // ratio`` rows of ``d``. A row is made once its last position has run
(the compressor's state across calls is the positions' inputs in the cache), so a sequence cut back
by ``keep(n)`` makes its unfinished rows again from the same inputs, as a fresh prefill does.
The arrays are float32; the keys and rows hold F16 values under llama.cpp's default F16 K cache
(:attr:`DSV4Block.f16_cache`), the compressor's inputs full float32 values (llama.cpp's state is F32).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aioexperts._compute import compressed_attention as ca
from aioexperts._compute.norms import rms_norm
from aioexperts._compute.rope import apply_rope, rope_cos_sin, rope_table
from aioexperts._errors import FormatError
from aioexperts._format.architectures import ModelHParams, RopeParams, RopeType
from aioexperts._model.blocks import register_block
from aioexperts._model.weights import DenseMatrix, TensorReader

__all__ = ("DSV4Block", "dsv4_cache_shapes", "dsv4_key")

CSA_RATIO = 4
HCA_RATIO = 128
INDEX_SCORE_FLOATS = 1 << 22
"""The indexer scores a long prefill in chunks of queries whose ``(queries, heads, rows)`` products
stay within this many floats."""


def dsv4_key(hp: ModelHParams, name: str) -> Any:
    """The ``deepseek4.<name>`` key, or FormatError naming it."""
    value = hp.metadata.get(name)
    if value is None:
        raise FormatError(f"missing required key {hp.arch}.{name} (deepseek4.cpp load_arch_hparams reads it)")
    return value


def _positive_int(hp: ModelHParams, name: str) -> int:
    value = dsv4_key(hp, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"{hp.arch}.{name} must be an int > 0, got {value!r}")
    return value


def _ratio_of(hp: ModelHParams, layer: int) -> int:
    ratios = dsv4_key(hp, "attention.compress_ratios")
    if not isinstance(ratios, Sequence) or len(ratios) < hp.n_layer:
        raise FormatError(f"{hp.arch}.attention.compress_ratios is shorter than block_count ({hp.n_layer})")
    ratio = ratios[layer]
    if ratio not in (0, CSA_RATIO, HCA_RATIO):
        raise FormatError(f"{hp.arch}: compress ratio {ratio} of block {layer} is not 0, 4 or 128")
    return int(ratio)


def dsv4_cache_shapes(hp: ModelHParams, layer: int) -> dict[str, tuple[int, ...]]:
    """What block ``layer`` keeps per position (module docstring), from the file's keys.

    Raises:
        FormatError: a missing or malformed ``attention.compress_ratios`` or ``attention.indexer.key_length``.
    """
    ratio, d = _ratio_of(hp, layer), hp.head_k
    shapes: dict[str, tuple[int, ...]] = {"kv": (d,)}
    if ratio:
        w = (2 if ratio == CSA_RATIO else 1) * d
        shapes |= {"comp_kv": (w,), "comp_score": (w,), "rows": (-(-d // ratio),)}
    if ratio == CSA_RATIO:
        di = _positive_int(hp, "attention.indexer.key_length")
        shapes |= {"idx_kv": (2 * di,), "idx_score": (2 * di,), "idx_rows": (-(-di // ratio),)}
    return shapes


def _rope_of(hp: ModelHParams, compressed: bool) -> RopeParams:
    """deepseek4.cpp: a window-only layer rotates with ``rope.freq_base`` unscaled; a compressed one with
    ``compress_rope_freq_base`` and the file's YaRN scaling, its magnitude factor cancelled."""
    base = hp.rope
    if not compressed:
        return RopeParams(RopeType.NORM, base.n_rot, base.freq_base)
    freq_base = float(dsv4_key(hp, "attention.compress_rope_freq_base"))
    if not freq_base > 0:
        raise FormatError(f"{hp.arch}.attention.compress_rope_freq_base must be > 0, got {freq_base}")
    attn_factor = 1.0
    if base.ext_factor != 0.0:
        attn_factor = 1.0 / (1.0 + 0.1 * math.log(1.0 / base.freq_scale))
    return dataclasses.replace(base, rope_type=RopeType.NORM, freq_base=freq_base, attn_factor=attn_factor)


def _rope_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """RoPE on the last ``n_rot`` dims of each head of ``x`` ``(n, heads, d)`` (``ggml_rope_set_offset``)."""
    out = np.array(x, dtype=np.float32, copy=True)
    d = x.shape[2]
    out[:, :, d - n_rot :] = apply_rope(np.ascontiguousarray(x[:, :, d - n_rot :]), cos, sin, RopeType.NORM, n_rot)
    return out


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Compressor:
    kv: DenseMatrix
    gate: DenseMatrix
    ape: np.ndarray  # (ratio, width)
    norm: np.ndarray  # (d,)

    def inputs(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ratio = self.ape.shape[0]
        return self.kv(x), self.gate(x) + self.ape[positions % ratio]


class DSV4Block:
    """One deepseek4 layer's attention (:class:`~aioexperts._model.blocks.AttentionBlock`).

    Attributes:
        ratio: the layer's compress ratio (0, 4 or 128).
        f16_cache: round what llama.cpp keeps in its K cache type to F16, as its default F16 caches do
            (llama-kv-cache-dsv4.cpp: the raw window keys, the compressed rows, and the indexer's rows
            after a Hadamard rotation that its index queries take too); the compressor's state stays
            float32 (llama.cpp's is F32). The attention block is then llama.cpp's to float noise, and
            the indexer's near-ties fall as in llama.cpp. False: everything float32, as llama.cpp
            with F32 caches (``load(kv_type="f32")`` sets it).

    Raises (at construction):
        FormatError: a required tensor or key is missing or misshaped, a ratio other than 0, 4 or 128,
            heads that the output groups do not divide, ``head_count_kv`` other than 1.
    """

    #: the cache arrays stay float32 whatever ``load(kv_type=)`` says (the compressor's state must);
    #: ``load`` sets :attr:`f16_cache` from the KV type instead
    kv_float32 = True

    def __init__(self, hp: ModelHParams, reader: TensorReader, layer: int) -> None:
        p = f"blk.{layer}."
        self.hp, self.layer = hp, layer
        nh, d, n_embd = hp.n_head, hp.head_k, hp.n_embd
        if hp.n_head_kv != 1 or hp.head_v != d:
            raise FormatError(
                f"{hp.arch}: one K=V head is expected (head_count_kv 1, key_length = value_length), got "
                f"head_count_kv={hp.n_head_kv}, key_length={d}, value_length={hp.head_v}"
            )
        self.ratio = _ratio_of(hp, layer)
        q_rank = _positive_int(hp, "attention.q_lora_rank")
        self.window = _positive_int(hp, "attention.sliding_window")
        self.n_groups = _positive_int(hp, "attention.output_group_count")
        o_rank = _positive_int(hp, "attention.output_lora_rank")
        if nh % self.n_groups:
            raise FormatError(f"{hp.arch}: {nh} heads do not split into {self.n_groups} output groups")
        self.n_rot = hp.rope.n_rot
        if not (0 < self.n_rot <= d and self.n_rot % 2 == 0):
            raise FormatError(f"{hp.arch}.rope.dimension_count={self.n_rot} must be even and in 1..{d}")
        self.wq_a = reader.matrix(p + "attn_q_a.weight", (q_rank, n_embd))
        self.q_a_norm = reader.array(p + "attn_q_a_norm.weight", (q_rank,))
        self.wq_b = reader.matrix(p + "attn_q_b.weight", (nh * d, q_rank))
        self.wkv = reader.matrix(p + "attn_kv.weight", (d, n_embd))
        self.kv_norm = reader.array(p + "attn_kv_a_norm.weight", (d,))
        self.sinks = reader.array(p + "attn_sinks.weight", (nh,))
        group_dim = nh // self.n_groups * d
        wo_a = reader.matrix(p + "attn_output_a.weight", (self.n_groups * o_rank, group_dim))
        self.wo_a = [
            DenseMatrix(
                f"{wo_a.name}[{g}]",
                wo_a.raw[g * o_rank * wo_a.row_bytes : (g + 1) * o_rank * wo_a.row_bytes],
                wo_a.ggml_type,
                (o_rank, group_dim),
            )
            for g in range(self.n_groups)
        ]
        self.wo_b = reader.matrix(p + "attn_output_b.weight", (n_embd, self.n_groups * o_rank))
        self.rope = _rope_of(hp, self.ratio != 0)
        self.rope_table = rope_table(self.rope)
        self.scale = 1.0 / math.sqrt(d)
        self.comp: _Compressor | None = None
        self.index: _Compressor | None = None
        self.f16_cache = True
        if self.ratio:
            width = (2 if self.ratio == CSA_RATIO else 1) * d
            self.comp = self._compressor(reader, p + "attn_compressor_", width, d)
        if self.ratio == CSA_RATIO:
            self.idx_heads = _positive_int(hp, "attention.indexer.head_count")
            self.idx_dim = _positive_int(hp, "attention.indexer.key_length")
            self.top_k = _positive_int(hp, "attention.indexer.top_k")
            if self.idx_dim < self.n_rot:
                raise FormatError(f"{hp.arch}.attention.indexer.key_length={self.idx_dim} is below the rotated dims")
            self.idx_q_b = reader.matrix(p + "indexer.attn_q_b.weight", (self.idx_heads * self.idx_dim, q_rank))
            self.idx_proj = reader.matrix(p + "indexer.proj.weight", (self.idx_heads, n_embd))
            self.index = self._compressor(reader, p + "indexer_compressor_", 2 * self.idx_dim, self.idx_dim)
            self.hadamard = ca.hadamard(self.idx_dim) if self.idx_dim & (self.idx_dim - 1) == 0 else None

    def _compressor(self, reader: TensorReader, prefix: str, width: int, d: int) -> _Compressor:
        n_embd = self.hp.n_embd
        return _Compressor(
            reader.matrix(prefix + "kv.weight", (width, n_embd)),
            reader.matrix(prefix + "gate.weight", (width, n_embd)),
            reader.array(prefix + "ape.weight", (self.ratio, width)),
            reader.array(prefix + "norm.weight", (d,)),
        )

    def cache_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """``kv`` ``(head_k,)``; compressed layers add ``comp_kv``, ``comp_score`` and ``rows``, CSA layers
        ``idx_kv``, ``idx_score`` and ``idx_rows`` (module docstring)."""
        return dsv4_cache_shapes(self.hp, self.layer)

    def attention(self, x: np.ndarray, cache: Mapping[str, np.ndarray], start: int) -> np.ndarray:
        """See :class:`~aioexperts._model.blocks.AttentionBlock`."""
        return self.run(x, cache, start)

    def run(
        self,
        x: np.ndarray,
        cache: Mapping[str, np.ndarray],
        start: int,
        *,
        picks: Sequence[np.ndarray] | None = None,
        capture: dict[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """:meth:`attention`, with the indexer's choice forced (``picks``: per query the row ids of a
        CSA layer, as llama.cpp's ``lid_top_k``) and the indexer's scores and choices put in ``capture``
        (``lid_scores``, ``lid_top_k``)."""
        hp = self.hp
        n = x.shape[0]
        end = start + n
        nh, d, eps = hp.n_head, hp.head_k, hp.norm_eps
        positions = np.arange(start, end)
        cos, sin = self.rope_table.cos_sin(start, n)
        qr = rms_norm(self.wq_a(x), self.q_a_norm, eps)
        q = rms_norm(self.wq_b(qr).reshape(n, nh, d), None, eps)
        q = _rope_tail(q, cos, sin, self.n_rot)
        kv = rms_norm(self.wkv(x), self.kv_norm, eps)
        cache["kv"][start:end] = self._stored(_rope_tail(kv[:, None], cos, sin, self.n_rot)[:, 0])
        rows = np.empty((0, d), dtype=np.float32)
        chosen: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * n
        if self.comp is not None:
            r = self.ratio
            n_visible = (positions + 1) // r
            rows = self._update_rows(self.comp, x, positions, cache, "comp_kv", "comp_score", "rows")[: end // r]
            if self.index is None:
                chosen = [np.arange(v) for v in n_visible]
            elif picks is not None:
                chosen = [np.asarray(c)[np.asarray(c) < v] for c, v in zip(picks, n_visible, strict=True)]
            else:
                chosen = self._indexer(x, qr, positions, cache, n_visible, capture)
        out = ca.attend_window_rows(q, cache["kv"][:end], rows, start, self.window, chosen, self.scale, self.sinks)
        out = _rope_tail(out, cos, -sin, self.n_rot)  # ggml_rope_ext_back
        group = out.reshape(n, self.n_groups, -1)
        oa = np.concatenate([self.wo_a[g](np.ascontiguousarray(group[:, g])) for g in range(self.n_groups)], axis=1)
        y: np.ndarray = self.wo_b(oa)
        return y

    def _stored(self, x: np.ndarray) -> np.ndarray:
        """``x`` as llama.cpp's K cache type keeps it: rounded to F16 (:attr:`f16_cache`) or as it is."""
        return x.astype(np.float16).astype(np.float32) if self.f16_cache else x

    def _update_rows(
        self,
        comp: _Compressor,
        x: np.ndarray,
        positions: np.ndarray,
        cache: Mapping[str, np.ndarray],
        kv_name: str,
        score_name: str,
        rows_name: str,
    ) -> np.ndarray:
        """Keep the positions' compressor inputs, make the rows their positions finish; the rows array."""
        r = self.ratio
        start, end = int(positions[0]), int(positions[-1]) + 1
        ckv, cscore = comp.inputs(x, positions)
        cache[kv_name][start:end] = ckv
        cache[score_name][start:end] = cscore
        blocks = range(start // r, end // r)
        n_ctx, d = cache[rows_name].shape[0], comp.norm.shape[0]
        rows = cache[rows_name].reshape(-1)[: n_ctx // r * d].reshape(n_ctx // r, d)  # a view: row b at index b
        if len(blocks):
            new = ca.compressed_rows(cache[kv_name], cache[score_name], blocks, r, overlap=r == CSA_RATIO)
            new = rms_norm(new, comp.norm, self.hp.norm_eps)
            cos, sin = rope_cos_sin(self.rope, np.asarray(blocks) * r)
            new = _rope_tail(new[:, None], cos, sin, self.n_rot)[:, 0]
            if rows_name == "idx_rows" and self.f16_cache and self.hadamard is not None:
                new = new @ self.hadamard
            rows[blocks.start : blocks.stop] = self._stored(new)
        return rows

    def _indexer(
        self,
        x: np.ndarray,
        qr: np.ndarray,
        positions: np.ndarray,
        cache: Mapping[str, np.ndarray],
        n_visible: np.ndarray,
        capture: dict[str, np.ndarray] | None,
    ) -> list[np.ndarray]:
        assert self.index is not None
        n = x.shape[0]
        end = int(positions[-1]) + 1
        rows = self._update_rows(self.index, x, positions, cache, "idx_kv", "idx_score", "idx_rows")
        rows = rows[: end // self.ratio]
        cos, sin = self.rope_table.cos_sin(int(positions[0]), n)
        iq = _rope_tail(self.idx_q_b(qr).reshape(n, self.idx_heads, self.idx_dim), cos, sin, self.n_rot)
        if self.f16_cache and self.hadamard is not None:
            iq = iq @ self.hadamard
        w = self.idx_proj(x) * np.float32(1.0 / math.sqrt(self.idx_dim * self.idx_heads))
        chosen: list[np.ndarray] = []
        captured = []
        step = max(1, INDEX_SCORE_FLOATS // max(1, self.idx_heads * len(rows)))  # queries per chunk
        for a in range(0, n, step):
            scores = ca.index_scores(iq[a : a + step], w[a : a + step], rows, n_visible[a : a + step])
            chosen += ca.select_rows(scores, n_visible[a : a + step], self.top_k)
            if capture is not None:
                captured.append(scores)
        if capture is not None:
            capture["lid_scores"] = np.concatenate(captured)
        return chosen


register_block("dsv4", DSV4Block)
