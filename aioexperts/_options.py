"""The options of an expert store: small frozen records, checked when built.

Each record groups the settings of one concern: :class:`CacheOptions` (the slab and who stays in
it), :class:`IOOptions` (how bytes come off the disk), :class:`PageCacheOptions` (the page-cache
mode). The runner's :class:`~aioexperts.PrefetchOptions` live with the runner (``_runner.py``).
A bad value raises :class:`~aioexperts.ConfigError` from the constructor, before any
file is opened; ``dataclasses.replace(options, field=value)`` builds a checked variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cache.eviction import POLICY_NAMES, EvictionPolicy
from ._checks import check_bool, check_int
from ._errors import ConfigError
from ._io.mapping import DEFAULT_MAX_GAP, WARM_METHODS
from ._io.select import BACKEND_NAMES, BackendFactory

__all__ = (
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_BYTES_IN_FLIGHT",
    "DEFAULT_QUEUE_DEPTH",
    "MAX_QUEUE_DEPTH",
    "MIN_QUEUE_DEPTH",
    "CacheOptions",
    "IOOptions",
    "MissTier",
    "PageCacheOptions",
)

DEFAULT_CACHE_BYTES = 1 << 30
"""Slab size used when neither ``slots`` nor ``bytes`` is given: 1 GiB."""
DEFAULT_ROW_CACHE_BYTES = 16 << 20
"""The row cache's slab: 16 MiB (2048 windows of 8 KiB)."""
DEFAULT_QUEUE_DEPTH = 64
MIN_QUEUE_DEPTH = 3
"""Gate, up and down of one expert are submitted together."""
MAX_QUEUE_DEPTH = 4096
#: most worker threads of the thread backend (each a thread of the process; more only queue)
MAX_READ_THREADS = 256
DEFAULT_MAX_BYTES_IN_FLIGHT = 256 << 20
DEFAULT_SPLIT_BYTES: int | None = None
"""Reads of one expert are cut into chunks of this many bytes (None: not cut). Not cut by default:
on this project's virtio disk a cold 13.8 MiB expert read in 128 KiB..4 MiB chunks was no faster than
in one read (``bench/split_reads.py``, ``docs/results/split-reads.json``); NVMe devices
with more internal parallelism may differ: measure with the bench and set ``split_bytes``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOptions:
    """The slab of slots and the cache over it.

    The slab is sized by ``slots`` or by ``bytes``, never both (``ConfigError``); with neither it
    takes :data:`DEFAULT_CACHE_BYTES`. Sized by bytes it holds at least ``2 * expert_used_count``
    slots (one token's experts twice over); by ``slots``, exactly that many. Either way at most every
    expert of the model.

    Attributes:
        slots: slab slots, each holding one expert (gate, up and down); None to size by ``bytes``.
        bytes: slab size in bytes (rounded down to whole slots; the memory it takes is then
            rounded up to a whole 2 MiB huge page, under 2 MiB more, see ``hugepages``); None for
            the 1 GiB default.
        policy: eviction policy name (``"lru"``, ``"lfu"``, ``"lfuda"``) or an
            :class:`~aioexperts.policies.EvictionPolicy` instance (one per store).
        wait_for_slots: when every slot is pinned, wait for one (as a connection pool does)
            instead of raising :class:`~aioexperts.SlabExhaustedError` at once. A task that
            already holds pinned experts never waits for more: it gets ``SlabExhaustedError``
            (waiting could deadlock on its own pins).
        slot_timeout: seconds (float) to wait for slots before raising
            :class:`~aioexperts.SlotTimeoutError` (a ``SlabExhaustedError`` and a
            ``TimeoutError``); None waits as long as it takes. Needs ``wait_for_slots``.
        hugepages: round every slot up to 2 MiB, so that no two slots share a huge page; ``bytes``
            then counts the rounded slots (the budget stays a ceiling). Rarely needed: a slab of 4 MiB
            or more is on transparent huge pages either way (2 MiB-aligned, ``MADV_HUGEPAGE``,
            :class:`aioexperts._io.slab.Slab`), which is what makes its direct reads cheap.
        lock_memory: ``mlock`` the slab (fails with the ``RLIMIT_MEMLOCK`` value in the message).
        row_cache_bytes: the slab of the row cache (:meth:`~aioexperts.ExpertStore.rows`), made on
            the first row read: bytes, at least 16 windows of rows.

    Raises:
        ConfigError: a value out of range or of the wrong type.
    """

    slots: int | None = None
    bytes: int | None = None
    policy: str | EvictionPolicy = "lru"
    wait_for_slots: bool = True
    slot_timeout: float | None = None
    hugepages: bool = False
    lock_memory: bool = False
    row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES

    def __post_init__(self) -> None:
        check_int(self, "slots", low=1, optional=True)
        check_int(self, "row_cache_bytes", low=1)
        check_int(self, "bytes", low=1, optional=True)
        if self.slots is not None and self.bytes is not None:
            raise ConfigError(
                f"size the cache by slots or by bytes, not both (got slots={self.slots}, bytes={self.bytes})"
            )
        if isinstance(self.policy, str):
            if self.policy.lower() not in POLICY_NAMES:
                raise ConfigError(
                    f"policy must be one of {', '.join(POLICY_NAMES)} or an EvictionPolicy, got {self.policy!r}"
                )
        elif not isinstance(self.policy, EvictionPolicy):
            raise ConfigError(f"policy must be a policy name or an EvictionPolicy, got {self.policy!r}")
        check_bool("wait_for_slots", self.wait_for_slots)
        if self.slot_timeout is not None:
            t = self.slot_timeout
            if isinstance(t, bool) or not isinstance(t, int | float | np.integer) or not (math.isfinite(t) and t >= 0):
                raise ConfigError(f"slot_timeout must be a finite number of seconds >= 0 or None, got {t!r}")
            if not self.wait_for_slots:
                raise ConfigError("slot_timeout needs wait_for_slots=True")
        check_bool("hugepages", self.hugepages)
        check_bool("lock_memory", self.lock_memory)


@dataclass(frozen=True, slots=True, kw_only=True)
class IOOptions:
    """How expert bytes are read.

    Attributes:
        backend: ``"auto"`` (io_uring where its ring can be set up, else the thread pool, with
            one log line saying why), ``"io_uring"``, ``"threads"``, or a
            :data:`BackendFactory` for a custom backend. io_uring runs through the ``liburing``
            wheel, or through raw system calls where the wheel cannot run on this CPU
            (``statistics().backend_features["ring_reason"]`` says why); ``"io_uring_raw"``
            forces the raw ring.
        direct_io: True to require ``O_DIRECT``, False for buffered reads (the page cache),
            None to use ``O_DIRECT`` where a probe read works.
        queue_depth: reads in flight at most (the io_uring ring size), 3..4096.
        max_bytes_in_flight: bytes requested by the reads in flight at most (one expert always
            fits).
        fixed_buffers: register the slab with io_uring (``READV_FIXED``) where the kernel and
            ``RLIMIT_MEMLOCK`` allow.
        sqe_async: io_uring ``IOSQE_ASYNC``: submit returns at once and kernel workers issue the
            reads (less time on the loop thread, more CPU in total).
        n_threads: worker threads of the thread backend, 1 to :data:`MAX_READ_THREADS` (default
            ``min(queue_depth, 8)``).
        split_bytes: cut an expert's reads longer than this many bytes into chunks submitted
            together, so that even a single large expert (DeepSeek-class ``Q2_K`` experts are about
            12 MiB) keeps several reads in the device's queue; None reads each contiguous run
            in one piece. Chunks grow if needed so that one expert takes at most ``queue_depth``
            reads. The default comes from ``bench/split_reads.py`` (``docs/bench.md``).

    Raises:
        ConfigError: a value out of range or of the wrong type.
    """

    backend: str | BackendFactory = "auto"
    direct_io: bool | None = None
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT
    fixed_buffers: bool = True
    sqe_async: bool = False
    n_threads: int | None = None
    split_bytes: int | None = DEFAULT_SPLIT_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            if self.backend not in BACKEND_NAMES:
                raise ConfigError(
                    f"backend must be one of {', '.join(BACKEND_NAMES)} or a factory, got {self.backend!r}"
                )
        elif not callable(self.backend):
            raise ConfigError(f"backend must be a name or a factory, got {self.backend!r}")
        check_bool("direct_io", self.direct_io, optional=True)
        check_int(self, "queue_depth", low=MIN_QUEUE_DEPTH, high=MAX_QUEUE_DEPTH)
        check_int(self, "max_bytes_in_flight", low=1)
        check_bool("fixed_buffers", self.fixed_buffers)
        check_bool("sqe_async", self.sqe_async)
        check_int(self, "n_threads", low=1, high=MAX_READ_THREADS, optional=True)
        check_int(self, "split_bytes", low=4096, optional=True)

    def backend_options(self) -> dict[str, Any]:
        """The keyword options of the built-in backends."""
        options: dict[str, Any] = {"fixed_buffers": self.fixed_buffers, "sqe_async": self.sqe_async}
        if self.n_threads is not None:
            options["n_threads"] = self.n_threads
        return options


@dataclass(frozen=True, slots=True, kw_only=True)
class PageCacheOptions:
    """The page-cache mode (``aioexperts.open(path, mode="pagecache")``): the kernel's page cache is
    the expert cache, views point into a read-only mapping of the model, prefetch warms the cache.

    Attributes:
        method: how to warm a range: ``"read"`` (worker threads ``pread`` it into a scratch buffer;
            a request waits until its experts are in the page cache), ``"advice"`` (one worker
            calls ``posix_fadvise(WILLNEED)``; the kernel reads ahead and the compute faults in
            what is not there yet), ``"parallel-advice"`` (the advice from every worker), ``"uring"``
            (buffered io_uring reads into a small scratch buffer, submitted and reaped on the event
            loop; where io_uring cannot be set up, ``"read"`` with one log line).
        n_threads: worker threads for ``read`` and ``parallel-advice`` (``advice`` uses one, ``uring``
            none: the ring reads; ``statistics().backend_features`` reports what runs).
        max_gap: ranges at most this many bytes apart are warmed as one (default 64 KiB).

    Raises:
        ConfigError: a value out of range or of the wrong type.
    """

    method: str = "read"
    n_threads: int = 4
    max_gap: int = DEFAULT_MAX_GAP

    def __post_init__(self) -> None:
        if self.method not in WARM_METHODS:
            raise ConfigError(f"method must be one of {', '.join(WARM_METHODS)}, got {self.method!r}")
        check_int(self, "n_threads", low=1, high=64)
        check_int(self, "max_gap", low=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class MissTier:
    """The low-precision miss tier (opt-in; issue 36): under a policy, an expert that is not resident
    is read from a sidecar GGUF holding it in a smaller ggml type (``aioexperts-tier`` writes it).

    A miss goes to the low tier when ``max_gate_weight`` is set and the expert's gate weight (its
    largest over the rows of the step) is below it, or when ``behind_seconds`` is set and the reads
    already queued or in flight would take longer than that at the device rate measured so far.
    With neither set, every miss goes low. With ``prefetches``, the same rules choose the tier of
    each prefetch (the experts predicted for the layers ahead): its gate weight is the predicted
    one where the predictor gives it (the ``"router"`` predictor does), else unknown, and then only
    the backlog rule (or no rule at all) sends it low. Hits always use what is resident. With
    ``upgrade``, a low-tier expert that is hit again is read again at full precision in the
    background, but only while the reads are not behind (see :meth:`reads_behind`; the upgrade
    waits for a later hit or release otherwise). Off by default: on the 48-layer bench model
    with a Q2_K tier the upgrades' reads cost more than the full copies gave (decode 1.16-1.28x
    the tier-less rate at 1/4 of the model in memory and 0.82-0.84x at 1/2 with them; 1.25-1.73x
    and 1.22x without; ``docs/miss-tier.md``). Without a ``miss_tier``, nothing of this runs and
    the numerics are the default path's.

    Attributes:
        path: the sidecar GGUF (refused if written for another model or an older version of it).
        max_gate_weight: gate weight below which a miss reads the low tier, a finite number >= 0
            (a routing weight is 0..1 when a token's weights sum to 1, up to the model's
            ``expert_weights_scale`` when it scales them; a value above every weight sends every
            demand miss low); None: no weight rule.
        behind_seconds: read backlog (seconds at the measured device rate) beyond which every
            miss reads the low tier; None: no backlog rule.
        upgrade: read a low-tier expert again at full precision once it is hit again (and the
            reads are not behind); default off.
        prefetches: the rules choose the tier of prefetches too, not only of a step's demand
            misses.
    """

    path: str
    max_gate_weight: float | None = None
    behind_seconds: float | None = None
    upgrade: bool = False
    prefetches: bool = True

    def __post_init__(self) -> None:
        import os

        if not isinstance(self.path, str | os.PathLike):
            raise ConfigError(f"MissTier.path must be a path, got {self.path!r}")
        object.__setattr__(self, "path", os.path.expanduser(os.fspath(self.path)))
        for name in ("max_gate_weight", "behind_seconds"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"MissTier.{name} must be a finite number >= 0 or None, got {value!r}")
            object.__setattr__(self, name, float(value))
        check_bool("MissTier.upgrade", self.upgrade)
        check_bool("MissTier.prefetches", self.prefetches)

    def goes_low(self, gate_weight: float | None, backlog_seconds: float | None) -> bool:
        """Whether a read of this gate weight (None: unknown, as for a prefetch without a predicted
        weight) goes to the low tier, the reads being ``backlog_seconds`` behind (None: not
        measured yet)."""
        if self.max_gate_weight is None and self.behind_seconds is None:
            return True
        if self.max_gate_weight is not None and gate_weight is not None and gate_weight < self.max_gate_weight:
            return True
        return self.behind_seconds is not None and backlog_seconds is not None and backlog_seconds > self.behind_seconds

    def reads_behind(self, pending_bytes: int, backlog_seconds: float | None) -> bool:
        """Whether the reads are behind, so that upgrades of low copies wait: ``pending_bytes``
        queued or in flight would take more than ``behind_seconds`` at the measured device rate
        (``backlog_seconds``); without a ``behind_seconds`` (or before a rate is measured), as soon
        as anything is queued or in flight (an upgrade then only uses an idle device)."""
        if pending_bytes <= 0:
            return False
        if self.behind_seconds is None or backlog_seconds is None:
            return True
        return backlog_seconds > self.behind_seconds
