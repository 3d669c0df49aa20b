"""The slab size of :func:`aioexperts.load` when none is given: from the memory the process may use.

The memory this process may still take is the least of, where each applies:

- its cgroup's limit minus the cgroup's usage, for the cgroup and every ancestor (v2
  ``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``;
  the page cache is charged to the cgroup, so the usage includes it);
- ``RLIMIT_AS`` minus the process's virtual size (``VmSize`` of ``/proc/self/status``);
- ``MemAvailable`` of ``/proc/meminfo``.

From that the slab gets what is left after the resident (non-expert) weights, one sequence's KV
cache and a reserve (:data:`RUNTIME_RESERVE_BYTES` for the page cache the dense load and the
tokenizer still use, the compiled kernels and the compute buffers, plus :data:`RESERVE_FRACTION`
of the available memory); the store rounds it to whole slots and to at least ``2 * top-k`` of them.

The same limit, with a cgroup's inactive page cache counted as free (the kernel reclaims it first),
bounds one sequence's KV cache: :func:`check_kv_fits` refuses an ``n_ctx`` whose KV cache is larger
than the memory left, before anything is allocated for it.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from dataclasses import dataclass

from aioexperts._cgroups import cgroup_mounts, memory_cgroups
from aioexperts._errors import ConfigError
from aioexperts._format.architectures import ModelHParams
from aioexperts._format.delta_net import DeltaNetHParams
from aioexperts._format.mla import MLAHParams
from aioexperts._format.model import GGUFModel
from aioexperts._model.dsv4_block import dsv4_cache_shapes

__all__ = (
    "RESERVE_FRACTION",
    "RUNTIME_RESERVE_BYTES",
    "MemoryLimit",
    "SlabBudget",
    "check_kv_fits",
    "choose_slab_bytes",
    "kv_bytes_per_position",
    "kv_reserve_bytes",
    "read_memory_limit",
    "resident_weight_bytes",
)

log = logging.getLogger("aioexperts")

RUNTIME_RESERVE_BYTES = 256 << 20
"""Bytes kept out of the slab for the page cache still needed, the compiled kernels and compute buffers."""

RESERVE_FRACTION = 0.05
"""Fraction of the available memory kept out of the slab on top of :data:`RUNTIME_RESERVE_BYTES`."""

_UNLIMITED = 1 << 60  # v1 writes PAGE_COUNTER_MAX (about 2**63) for "no limit"


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The memory this process may still use.

    Attributes:
        available: bytes, the least of the sources that apply.
        source: which source set ``available`` (e.g. ``"cgroup v1 /sys/fs/cgroup/memory/x"``).
        sources: every source read, ``(name, bytes still available)``.
    """

    available: int
    source: str
    sources: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class SlabBudget:
    """How :func:`choose_slab_bytes` sized the slab (all bytes).

    Attributes:
        slab_bytes: what the slab was given (before the store rounds it to whole slots).
        limit: the memory limit it was taken from.
        resident_bytes: the non-expert weights kept in memory.
        kv_bytes: one sequence's KV cache.
        reserve_bytes: kept for the page cache, kernels and compute buffers.
        fits: False when the limit left less than one slot: the slab then takes the store's minimum
            (``2 * top-k`` slots) and the process may exceed the limit.
    """

    slab_bytes: int
    limit: MemoryLimit
    resident_bytes: int
    kv_bytes: int
    reserve_bytes: int
    fits: bool

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"slab {self.slab_bytes / mib:.0f} MiB = {self.limit.available / mib:.0f} MiB available "
            f"({self.limit.source}) - {self.resident_bytes / mib:.0f} MiB resident weights - "
            f"{self.kv_bytes / mib:.0f} MiB KV cache - {self.reserve_bytes / mib:.0f} MiB reserve"
            + ("" if self.fits else " (the limit leaves no room: the store's minimum slab)")
        )


