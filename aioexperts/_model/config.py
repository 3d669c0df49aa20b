"""The options of a whole model, decided once when :func:`aioexperts.load` is called.

:class:`LoadOptions` checks every option of :func:`aioexperts.load` that is not the store's (those
go to :func:`aioexperts.open`), and :meth:`LoadOptions.apply_to` puts the runner's options on
whatever runner the model runs on, the default one or one a ``runner=`` factory made: an option the
runner cannot honour is an error, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioexperts._batch import DEFAULT_BATCH_WAIT, check_batch_wait
from aioexperts._compute.fused import Precision
from aioexperts._errors import ConfigError
from aioexperts._model.kvcache import KV_TYPES, KVType
from aioexperts._router import PrefetchOptions
from aioexperts._runner import MoERunner

__all__ = ("DEFAULT_RESIDENT_EMBEDDING_BYTES", "LoadOptions")

DEFAULT_RESIDENT_EMBEDDING_BYTES = 256 << 20
"""A token embedding table larger than this (with a separate output head) is read row by row
through :meth:`ExpertStore.read_rows` instead of being kept in memory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """The model's own options (see :func:`aioexperts.load` for each).

    Attributes:
        n_ctx: positions of each sequence's KV cache, or None (the file's context length, capped
            by ``memory_budget`` and the memory limit, when the model starts).
        memory_budget: bytes one sequence's KV cache may take, or None.
        prefetch: the runner's prefetch options, or None (the runner's default).
        resident_embedding_bytes: the largest token embedding table kept in memory (bytes, >= 0).
        batch_wait: seconds of cross-request batching (0: off).
        hits_first: compute a layer's resident experts while its other experts are read.
        record_trace: record every routing decision.
        kv_type: the KV cache's element type, ``"f16"`` (llama.cpp's default) or ``"f32"``.
        precision: the products' arithmetic for this process, ``"int8"`` (llama.cpp's) or
            ``"float"`` (:func:`aioexperts._compute.fused.set_precision`), or None: as it is
            (``$AIOEXPERTS_PRECISION``, default ``"int8"``).

    Raises:
        ConfigError: an option of the wrong type or out of range.
    """

    n_ctx: int | None = None
    memory_budget: int | None = None
    prefetch: PrefetchOptions | None = None
    resident_embedding_bytes: int = DEFAULT_RESIDENT_EMBEDDING_BYTES
    batch_wait: float = DEFAULT_BATCH_WAIT
    hits_first: bool = True
    record_trace: bool = False
    kv_type: KVType = "f16"
    precision: Precision | None = None

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"kv_type must be one of {sorted(KV_TYPES)}, got {self.kv_type!r}")
        if self.precision not in (None, "int8", "float"):
            raise ConfigError(f"precision must be 'int8', 'float' or None, got {self.precision!r}")
        n_ctx = self.n_ctx
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise ConfigError(f"n_ctx must be an int >= 1, got {n_ctx!r}")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"memory_budget must be a number of bytes >= 1, got {budget!r}")
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchOptions):
            raise ConfigError(f"prefetch must be a PrefetchOptions, got {self.prefetch!r}")
        embedding = self.resident_embedding_bytes
        if isinstance(embedding, bool) or not isinstance(embedding, int) or embedding < 0:
            raise ConfigError(f"resident_embedding_bytes must be an int >= 0, got {embedding!r}")
        object.__setattr__(self, "batch_wait", check_batch_wait(self.batch_wait))  # None -> 0
        for name in ("hits_first", "record_trace"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def apply_to(self, runner: MoERunner) -> None:
        """Put the runner's options on ``runner`` (before its warm-up).

        Raises:
            ConfigError: ``runner`` is not a :class:`~aioexperts.MoERunner`, or it was made with
                other prefetch options than these (a factory that dropped them).
        """
        if not isinstance(runner, MoERunner):
            raise ConfigError(f"runner must return a MoERunner (or a subclass), got {runner!r}")
        if self.prefetch is not None and runner.prefetch_options != self.prefetch:
            raise ConfigError(
                f"load(prefetch={self.prefetch!r}): the runner factory made a runner with "
                f"{runner.prefetch_options!r}; pass the prefetch options it is given on to the runner"
            )
        runner.batch_wait = self.batch_wait
        runner.hits_first = self.hits_first
        runner.record_trace = self.record_trace or runner.record_trace
