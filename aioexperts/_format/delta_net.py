"""Hyper-parameters of Qwen3.5-MoE's gated delta net layers, read as llama.cpp reads them.

:meth:`DeltaNetHParams.from_metadata` follows ``llama_model_qwen35moe::load_arch_hparams``
(src/models/qwen35moe.cpp): the required ``ssm.conv_kernel``, ``ssm.inner_size``, ``ssm.state_size``,
``ssm.time_step_rank`` and ``ssm.group_count``, and which blocks are recurrent:
``attention.recurrent_layers`` (a per-block array) when present, else block ``il`` is recurrent when
``(il + 1) % full_attention_interval != 0`` (interval 4 when the key is absent).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioexperts._errors import FormatError
from aioexperts._format.keys import ArchKeys

__all__ = ("DeltaNetHParams",)

_DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True, slots=True)
class DeltaNetHParams:
    """The gated delta net's sizes and the recurrent blocks.

    Attributes:
        d_conv: ``ssm.conv_kernel``, taps of the causal convolution.
        d_inner: ``ssm.inner_size``, the value width (``n_v_heads * head_v``).
        head_k: ``ssm.state_size``, the q/k head size (llama.cpp's ``head_k_dim``).
        n_k_heads: ``ssm.group_count``, q/k heads.
        n_v_heads: ``ssm.time_step_rank``, value heads.
        recurrent: per block, whether it is a gated delta net layer (else full attention).
    """

    d_conv: int
    d_inner: int
    head_k: int
    n_k_heads: int
    n_v_heads: int
    recurrent: tuple[bool, ...]

    @property
    def head_v(self) -> int:
        """Value head size, ``d_inner / n_v_heads``."""
        return self.d_inner // self.n_v_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: ``2 * n_k_heads * head_k + d_inner`` (q | k | v)."""
        return 2 * self.n_k_heads * self.head_k + self.d_inner

    @classmethod
    def from_metadata(cls, arch: str, metadata: Mapping[str, Any], n_layer: int) -> DeltaNetHParams:
        """Read the keys of ``arch`` (``qwen35moe``) for its first ``n_layer`` blocks.

        Raises:
            FormatError: a required key is missing or not a positive integer, the sizes do not fit
                (``inner_size`` not ``time_step_rank * state_size``, value heads not a multiple of
                the q/k heads), a malformed ``attention.recurrent_layers`` array.
        """
        md = ArchKeys(arch, metadata)
        sizes = {}
        for name in ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"):
            value = md.int_(name, required=True)
            if value <= 0:
                raise FormatError(f"{md.key(name)} must be > 0, got {value}")
            sizes[name] = value
        d_conv, d_inner, head_k = sizes["ssm.conv_kernel"], sizes["ssm.inner_size"], sizes["ssm.state_size"]
        n_v, n_k = sizes["ssm.time_step_rank"], sizes["ssm.group_count"]
        # qwen35moe.cpp load_arch_tensors sizes the value heads ssm_d_state wide; the graph splits d_inner
        if d_inner != n_v * head_k:
            raise FormatError(
                f"{md.key('ssm.inner_size')}={d_inner} must be {md.key('ssm.time_step_rank')} * "
                f"{md.key('ssm.state_size')} = {n_v * head_k}"
            )
        if n_v % n_k:
            raise FormatError(
                f"{md.key('ssm.time_step_rank')}={n_v} value heads must be a multiple of "
                f"{md.key('ssm.group_count')}={n_k} q/k heads"
            )
        return cls(d_conv, d_inner, head_k, n_k, n_v, _recurrent_blocks(md, n_layer))


def _recurrent_blocks(md: ArchKeys, n_layer: int) -> tuple[bool, ...]:
    """qwen35moe.cpp ``load_arch_hparams``: the ``attention.recurrent_layers`` array, else the interval rule."""
    layers = md.md.get(md.key("attention.recurrent_layers"))
    if layers is not None:
        if not isinstance(layers, list | tuple) or len(layers) < n_layer:
            raise FormatError(f"{md.key('attention.recurrent_layers')} must be an array of {n_layer} or more values")
        return tuple(bool(v) for v in layers[:n_layer])
    interval = md.md.get(md.key("full_attention_interval"), _DEFAULT_FULL_ATTENTION_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, numbers.Integral) or interval <= 0:
        raise FormatError(f"{md.key('full_attention_interval')} must be an integer > 0, got {interval!r}")
    return tuple((il + 1) % int(interval) != 0 for il in range(n_layer))