def _read_int(path: str) -> int | None:
    """The integer in a cgroup or proc file; None when absent, unreadable or ``max``."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max" (v2 unlimited) or garbage
    value = int(text)
    return None if value >= _UNLIMITED else value


_LIMIT_FILES = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
# page cache the kernel reclaims before it fails an allocation (cadvisor's working set leaves it out too)
_INACTIVE_FILE = {"v2": ("inactive_file",), "v1": ("total_inactive_file", "inactive_file")}


def _stat_field(path: str, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` found in a cgroup ``memory.stat`` file (0 when none is readable)."""
    try:
        with open(path) as f:
            fields = dict(line.split(maxsplit=1) for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return 0
    for key in keys:
        value = fields.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def _cgroup_headroom(root: str, reclaimable: bool = False) -> list[tuple[str, int]]:
    """``(name, limit - usage)`` of the tightest limited level of this process's cgroup, v1 and v2
    (``reclaimable``: the usage without the inactive page cache of ``memory.stat``)."""
    v2_mount, v1_mount = cgroup_mounts(root)
    found: list[tuple[str, int]] = []
    for kind, directory in memory_cgroups(root):
        files = _LIMIT_FILES[kind]
        mount = v2_mount if kind == "v2" else v1_mount
        assert mount is not None
        top = os.path.join(root, mount[0].lstrip("/"))
        best: tuple[str, int] | None = None
        while True:  # the cgroup and its ancestors up to the mount point
            limit = _read_int(os.path.join(directory, files[0]))
            if limit is not None:
                usage = _read_int(os.path.join(directory, files[1])) or 0
                if reclaimable:
                    usage -= min(usage, _stat_field(os.path.join(directory, "memory.stat"), _INACTIVE_FILE[kind]))
                room = max(0, limit - usage)
                if best is None or room < best[1]:
                    shown = "/" + os.path.relpath(directory, root) if root != "/" else directory
                    best = (f"cgroup {kind} {shown}", room)
            if os.path.normpath(directory) == os.path.normpath(top):
                break
            directory = os.path.dirname(os.path.normpath(directory))
        if best is not None:
            found.append(best)
    return found


def _address_space_headroom(root: str) -> tuple[str, int] | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    vm_size = _meminfo_field(os.path.join(root, "proc/self/status"), "VmSize") or 0
    return ("RLIMIT_AS", max(0, soft - vm_size))


def _meminfo_field(path: str, name: str) -> int | None:
    """A ``Name:  N kB`` field of a proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    number = value.split()
                    return int(number[0]) * 1024 if number and number[0].isdigit() else None
    except OSError:
        return None
    return None


def read_memory_limit(root: str = "/", *, reclaimable: bool = False) -> MemoryLimit:
    """The memory this process may still use (see the module docstring).

    Args:
        root: the file-system root the ``/proc`` and cgroup files are read under (tests fake it;
            ``RLIMIT_AS`` is always the process's own).
        reclaimable: count a cgroup's inactive page cache (``memory.stat`` ``inactive_file``, v1
            ``total_inactive_file``) as free, as the kernel reclaims it before it fails an
            allocation (``MemAvailable`` counts it already). The slab is sized without it; the KV
            cache check (:func:`check_kv_fits`) uses it, so a cgroup full of cached model file
            pages does not refuse a KV cache that fits.

    Returns:
        A :class:`MemoryLimit`; when nothing can be read, ``available`` is ``2**62`` with source
        ``"unknown"``.
    """
    sources: list[tuple[str, int]] = _cgroup_headroom(root, reclaimable)
    address_space = _address_space_headroom(root)
    if address_space is not None:
        sources.append(address_space)
    available = _meminfo_field(os.path.join(root, "proc/meminfo"), "MemAvailable")
    if available is not None:
        sources.append(("MemAvailable", available))
    if not sources:
        return MemoryLimit(1 << 62, "unknown", ())
    source, least = min(sources, key=lambda s: s[1])
    return MemoryLimit(least, source, tuple(sources))


def resident_weight_bytes(model: GGUFModel, hp: ModelHParams, resident_embedding_bytes: int) -> int:
    """Bytes of the tensors :func:`aioexperts.load` keeps in memory: all but the routed experts
    (``*_exps``), and the token embedding only when it is small enough or tied to the head."""
    total = 0
    has_head = "output.weight" in model.tensors
    for name, info in model.tensors.items():
        if "_exps." in name:
            continue
        if name == "token_embd.weight" and has_head and info.n_bytes > resident_embedding_bytes:
            continue  # read by rows through the store
        total += info.n_bytes
    return total


def kv_bytes_per_position(hp: ModelHParams, model: GGUFModel | None = None, element_bytes: int = 2) -> int:
    """KV cache bytes of one position over every layer, before the blocks are built: K and V of
    ``n_head_kv`` heads per layer, or, for an MLA block with ``model`` given, its latent and
    rotated key (``kv_lora_rank + rope_dims`` values, :mod:`aioexperts._model.mla_block`), of
    ``element_bytes`` each (2: the default F16 cache; 4: ``kv_type="f32"``); deepseek4: what its
    blocks keep, in float32 whatever the KV type (:func:`~aioexperts._model.dsv4_block.dsv4_cache_shapes`);
    qwen35moe's gated delta net layers (``model`` given) none (their per-sequence state is not per position).

    Raises:
        FormatError: an MLA or deepseek4 model whose attention keys are missing or malformed, a
            qwen35moe one whose ``ssm.*`` keys are.
    """
    if hp.record.block == "dsv4":  # window keys, compressor inputs and rows (aioexperts/_model/dsv4_block.py)
        return max(1, 4 * sum(math.prod(s) for il in range(hp.n_layer) for s in dsv4_cache_shapes(hp, il).values()))
    if model is not None and hp.record.block == "mla":
        return max(1, element_bytes * hp.n_layer * MLAHParams.from_metadata(hp.arch, model.metadata).cache_width)
    n_layer = hp.n_layer
    if model is not None and hp.record.block == "qwen35":  # the gated delta net layers keep no K/V
        n_layer -= sum(DeltaNetHParams.from_metadata(hp.arch, model.metadata, hp.n_layer).recurrent)
    return max(1, element_bytes * n_layer * hp.n_head_kv * (hp.head_k + hp.head_v))


def kv_reserve_bytes(hp: ModelHParams, n_ctx: int | None, memory_budget: int, per_position: int | None = None) -> int:
    """One sequence's KV cache, estimated before the blocks are built: :func:`kv_bytes_per_position`
    (or ``per_position``) for ``n_ctx`` positions (default as :func:`aioexperts.load` chooses it: the
    file's context length capped by ``memory_budget``)."""
    per_position = per_position if per_position is not None else kv_bytes_per_position(hp)
    positions = n_ctx if n_ctx is not None else min(hp.n_ctx_train, max(1, memory_budget // per_position))
    return positions * per_position


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def check_kv_fits(n_ctx: int, kv_bytes: int, limit: MemoryLimit | None = None) -> MemoryLimit:
    """Refuse a KV cache of ``kv_bytes`` (one sequence, ``n_ctx`` positions) larger than the memory
    this process may still use, before it is allocated.

    Args:
        n_ctx: the positions, for the message.
        kv_bytes: the bytes they need.
        limit: the limit (default :func:`read_memory_limit` with ``reclaimable=True``).

    Returns:
        The limit it was checked against.

    Raises:
        ConfigError: ``kv_bytes`` is more than ``limit.available``; the message names ``n_ctx``, the
            bytes needed, the limit and where it comes from.
    """
    limit = limit or read_memory_limit(reclaimable=True)
    if kv_bytes > limit.available:
        raise ConfigError(
            f"n_ctx={n_ctx} needs {kv_bytes} bytes ({_size(kv_bytes)}) of KV cache per sequence, more than the "
            f"{limit.available} bytes ({_size(limit.available)}) this process may still use ({limit.source}): "
            "load the model with a smaller n_ctx (--ctx of aioexperts-run and aioexperts-serve)"
        )
    return limit


def choose_slab_bytes(
    model: GGUFModel,
    hp: ModelHParams,
    *,
    kv_bytes: int,
    resident_embedding_bytes: int,
    limit: MemoryLimit | None = None,
) -> SlabBudget:
    """The slab size for ``model`` under the memory limit this process runs under (logged).

    Args:
        model: the opened GGUF file.
        hp: its hyper-parameters.
        kv_bytes: one sequence's KV cache in bytes.
        resident_embedding_bytes: as :func:`aioexperts.load`.
        limit: the limit (default :func:`read_memory_limit`).

    Returns:
        The :class:`SlabBudget`; its ``slab_bytes`` is at least 1 (the store then takes its minimum).
    """
    limit = limit or read_memory_limit()
    resident = resident_weight_bytes(model, hp, resident_embedding_bytes)
    reserve = RUNTIME_RESERVE_BYTES + int(limit.available * RESERVE_FRACTION)
    left = limit.available - resident - kv_bytes - reserve
    budget = SlabBudget(max(1, left), limit, resident, kv_bytes, reserve, fits=left > 0)
    (log.info if budget.fits else log.warning)("%s", budget)
    return budget
