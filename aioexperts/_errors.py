"""One exception tree for everything aioexperts raises on purpose.

``AioExpertsError`` is the root. Errors about bad input are also ``ValueError`` so that callers who
already catch that keep working; I/O failures keep the original ``OSError`` as ``__cause__``.
Following trio's vocabulary, a resource *you* closed raises :class:`StoreClosedError`, one that
something outside broke raises :class:`ExpertReadError`, one that is fully in use raises
:class:`SlabExhaustedError`.
"""

from __future__ import annotations

__all__ = (
    "AioExpertsError",
    "BackendUnavailableError",
    "ChatTemplateError",
    "ConfigError",
    "ContextLengthError",
    "StoreClosedError",
    "EvictionPolicyError",
    "ExpertReadError",
    "FormatError",
    "InvalidRequestError",
    "LayoutError",
    "MissingShardError",
    "NonFiniteError",
    "OptionalDependencyError",
    "PlacementError",
    "ShardError",
    "ShardTimeoutError",
    "SlabExhaustedError",
    "SlotTimeoutError",
    "StaleMapError",
    "TokenizerError",
    "UnsupportedTypeError",
    "VocabularyError",
)


class AioExpertsError(Exception):
    """Root of every error aioexperts raises on purpose."""


class FormatError(AioExpertsError, ValueError):
    """A model or map file is malformed: bad magic, truncated, an offset or size out of range."""


class MissingShardError(FormatError):
    """A shard of a split GGUF set is missing or does not belong to the set.

    Attributes:
        path: the shard file that was expected.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class LayoutError(FormatError):
    """The expert tensors break a rule of the expert layout (docs/notes/FORMATS.md sections 1 and 2)."""


class UnsupportedTypeError(FormatError):
    """A ggml type or architecture aioexperts cannot handle."""


class StaleMapError(FormatError):
    """A ``WEEPF001`` expert map or a miss-tier sidecar does not match the model it is used with;
    write it again.

    Attributes:
        recorded: the identity the map or sidecar records, ``{"sizes", "devs", "inos", "mtimes"}``
            -> one int per shard (bytes, ``st_dev``, ``st_ino``, ``st_mtime_ns``); None when the
            raiser does not give it.
        current: the model's identity now, in the same shape; None when not given.
    """

    def __init__(
        self,
        message: str,
        *,
        recorded: dict[str, list[int]] | None = None,
        current: dict[str, list[int]] | None = None,
    ) -> None:
        super().__init__(message)
        self.recorded = recorded
        self.current = current


class ConfigError(AioExpertsError, ValueError):
    """An argument is out of range or inconsistent (slot count, backend name, depth)."""


class InvalidRequestError(AioExpertsError, ValueError):
    """A request names a layer or expert that the model does not have; the store stays usable."""


class ContextLengthError(InvalidRequestError):
    """A prompt or a generation would pass the sequence's ``n_ctx`` positions; nothing was truncated."""


class NonFiniteError(AioExpertsError, ArithmeticError):
    """The forward pass produced NaN or inf (a broken model file, or activations beyond float32)."""


class BackendUnavailableError(AioExpertsError):
    """A backend that was asked for explicitly cannot run here (io_uring disabled, no O_DIRECT)."""


class ExpertReadError(AioExpertsError):
    """Reading an expert failed (an ``OSError``, a short read before end of file).

    The original error is attached as ``__cause__``. Every waiter of that expert gets the same
    exception; the slot is freed and the store stays usable.
    """


class StoreClosedError(AioExpertsError):
    """The store was closed by its owner (or was never started); no further requests are accepted."""


class SlabExhaustedError(AioExpertsError):
    """Every slot of the slab is pinned, so the request cannot be served: the slab is too small.

    Raise the slot count, request fewer experts at once, or ask to wait for a free slot.
    """


class SlotTimeoutError(SlabExhaustedError, TimeoutError):
    """No slot freed up within ``CacheOptions.slot_timeout`` seconds (a ``TimeoutError`` too)."""


class EvictionPolicyError(AioExpertsError):
    """A custom eviction policy raised in one of its hooks (``admit``, ``access``, ``remove``, ``victim``).

    The policy's exception is attached as ``__cause__``. The cache stays consistent and usable:
    the request that gets this error holds no pins, and no slot is lost (an entry the policy may
    have lost track of is evicted by the cache itself when its slot is needed).
    """


class TokenizerError(AioExpertsError, ValueError):
    """Text or token ids the tokenizer cannot take: text that is not a str or not UTF-8, an unknown token id.

    Also the base of :class:`VocabularyError`.
    """


class VocabularyError(TokenizerError, FormatError):
    """A GGUF's ``tokenizer.ggml.*`` keys describe a vocabulary the tokenizer cannot build.

    An unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` (named in the message), a missing key,
    arrays of mismatched lengths or wrong types, duplicate tokens, merges that name unknown tokens,
    special-token ids out of range.
    """


class ChatTemplateError(AioExpertsError, ValueError):
    """A chat template does not compile or failed while rendering (its ``raise_exception`` message, a
    sandbox refusal), or a model file has no chat template."""


class OptionalDependencyError(AioExpertsError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra to install."""


# -- expert shards (aioexperts.distributed) ---------------------------------------------------------


class PlacementError(ConfigError):
    """An expert placement does not fit the model it is used with (MoE layers, experts per layer,
    ``n_embd``) or the shards it is given (their number, or a shard opened with another placement)."""


class ShardError(ExpertReadError):
    """A remote expert shard could not answer a call: its actor died, is unreachable or failed.

    The Ray error is attached as ``__cause__``. The waiting tokens get this error; the runner stays
    usable, and a shard that Ray restarts (``max_restarts``) serves the next call.

    Attributes:
        shard: the index of the shard in the placement.
    """

    def __init__(self, message: str, shard: int) -> None:
        super().__init__(message)
        self.shard = shard


class ShardTimeoutError(ShardError, TimeoutError):
    """A shard did not answer within the runner's ``call_timeout`` seconds (a ``TimeoutError`` too)."""
