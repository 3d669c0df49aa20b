"""Hyper-parameters of multi-head latent attention (MLA, DeepSeek-V2/V3), read as llama.cpp reads them.

:meth:`MLAHParams.from_metadata` takes ``general.architecture`` and the GGUF metadata mapping and
returns the frozen record :mod:`aioexperts._compute.mla` computes with. The keys and their defaults
are those of ``llama_model_deepseek2::load_arch_hparams`` (src/models/deepseek2.cpp:
``attention.q_lora_rank``, ``attention.kv_lora_rank``, ``attention.key_length_mla``,
``attention.value_length_mla``, ``rope.scaling.yarn_log_multiplier``, ``attention.temperature_scale``
and ``temperature_length``) and of ``llama_model::load_hparams`` (src/llama-model.cpp: head count,
``rope.dimension_count``, the RMSNorm epsilon). The RoPE frequencies and YaRN's factors of
``ggml_rope_ext`` are the model's RoPE parameters, not part of this record.

Current conversions store ``attn_k_b`` / ``attn_v_b`` split per head and the ``*_length_mla`` keys
(llama.cpp's ``hparams.is_mla()``). Older ones (before llama.cpp's split, many DeepSeek-V2/V3/R1 files)
have one ``attn_kv_b`` and the per-head sizes in ``key_length`` / ``value_length``
(:attr:`MLAHParams.split_kv_b` False); llama.cpp runs those as plain multi-head attention, which is
the same maths: the block splits ``attn_kv_b`` into the two per-head parts when it loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioexperts._errors import FormatError, UnsupportedTypeError
from aioexperts._format.keys import ArchKeys

__all__ = ("MLA_ARCHITECTURES", "MLAHParams")

#: architectures whose attention is MLA as src/models/deepseek2.cpp builds it
MLA_ARCHITECTURES = frozenset({"deepseek2"})

# deepseek2.cpp load_arch_hparams: the "lite" variants (DeepSeek-V2-Lite, GigaChat3-10B-A1.8B,
# Kanana-2-30B-A3B) have no q LoRA (one attn_q) and llama.cpp does not read q_lora_rank for them
_LITE_LAYER_COUNTS = (26, 27)
_LITE_48_VOCAB = 128256


@dataclass(frozen=True, slots=True)
class MLAHParams:
    """The MLA attention of one model (every layer the same).

    Attributes:
        n_embd: residual width (``embedding_length``).
        n_head: query heads (``attention.head_count``).
        q_lora_rank: rank of the query LoRA (``attn_q_a`` / ``attn_q_b``); 0 for the lite variants
            with one ``attn_q``.
        kv_lora_rank: width of the compressed latent that ``attn_kv_a_norm`` normalises and the KV
            cache stores (``attention.kv_lora_rank``).
        key_length: per-head query/key width, no-RoPE part plus RoPE part (``key_length_mla``; old
            files: ``key_length``, default ``n_embd / n_head``).
        value_length: per-head value width after ``attn_v_b`` (``value_length_mla``; old files:
            ``value_length``).
        rope_dims: RoPE part of each head and width of the shared RoPE key (``rope.dimension_count``).
        rms_eps: epsilon of every RMSNorm (``attention.layer_norm_rms_epsilon``).
        yarn_log_multiplier: ``rope.scaling.yarn_log_multiplier`` as the file stores it (the convert
            script's ``0.1 * mscale_all_dim``); 0 when absent.
        temperature_scale: ``attention.temperature_scale`` (Mistral-Large-style query temperature);
            0: none.
        temperature_length: ``attention.temperature_length``, the position bucket of that temperature.
        split_kv_b: the file has ``attn_k_b`` / ``attn_v_b``; False: one ``attn_kv_b``
            (``(H * (nope_dims + value_length), kv_lora_rank)``, per head its no-RoPE key rows then its
            value rows).
    """

    n_embd: int
    n_head: int
    q_lora_rank: int
    kv_lora_rank: int
    key_length: int
    value_length: int
    rope_dims: int
    rms_eps: float
    yarn_log_multiplier: float = 0.0
    temperature_scale: float = 0.0
    temperature_length: int = 0
    split_kv_b: bool = True

    @property
    def nope_dims(self) -> int:
        """Per-head query width without RoPE (``key_length - rope_dims``), absorbed by ``attn_k_b``."""
        return self.key_length - self.rope_dims

    @property
    def cache_width(self) -> int:
        """Floats the latent KV cache stores per position: ``kv_lora_rank + rope_dims``."""
        return self.kv_lora_rank + self.rope_dims

    def tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The attention tensors of block ``layer`` with their numpy shapes, all required.

        src/models/deepseek2.cpp ``load_arch_tensors``.
        """
        p = f"blk.{layer}."
        h, n_embd = self.n_head, self.n_embd
        shapes: dict[str, tuple[int, ...]] = {}
        if self.q_lora_rank > 0:
            shapes[p + "attn_q_a.weight"] = (self.q_lora_rank, n_embd)
            shapes[p + "attn_q_a_norm.weight"] = (self.q_lora_rank,)
            shapes[p + "attn_q_b.weight"] = (h * self.key_length, self.q_lora_rank)
        else:
            shapes[p + "attn_q.weight"] = (h * self.key_length, n_embd)
        shapes[p + "attn_kv_a_mqa.weight"] = (self.cache_width, n_embd)
        shapes[p + "attn_kv_a_norm.weight"] = (self.kv_lora_rank,)
        if self.split_kv_b:
            shapes[p + "attn_k_b.weight"] = (h, self.kv_lora_rank, self.nope_dims)
            shapes[p + "attn_v_b.weight"] = (h, self.value_length, self.kv_lora_rank)
        else:
            shapes[p + "attn_kv_b.weight"] = (h * (self.nope_dims + self.value_length), self.kv_lora_rank)
        shapes[p + "attn_output.weight"] = (n_embd, h * self.value_length)
        return shapes

    @classmethod
    def from_metadata(cls, arch: str, metadata: Mapping[str, Any]) -> MLAHParams:
        """Read the MLA hyper-parameters of ``arch`` from the GGUF metadata.

        Args:
            arch: ``general.architecture``; one of :data:`MLA_ARCHITECTURES`.
            metadata: ``{key: python value}`` (``GGUFModel.metadata``).

        Raises:
            UnsupportedTypeError: ``arch`` is not an MLA architecture; a per-layer array where
                llama.cpp reads one value.
            FormatError: a required key is missing or has the wrong type, or the sizes do not fit
                (``rope_dims`` even and smaller than ``key_length``, widths positive, the epsilon
                positive, the floats finite).
        """
        if arch not in MLA_ARCHITECTURES:
            raise UnsupportedTypeError(f"architecture {arch!r} has no MLA attention (known: deepseek2)")
        md = ArchKeys(arch, metadata)
        n_layer = md.int_("block_count", required=True)
        n_vocab = md.vocab_size()
        is_lite = n_layer in _LITE_LAYER_COUNTS or (n_layer == 48 and n_vocab == _LITE_48_VOCAB)
        n_embd = md.int_("embedding_length", required=True)
        n_head = md.int_("attention.head_count", required=True)
        # llama_hparams::is_mla(): both *_mla keys (it asserts both or neither); else one attn_kv_b
        n_mla_keys = sum(md.int_(k) != 0 for k in ("attention.key_length_mla", "attention.value_length_mla"))
        if n_mla_keys == 1:
            raise FormatError(
                f"{md.key('attention.key_length_mla')} and {md.key('attention.value_length_mla')} must be set together"
            )
        split = n_mla_keys == 2
        if split:
            key_length = md.int_("attention.key_length_mla")
            value_length = md.int_("attention.value_length_mla")
        else:
            head = n_embd // n_head if n_head > 0 else 0
            key_length = md.int_("attention.key_length", default=head)
            value_length = md.int_("attention.value_length", default=head)
        if not md.has("attention.layer_norm_rms_epsilon"):
            raise FormatError(f"missing required key {md.key('attention.layer_norm_rms_epsilon')}")
        hp = cls(
            n_embd=n_embd,
            n_head=n_head,
            q_lora_rank=0 if is_lite else md.int_("attention.q_lora_rank", required=True),
            kv_lora_rank=md.int_("attention.kv_lora_rank", required=True),
            key_length=key_length,
            value_length=value_length,
            rope_dims=md.int_("rope.dimension_count", required=True),
            rms_eps=md.float_("attention.layer_norm_rms_epsilon", 0.0),
            yarn_log_multiplier=md.float_("rope.scaling.yarn_log_multiplier", 0.0),
            temperature_scale=md.float_("attention.temperature_scale", 0.0),
            temperature_length=md.int_("attention.temperature_length"),
            split_kv_b=split,
        )
        hp._check(md)
        return hp

    def _check(self, md: ArchKeys) -> None:
        suffix = "_mla" if self.split_kv_b else ""
        key_key, value_key = f"attention.key_length{suffix}", f"attention.value_length{suffix}"
        positive = {
            "embedding_length": self.n_embd,
            "attention.head_count": self.n_head,
            "attention.kv_lora_rank": self.kv_lora_rank,
            key_key: self.key_length,
            value_key: self.value_length,
            "rope.dimension_count": self.rope_dims,
        }
        for name, value in positive.items():
            if value <= 0:
                raise FormatError(f"{md.key(name)} must be > 0, got {value}")
        if self.q_lora_rank < 0:
            raise FormatError(f"{md.key('attention.q_lora_rank')} must be >= 0, got {self.q_lora_rank}")
        if self.rope_dims % 2 or self.rope_dims >= self.key_length:
            raise FormatError(
                f"{md.key('rope.dimension_count')} = {self.rope_dims} must be even and smaller than "
                f"{md.key(key_key)} = {self.key_length} (deepseek2.cpp: n_embd_head_qk_nope >= 1)"
            )
        floats = (
            ("attention.layer_norm_rms_epsilon", self.rms_eps),
            ("rope.scaling.yarn_log_multiplier", self.yarn_log_multiplier),
            ("attention.temperature_scale", self.temperature_scale),
        )
        for key, number in floats:
            if not math.isfinite(number):
                raise FormatError(f"{md.key(key)} must be finite, got {number}")
        if not self.rms_eps > 0.0:
            raise FormatError(f"{md.key('attention.layer_norm_rms_epsilon')} must be > 0, got {self.rms_eps}")
        if self.temperature_scale != 0.0 and self.temperature_length <= 0:
            raise FormatError(
                f"{md.key('attention.temperature_length')} must be > 0 when {md.key('attention.temperature_scale')} "
                f"is set, got {self.temperature_length}"
            )
