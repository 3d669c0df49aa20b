"""The architecture registry: one module per architecture (or family), one table built from them.

Each module here (``qwen3moe.py``, ``deepseek2.py``, ...) holds the :class:`Architecture` entries of
one llama.cpp graph file: its MoE rules (:class:`MoERule`: what the arch's ``load_arch_hparams`` and
``build_moe_ffn`` call site fix, read by :meth:`~aioexperts._format.hparams.MoEHParams.from_metadata`)
and its whole-model record (:class:`ArchitectureRecord`: RoPE pairing, norms, block, read by
:func:`~aioexperts._format.architectures.model_hparams`), each beside a comment naming the llama.cpp
source it follows. ``refused.py`` holds the MoE architectures that are refused, with their reasons;
``generic.py`` the rules of a name llama.cpp does not know and llama.cpp's list of names.

:data:`ARCHITECTURES` is the one table (name -> :class:`Architecture`); the other names here are
columns of it: :data:`STATUSES` (the architecture table of docs/executor.md), :data:`MODEL_RECORDS`
(what ``load()`` runs), :data:`REFUSED` and :data:`WHOLE_MODEL_MISSING`.

A new architecture adds a module here (and its name to ``_MODULES``); a whole-model record for an
architecture from outside plugs in with :func:`register_architecture` (see
``aioexperts/_model/__init__.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import TypeVar

from aioexperts._format.archs import (
    bailingmoe,
    dbrx,
    deepseek,
    deepseek2,
    deepseek4,
    dots1,
    ernie4_5_moe,
    glm4moe,
    gpt_oss,
    granite,
    grok,
    hunyuan_moe,
    llama,
    llama4,
    minimax_m2,
    olmoe,
    phimoe,
    qwen2moe,
    qwen3moe,
    qwen3next,
    qwen35moe,
    refused,
)
from aioexperts._format.archs._base import (
    Activation,
    Architecture,
    ArchitectureRecord,
    GatingFunc,
    MoERule,
    RopeType,
    Status,
)
from aioexperts._format.archs.generic import GENERIC, LLAMA_CPP_ARCHS

__all__ = (
    "ARCHITECTURES",
    "GENERIC",
    "LLAMA_CPP_ARCHS",
    "MODEL_RECORDS",
    "REFUSED",
    "STATUSES",
    "WHOLE_MODEL_MISSING",
    "Activation",
    "Architecture",
    "ArchitectureRecord",
    "GatingFunc",
    "MoERule",
    "RopeType",
    "Status",
    "architecture_status",
    "moe_rule",
    "register_architecture",
)

_MODULES = (
    qwen2moe,
    qwen3moe,
    qwen3next,
    llama,
    granite,
    olmoe,
    deepseek,
    deepseek2,
    glm4moe,
    gpt_oss,
    dbrx,
    phimoe,
    ernie4_5_moe,
    hunyuan_moe,
    bailingmoe,
    dots1,
    grok,
    minimax_m2,
    llama4,
    qwen35moe,
    deepseek4,
    refused,
)

_REGISTRY: dict[str, Architecture] = {}
for _module in _MODULES:
    for _arch in _module.ARCHS:
        if _arch.name in _REGISTRY:
            raise RuntimeError(f"architecture {_arch.name!r} is in two modules of aioexperts._format.archs")
        _REGISTRY[_arch.name] = _arch
del _module, _arch

#: The registry: every architecture with MoE rules, a refusal or a whole-model record, by ``general.architecture``.
ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(_REGISTRY)

_T = TypeVar("_T")


class _Column(Mapping[str, _T]):
    """One field of every entry of the registry that has it (a live view: registrations show)."""

    __slots__ = ("_get",)

    def __init__(self, get: Callable[[Architecture], _T | None]) -> None:
        self._get = get

    def __getitem__(self, name: str) -> _T:
        arch = _REGISTRY.get(name)
        value = self._get(arch) if arch is not None else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name, arch in _REGISTRY.items() if self._get(arch) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{k!r}: {v!r}' for k, v in self.items())}}}"


#: The architecture table of docs/executor.md: every name with MoE rules or a refusal -> its :class:`Status`.
STATUSES: Mapping[str, Status] = _Column(lambda arch: arch.status)
#: The architectures the whole-model forward pass runs -> their :class:`ArchitectureRecord`.
MODEL_RECORDS: Mapping[str, ArchitectureRecord] = _Column(lambda arch: arch.model)
#: The MoE architectures of llama.cpp that are refused -> what is missing.
REFUSED: Mapping[str, str] = _Column(lambda arch: arch.refused or None)
#: Architectures whose MoE layers are served (``open()`` + ``MoERunner``) but whose whole-model forward
#: pass is not in this library -> what ``load()`` lacks for each (the model layer's refusal names it).
WHOLE_MODEL_MISSING: Mapping[str, str] = _Column(lambda arch: arch.whole_model_missing or None)


def moe_rule(arch: str) -> MoERule | None:
    """The MoE rules of ``arch``; None when it has none (refused, unknown, or only a whole-model record)."""
    entry = _REGISTRY.get(arch)
    return entry.moe if entry is not None else None


def architecture_status(arch: str) -> Status | None:
    """The table status of ``arch``: golden, source or refused; None for a name without MoE rules or refusal."""
    entry = _REGISTRY.get(arch)
    return entry.status if entry is not None else None


def register_architecture(record: ArchitectureRecord) -> ArchitectureRecord:
    """Add (or replace) the whole-model record of ``record.name`` in :data:`ARCHITECTURES`; returns it.

    The architecture's MoE rules stay as they are (a name without an entry gets one with no MoE
    rules: its MoE layers are read as llama.cpp's list of names says, see ``generic.py``).
    """
    entry = _REGISTRY.get(record.name)
    _REGISTRY[record.name] = (
        dataclasses.replace(entry, model=record) if entry is not None else Architecture(record.name, model=record)
    )
    return record
