"""Products with quantized matrices: which kernel runs for a ggml type, a batch size and a backend.

:func:`linear` computes ``out = x @ W.T`` for a weight matrix ``W`` given as raw ggml bytes (a
zero-copy view of slot memory) and a float32 batch ``x``:

===========================  ============================================================================
tokens ``n``                 kernel (numba backend)
===========================  ============================================================================
``n <= ROWS_MAX_TOKENS``     ``matrows_<type>`` for the types of :func:`rows_types` (Q4_K, Q8_0): each block
                             decoded once for up to 3 tokens, each token's row bit for bit its one-token
                             result (:mod:`aioexperts._compute.kernels.rows`)
``n <= MATVEC_MAX_TOKENS``   ``matvec_<type>`` per token: each block is decoded in registers and dotted with
                             ``x`` (the float32 weights never exist)
up to ``SMALL_BATCH_MAX``    ``matmat_<type>``: a few rows decoded once into a small buffer, then a blocked
                             product with every token
larger (prefill)             ``dequant_<type>`` (exact) into a per-thread buffer, then BLAS ``sgemm``
===========================  ============================================================================

F32 matrices are multiplied by BLAS on a zero-copy view of their bytes (``sgemv``/``sgemm``, faster
than a compiled loop; the compute pool keeps BLAS to one thread per call). Types without a compiled
kernel (IQ1/IQ2/IQ3, TQ, ...) and the ``numpy`` backend take the last row with
:func:`aioexperts._format.dequant.dequantize`. The float kernels agree with a float64 product
within about 1e-6 relative (their reductions are reassociated); the exact dequantization is bit for
bit ``gguf.quants.dequantize``. :func:`linear_rows` is the batch-invariant product: each row of ``x``
bit for bit what it gets alone (cross-request batching uses it). Exact dequantization has one entry,
:func:`aioexperts._format.dequant.dequantize` (the store's row views use it too); importing this module
plugs the compiled ``dequant_<type>`` kernels into it.

With ``"int8"`` precision, batches of at least :data:`TILED_MIN_TOKENS` tokens of the types of
:func:`tiled_types` (Q4_K, Q5_K, Q6_K where the CPU has AVX-512 VNNI) take the tiled kernels of
:mod:`aioexperts._compute.kernels.tiles` (16 tokens per vector, one ``vpdpbusd`` per 4 values of
each): llama.cpp's integer sums, float32 sums in another order, not bit-equal to each token alone,
so :func:`linear_rows` never takes them.

Precision (:func:`set_precision`, ``$AIOEXPERTS_PRECISION``, ``load(precision=...)``): ``"int8"``
(the default) is llama.cpp's arithmetic: every product's ``x`` is converted to the weight type's
``vec_dot_type`` with ggml's rounding (Q8_K, Q8_0, Q8_1, F16, BF16; F32 unchanged: see
:mod:`aioexperts._compute.activations`), whatever the number of tokens. The one-token kernels of the
types of :func:`int8_types` quantize ``x`` themselves and take integer dot products
(``ggml_vec_dot_*_q8_*``); for the types of :func:`int8_batched_types` (Q4_0, Q5_0, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4: whole-row AVX2 loops, see :mod:`aioexperts._compute.kernels.rowdot`
and :mod:`aioexperts._compute.kernels.rowdot_legacy`) batches of
2 to :data:`INT8_BATCH_MAX` tokens run one ``matmat_int8_<type>`` call that reads each weight row
once for every token, each token's row bit for bit what the one-token kernel gives it. Every other
call (larger batches, other types, the numpy backend) runs the float kernels on the round trip of
``x`` through its vec_dot_type: llama.cpp's integer products to float32 rounding (Q4_1/Q5_1 add the
block-sum term of Q8_1). The products then differ from a float64 product of the unrounded ``x`` by
about 5e-3 relative, as llama.cpp's do, and agree with llama.cpp's logits to about 1e-2 (the
fixtures). ``"float"`` multiplies the float32 ``x`` as it is (about 1e-6 from float64), which is
further from llama.cpp: near-tie routing decisions and swiglu_oai's clamps turn the missing rounding
into up to 0.18 relative at some positions of the llama.cpp-made fixtures.

Backend: ``numba`` when it imports (see :mod:`aioexperts._compute.jit`), else ``numpy``, with one
log line saying why; a kernel that fails to compile also switches the process to ``numpy`` (one log
line). :func:`set_backend` forces either (tests, benchmarks).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from .._errors import ConfigError, FormatError, UnsupportedTypeError
from .._format import dequant as _quant
from .activations import q8_1_sum_error, quantized_round_trip
from .jit import jit_status

__all__ = (
    "INT8_BATCH_MAX",
    "MATVEC_MAX_TOKENS",
    "ROWS_MAX_TOKENS",
    "PRECISION_ENV",
    "SMALL_BATCH_MAX",
    "TILED_MIN_TOKENS",
    "KernelBackend",
    "WarmupReport",
    "backend",
    "compiled_types",
    "flash_kernel",
    "int8_batched_types",
    "int8_types",
    "linear",
    "linear_rows",
    "one_token_int8_kernel",
    "rows_types",
    "precision",
    "ready_kernels",
    "set_backend",
    "set_precision",
    "tiled_types",
    "warmup",
)

log = logging.getLogger("aioexperts")

T = GGMLQuantizationType

#: batches up to this many tokens run the fused matrix-vector kernel once per token
MATVEC_MAX_TOKENS = 2
#: batches up to this many tokens run the blocked small-batch kernel; larger ones dequantize + BLAS
SMALL_BATCH_MAX = 64
#: with ``"int8"`` precision, batches up to this many tokens run ``matmat_int8_<type>`` (types of
#: :func:`int8_batched_types`): each weight row read once for every token, each token's result bit
#: for bit its one-token result, which is ggml's ``vec_dot`` arithmetic (a prefill's experts: about
#: 16 tokens each at 256 tokens, top-8 of 128). Up to 64 the int8 kernel is faster than the float
#: kernels on the rounded ``x`` for the k-quants (Q4_K 768x2048: 88 against 120-170 ns per row and
#: token, one thread, AMD EPYC AVX2) and within 10 % for Q8_0
INT8_BATCH_MAX = SMALL_BATCH_MAX
#: one-token (and int8 small-batch) products of at least this many weight bytes are split by rows
#: over the compute pool's idle workers, when a pool exists (:func:`_split_rows`); None: never. On a
#: quiet 2-vCPU AMD EPYC the 48-layer decode ran 1.121x (1.045-1.121) faster with the split at 1 MiB
#: (bench/ab_decode.py, docs/results/ab_decode-48l-split.json); a busy pool runs every range inline,
#: so concurrent sequences do not oversubscribe (on a machine at load average 9 the split measured
#: 0.63-0.76x of one thread, docs/results/matvec-rows-after.json)
SPLIT_MIN_BYTES: int | None = 1 << 20
#: with ``"float"`` precision, batches up to this many tokens of the types of :func:`rows_types` run
#: ``matrows_<type>`` (one token included): each token's row bit for bit its one-token result
ROWS_MAX_TOKENS = 16
PRECISION_ENV = "AIOEXPERTS_PRECISION"
#: with ``"int8"`` precision, :func:`linear` multiplies batches of at least this many tokens of the
#: types of :func:`tiled_types` with the tiled kernels (:mod:`aioexperts._compute.kernels.tiles`):
#: llama.cpp's integer sums, float32 sums in another order (not bit-equal to each token alone;
#: :func:`linear_rows` never takes them). At 16 tokens an expert's product ran 2.0-2.2x (Q4_K),
#: 2.1-2.3x (Q5_K) and 2.6-3.0x (Q6_K) faster than the exact loops (Intel Xeon, AVX-512 VNNI); a
#: tile costs about as much from 1 to 16 tokens, so fewer than 8 (alone, or left after whole tiles)
#: take the exact loops.
TILED_MIN_TOKENS = 8

BackendName = Literal["numba", "numpy"]
Precision = Literal["float", "int8"]
KernelKind = Literal["matvec", "matmat", "dequant", "matvec_int8", "matmat_int8", "matrows"]
KERNEL_KINDS: tuple[KernelKind, ...] = ("matvec", "matmat", "dequant", "matrows")

_F32 = np.dtype(np.float32)


@dataclass(frozen=True, slots=True)
class _Entry:
    module: str
    suffix: str
    #: dtype the raw bytes are viewed as: uint8 blocks, or uint16 elements (F16, BF16)
    raw_dtype: type[np.generic]
    #: module of the int8 one-token kernel ``matvec_int8_<suffix>``, if there is one
    int8_module: str | None = None
    #: whether that module has the int8 small-batch kernel ``matmat_int8_<suffix>`` too
    int8_batched: bool = False
    #: module of the batch-invariant float kernel ``matrows_<suffix>``, if there is one
    rows_module: str | None = None


_TABLE: dict[GGMLQuantizationType, _Entry] = {
    T.F16: _Entry("floats", "f16", np.uint16),
    T.BF16: _Entry("floats", "bf16", np.uint16),
    T.Q4_0: _Entry("legacy", "q4_0", np.uint8, "int8", int8_batched=True),
    T.Q4_1: _Entry("legacy", "q4_1", np.uint8, "int8"),
    T.Q5_0: _Entry("legacy", "q5_0", np.uint8, "int8", int8_batched=True),
    T.Q5_1: _Entry("legacy", "q5_1", np.uint8, "int8"),
    T.Q8_0: _Entry("legacy", "q8_0", np.uint8, "int8", int8_batched=True, rows_module="rows"),
    T.Q2_K: _Entry("kquants", "q2_k", np.uint8, "int8", int8_batched=True),
    T.Q3_K: _Entry("kquants", "q3_k", np.uint8, "int8", int8_batched=True),
    T.Q4_K: _Entry("kquants", "q4_k", np.uint8, "int8", int8_batched=True, rows_module="rows"),
    T.Q5_K: _Entry("kquants", "q5_k", np.uint8, "int8", int8_batched=True),
    T.Q6_K: _Entry("kquants", "q6_k", np.uint8, "int8", int8_batched=True),
    T.IQ4_NL: _Entry("codebook", "iq4_nl", np.uint8, "int8"),
    T.IQ4_XS: _Entry("codebook", "iq4_xs", np.uint8, "int8", int8_batched=True),
    T.MXFP4: _Entry("codebook", "mxfp4", np.uint8, "int8", int8_batched=True),
}


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """Which kernels serve :func:`linear` and :func:`aioexperts._format.dequant.dequantize`.

    Attributes:
        name: ``"numba"`` (compiled kernels) or ``"numpy"`` (:mod:`aioexperts._format.dequant` + BLAS).
        reason: why ``numpy`` serves (numba missing, a compile failure, forced), else None.
        cache_dir: the on-disk kernel cache, or None (no numba, or not writable).
    """

    name: BackendName
    reason: str | None
    cache_dir: Path | None


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What :func:`warmup` did.

    Attributes:
        backend: the backend after the warm-up (a compile failure switches it to ``numpy``).
        types: the ggml types asked for, by name, sorted.
        kernels: compiled kernels now ready, e.g. ``"matvec_q4_k"``.
        loaded: kernels loaded from the on-disk cache by this call.
        compiled: kernels compiled by this call (cold cache).
        seconds: wall time of the call.
        cache_dir: where the kernels are cached, or None.
    """

    backend: KernelBackend
    types: tuple[str, ...]
    kernels: tuple[str, ...]
    loaded: int
    compiled: int
    seconds: float
    cache_dir: Path | None


# ----------------------------------------------------------------------------------------------
# backend state


class _Ready:
    """The compiled dispatchers of one type (a plain record; ``None`` where not compiled yet)."""

    __slots__ = ("dequant", "entry", "matmat", "matmat_int8", "matrows", "matvec", "matvec_int8", "row_bytes")

    def __init__(self, entry: _Entry, row_bytes: Callable[[int], int]) -> None:
        self.entry = entry
        self.row_bytes = row_bytes
        self.matvec: Callable[..., Any] | None = None
        self.matmat: Callable[..., Any] | None = None
        self.dequant: Callable[..., Any] | None = None
        self.matvec_int8: Callable[..., Any] | None = None
        self.matmat_int8: Callable[..., Any] | None = None
        self.matrows: Callable[..., Any] | None = None


class _State:
    """The process-wide backend choice, the loaded kernel modules and the compiled kernels."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.forced: BackendName | None = None
        self.failure: str | None = None
        self.modules: dict[str, ModuleType] | None = None
        self.load_error: str | None = None
        self.logged: set[str] = set()
        self.precision: Precision | None = None
        #: ggml type -> compiled kernels, only while numba serves (cleared on any backend change)
        self.ready: dict[GGMLQuantizationType, _Ready] = {}
        #: (module, name) -> a kernel :func:`compiled_kernel` found (cleared on any backend change)
        self.kernels: dict[tuple[str, str], Callable[..., Any]] = {}


_state = _State()


def _log_once(key: str, level: int, message: str, *args: object) -> None:
    with _state.lock:
        if key in _state.logged:
            return
        _state.logged.add(key)
    log.log(level, message, *args)


def set_backend(name: BackendName | None) -> None:
    """Force the ``"numba"`` or ``"numpy"`` kernels for this process, or None to choose again.

    Forcing ``"numba"`` where numba cannot serve still gives ``numpy`` (see :func:`backend`).

    Raises:
        ConfigError: ``name`` is not one of the three values.
    """
    if name not in (None, "numba", "numpy"):
        raise ConfigError(f"kernel backend must be 'numba', 'numpy' or None, got {name!r}")
    with _state.lock:
        _state.forced = name
        if name is None:
            _state.failure = None
        _state.ready = {}
        _state.kernels = {}


def precision() -> Precision:
    """The arithmetic of the products: ``"int8"`` (default: llama.cpp's) or ``"float"`` (module docstring).

    Raises:
        ConfigError: ``$AIOEXPERTS_PRECISION`` is set to something else.
    """
    if _state.precision is None:
        value = os.environ.get(PRECISION_ENV, "int8").strip().lower() or "int8"
        if value not in ("float", "int8"):
            raise ConfigError(f"{PRECISION_ENV} must be 'float' or 'int8', got {value!r}")
        _state.precision = value  # type: ignore[assignment]
    assert _state.precision is not None
    return _state.precision


def set_precision(value: Precision | None) -> None:
    """Choose the arithmetic of the products for this process (None: from the environment).

    ``"int8"`` rounds ``x`` as llama.cpp does (module docstring); ``"float"`` keeps it float32.

    Raises:
        ConfigError: ``value`` is not ``"float"``, ``"int8"`` or None.
    """
    if value not in (None, "float", "int8"):
        raise ConfigError(f"precision must be 'float', 'int8' or None, got {value!r}")
    _state.precision = value


def _modules() -> dict[str, ModuleType] | None:
    """Import the kernel modules once; None (with ``_state.load_error``) if numba cannot serve."""
    with _state.lock:
        if _state.modules is not None or _state.load_error is not None:
            return _state.modules
        status = jit_status()
        if not status.available:
            _state.load_error = status.reason
            return None
        names = {e.module for e in _TABLE.values()} | {
            m for e in _TABLE.values() for m in (e.int8_module, e.rows_module) if m
        }
        try:
            _state.modules = {name: importlib.import_module(f"{__package__}.kernels.{name}") for name in sorted(names)}
        except Exception as exc:  # a broken numba/llvmlite can raise anything at import
            _state.load_error = f"the kernel modules cannot be imported ({type(exc).__name__}: {exc})"
        if _state.load_error is None and status.cache_reason is not None:
            _log_once("nocache", logging.WARNING, "%s; kernels are compiled in every process", status.cache_reason)
        return _state.modules


def backend() -> KernelBackend:
    """The backend that serves now (decided on first call, then cached; cheap).

    Returns:
        A :class:`KernelBackend`. When ``numpy`` serves because of numba (missing, broken, failed
        to compile), the reason is logged once at WARNING level; a forced ``numpy`` is not logged.
    """
    with _state.lock:
        forced, failure = _state.forced, _state.failure
    if forced == "numpy":
        return KernelBackend("numpy", "forced by set_backend('numpy')", None)
    if failure is not None:
        return KernelBackend("numpy", failure, None)
    if _modules() is None:
        reason = _state.load_error or "numba is unavailable"
        if not reason.endswith("=numpy"):
            _log_once("fallback", logging.WARNING, "numpy kernels serve: %s", reason)
        return KernelBackend("numpy", reason, None)
    return KernelBackend("numba", None, jit_status().cache_dir)


def compiled_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types that have numba kernels (whatever the backend serving now)."""
    return frozenset(_TABLE)


def int8_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types whose one-token kernel has an int8 variant (``set_precision("int8")``)."""
    return frozenset(t for t, e in _TABLE.items() if e.int8_module)


def rows_types() -> frozenset[GGMLQuantizationType]:
    """Types whose float products of up to :data:`ROWS_MAX_TOKENS` tokens run ``matrows_<type>``
    (one kernel for 1..16 tokens, each token's row independent of the others; numba backend)."""
    return frozenset(t for t, e in _TABLE.items() if e.rows_module)


def int8_batched_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types whose int8 kernels also take up to :data:`INT8_BATCH_MAX` tokens at once."""
    return frozenset(t for t, e in _TABLE.items() if e.int8_batched)


def _fail(exc: BaseException, what: str) -> None:
    reason = f"compiling {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    with _state.lock:
        if _state.failure is None:
            _state.failure = reason
        _state.ready = {}
        _state.kernels = {}
    _log_once("failure", logging.WARNING, "numpy kernels serve from now on: %s", reason)


def _is_numba_error(exc: BaseException) -> bool:
    try:
        from numba.core.errors import NumbaError
    except Exception:  # pragma: no cover - numba vanished after loading
        return False
    return isinstance(exc, NumbaError) or type(exc).__module__.startswith(("numba", "llvmlite"))


# ----------------------------------------------------------------------------------------------
# compiled kernels, ready to call


def _signature(kind: KernelKind, entry: _Entry) -> tuple[Any, ...]:
    """The numba argument types every call of ``kind`` uses (read-only inputs, C-contiguous)."""
    from numba import from_dtype, types

    raw = types.Array(from_dtype(np.dtype(entry.raw_dtype)), 2, "C", readonly=True)
    if kind in ("matvec", "matvec_int8"):
        return (raw, types.Array(types.float32, 1, "C", readonly=True), types.Array(types.float32, 1, "C"))
    if kind in ("matmat", "matmat_int8", "matrows"):
        return (raw, types.Array(types.float32, 2, "C", readonly=True), types.Array(types.float32, 2, "C"))
    return (raw, types.Array(types.float32, 2, "C"))


def _dispatcher(entry: _Entry, kind: KernelKind) -> Any:
    modules = _modules()
    assert modules is not None
    if kind in ("matvec_int8", "matmat_int8"):
        assert entry.int8_module is not None
        return getattr(modules[entry.int8_module], f"{kind}_{entry.suffix}")
    if kind == "matrows":
        assert entry.rows_module is not None
        return getattr(modules[entry.rows_module], f"{kind}_{entry.suffix}")
    return getattr(modules[entry.module], f"{kind}_{entry.suffix}")


def _compile(qtype: GGMLQuantizationType, kind: KernelKind) -> tuple[Callable[..., Any], int, int]:
    """Compile (or load from the cache) one kernel; ``(dispatcher, loaded, compiled)``."""
    entry = _TABLE[qtype]
    fn = _dispatcher(entry, kind)
    stats = fn.stats
    hits, misses = sum(stats.cache_hits.values()), sum(stats.cache_misses.values())
    fn.compile(_signature(kind, entry))
    stats = fn.stats
    return fn, sum(stats.cache_hits.values()) - hits, sum(stats.cache_misses.values()) - misses


def _ready(qtype: GGMLQuantizationType) -> _Ready | None:
    """The compiled-kernel record of ``qtype`` when numba serves it, else None (cheap when warm)."""
    ready = _state.ready.get(qtype)
    if ready is not None:
        return ready
    if qtype not in _TABLE or backend().name != "numba":
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    record = _Ready(_TABLE[qtype], lambda cols: cols // block_size * type_size)
    with _state.lock:
        return _state.ready.setdefault(qtype, record)


def _kernel(ready: _Ready, qtype: GGMLQuantizationType, kind: KernelKind) -> Callable[..., Any]:
    fn: Callable[..., Any] | None = getattr(ready, kind)
    if fn is None:
        fn, _, _ = _compile(qtype, kind)
        setattr(ready, kind, fn)
    return fn


def one_token_int8_kernel(
    ggml_type: GGMLQuantizationType | int,
) -> tuple[Callable[..., bool], Callable[[int], int]] | None:
    """The compiled one-token int8 product of ``ggml_type`` that :func:`linear` runs for one token,
    and the type's bytes per row for a number of columns; None unless the precision is ``"int8"``,
    numba serves and the type has that kernel.

    The kernel is ``kernel(raw, x, out) -> bool``: ``raw`` the ``(rows, row_bytes)`` uint8 bytes,
    ``x`` ``(cols,)`` and ``out`` ``(rows,)`` float32; False (nothing meaningful written) when ``x``
    is not finite.
    """
    if precision() != "int8":
        return None
    qtype = _qtype(ggml_type)
    ready = _ready(qtype)
    if ready is None or ready.entry.int8_module is None:
        return None
    return _kernel(ready, qtype, "matvec_int8"), ready.row_bytes


# ----------------------------------------------------------------------------------------------
# argument handling


def _qtype(ggml_type: GGMLQuantizationType | int) -> GGMLQuantizationType:
    if type(ggml_type) is GGMLQuantizationType:
        return ggml_type
    try:
        return GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UnsupportedTypeError(f"unknown ggml type {ggml_type!r}") from None


def _readonly(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _raw_matrix(
    data: memoryview | np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int, ready: _Ready
) -> np.ndarray:
    """The bytes of a ``(rows, cols)`` tensor as a read-only C-contiguous 2-D array for the kernels.

    Raises:
        FormatError: the byte count does not match the shape, or the data is not contiguous.
    """
    block_size = GGML_QUANT_SIZES[qtype][0]
    if cols % block_size:
        raise FormatError(
            f"{qtype.name} matrix of shape {(rows, cols)}: {cols} columns is not a multiple of {block_size}"
        )
    row_bytes = ready.row_bytes(cols)
    raw = _quant.tensor_bytes(data)
    if raw.size != rows * row_bytes:
        raise FormatError(f"{qtype.name} matrix of shape {(rows, cols)} needs {rows * row_bytes} bytes, got {raw.size}")
    return _kernel_view(raw, rows, ready)


def _kernel_view(raw: np.ndarray, rows: int, ready: _Ready) -> np.ndarray:
    """Checked uint8 bytes as the kernels read them: ``rows`` rows of the type's raw dtype, read-only."""
    dtype = ready.entry.raw_dtype
    if dtype is not np.uint8:
        if raw.ctypes.data % np.dtype(dtype).itemsize:
            raw = raw.copy()  # F16/BF16 elements must be aligned for the kernels
        raw = raw.view(dtype)
    return _readonly(raw.reshape(rows, -1))


def _check_x(x: np.ndarray, cols: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != _F32 or x.ndim != 2 or x.shape[1] != cols:
        got = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ConfigError(f"x must be a float32 array of shape (n_tokens, {cols}), got {got}")
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return _readonly(x)


def _check_out(out: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=np.float32)
    _quant.check_out(out, shape)
    return out


class _Workspace(threading.local):
    """Per-thread grow-only float32 buffer for dequantized matrices (the prefill path)."""

    def __init__(self) -> None:
        self.flat = np.empty(0, dtype=np.float32)

    def matrix(self, shape: tuple[int, int]) -> np.ndarray:
        size = shape[0] * shape[1]
        if self.flat.size < size:
            self.flat = np.empty(size, dtype=np.float32)
        return self.flat[:size].reshape(shape)


_workspace = _Workspace()


# ----------------------------------------------------------------------------------------------
# the entry point (exact dequantization: aioexperts._format.dequant.dequantize, compiled below)


def linear(
    data: memoryview | np.ndarray,
    ggml_type: GGMLQuantizationType | int,
    shape: tuple[int, int],
    x: np.ndarray,
    *,
    out: np.ndarray | None = None,
    split: bool = True,
) -> np.ndarray:
    """``x @ W.T`` for the matrix ``W`` of ``shape`` stored as raw ggml bytes.

    Llama.cpp's ``ggml_mul_mat(W, x)``; the kernel is chosen by the number of tokens (module
    docstring). Thread-safe; releases the GIL inside the compiled kernels.

    Args:
        data: the matrix bytes in ggml block layout: a ``memoryview`` (e.g. of slot memory) or a
            C-contiguous array; never copied (except F16/BF16 bytes at an unaligned address).
        ggml_type: the ggml type of the bytes.
        shape: ``(rows, cols)`` in numpy order (ggml ``(ne1, ne0)``); ``cols`` a multiple of the
            block size.
        x: ``(n_tokens, cols)`` float32.
        out: optional ``(n_tokens, rows)`` float32 C-contiguous array to write into. It may be
            ``x`` itself (or overlap ``x`` or ``data``): the product is then computed apart and
            copied in.
        split: whether a product of at least :data:`SPLIT_MIN_BYTES` may split its rows over the
            compute pool (False: run on the calling thread, for a caller that splits the rows
            itself; the same numbers either way).

    Returns:
        ``(n_tokens, rows)`` float32: ``out`` if given, else a new array.

    Raises:
        FormatError: the byte count does not fit ``shape`` and the type.
        UnsupportedTypeError: the type can be dequantized neither here nor by gguf-py.
        ConfigError: ``x`` or ``out`` has the wrong dtype, shape or layout.
    """
    return _linear(data, ggml_type, shape, x, out, split, tiled=True)


def _linear(
    data: memoryview | np.ndarray,
    ggml_type: GGMLQuantizationType | int,
    shape: tuple[int, int],
    x: np.ndarray,
    out: np.ndarray | None,
    split: bool,
    tiled: bool,
) -> np.ndarray:
    """:func:`linear`; ``tiled``: batches of :data:`TILED_MIN_TOKENS` or more may take the tiled
    kernels (not batch-invariant: :func:`linear_rows` passes False)."""
    qtype, rows, cols, xs, result = _arguments(ggml_type, shape, x, out)
    n = xs.shape[0]
    if n == 0 or rows == 0:
        return result
    ready = _ready(qtype)
    # the bytes the compiled kernels read (checked; a copy only for misaligned F16/BF16), else all of data
    raw = _raw_matrix(data, qtype, rows, cols, ready) if ready is not None else None
    if out is not None and (
        np.may_share_memory(result, xs) or np.may_share_memory(result, raw if raw is not None else np.asarray(data))
    ):
        # the kernels read x (and W) while they write out: an alias would read rows already written
        result[...] = _linear(data, qtype, (rows, cols), xs, None, split, tiled)
        return result
    if ready is not None and raw is not None:
        try:
            _linear_numba(qtype, ready, raw, xs, result, split, tiled)
            return result
        except Exception as exc:
            if not _is_numba_error(exc):
                raise
            _fail(exc, f"the {qtype.name} kernels")
    weights = _quant.dequantize(data, qtype, (rows, cols))
    _matmul_numpy(data, qtype, rows, weights, xs, result)
    return result


def _matmul_numpy(
    data: memoryview | np.ndarray,
    qtype: GGMLQuantizationType,
    rows: int,
    weights: np.ndarray,
    xs: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out = xs @ weights.T`` (dequantized ``weights``), with llama.cpp's rounding of ``xs`` under
    the ``"int8"`` precision (:func:`_llama_activations`, :func:`_add_q8_1_sums`)."""
    if precision() == "int8":
        ys = _llama_activations(xs, qtype)
        np.matmul(ys, weights.T, out=out)
        _add_q8_1_sums(data, qtype, rows, xs, out)
    else:
        np.matmul(xs, weights.T, out=out)


def _llama_activations(xs: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``xs`` rounded to ``qtype``'s vec_dot_type and back (:mod:`aioexperts._compute.activations`),
    read-only C-contiguous float32."""
    return _readonly(np.ascontiguousarray(quantized_round_trip(xs, qtype), dtype=np.float32))


def _add_q8_1_sums(
    data: memoryview | np.ndarray, qtype: GGMLQuantizationType, rows: int, xs: np.ndarray, out: np.ndarray
) -> None:
    """For Q4_1 / Q5_1 weights, add ``m * (s - fp16(d) * sum(q))`` per block: the part of
    ``ggml_vec_dot_q4_1_q8_1`` (``q5_1``) that a product with the round trip of ``xs`` leaves out."""
    if qtype not in (T.Q4_1, T.Q5_1):
        return
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = _quant.tensor_bytes(data).reshape(rows, -1, block_bytes)
    mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
    out += q8_1_sum_error(xs) @ mins.T


def _arguments(
    ggml_type: GGMLQuantizationType | int, shape: tuple[int, int], x: np.ndarray, out: np.ndarray | None
) -> tuple[GGMLQuantizationType, int, int, np.ndarray, np.ndarray]:
    """The checked arguments of :func:`linear` and :func:`linear_rows`: ``(type, rows, cols, x, out)``."""
    qtype = _qtype(ggml_type)
    rows, cols = int(shape[0]), int(shape[1])
    xs = _check_x(x, cols)
    return qtype, rows, cols, xs, _check_out(out, (xs.shape[0], rows))


def _invariant_rows(ready: _Ready) -> int:
    """Tokens one :func:`linear` call of ``ready``'s type takes with each token's row equal to its
    one-token result (1: only one at a time is)."""
    if precision() == "int8":
        return INT8_BATCH_MAX if ready.entry.int8_module is not None and ready.entry.int8_batched else 1
    return ROWS_MAX_TOKENS if ready.entry.rows_module is not None else MATVEC_MAX_TOKENS


def linear_rows(
    data: memoryview | np.ndarray,
    ggml_type: GGMLQuantizationType | int,
    shape: tuple[int, int],
    x: np.ndarray,
    *,
    out: np.ndarray | None = None,
    split: bool = True,
) -> np.ndarray:
    """:func:`linear` with each row of ``x`` bit for bit what it gets alone (batch-invariant).

    Cross-request batching computes the rows of several sequences in one call; this keeps every
    sequence's numbers those of a one-token call (``linear(data, type, shape, x[i:i+1])``), whatever
    the other rows. Rows go in calls of as many as the kernel keeps invariant: up to
    :data:`ROWS_MAX_TOKENS` for :func:`rows_types` (float), :data:`INT8_BATCH_MAX` for
    :func:`int8_batched_types` (int8), else :data:`MATVEC_MAX_TOKENS` (per-token kernels); the numpy
    backend dequantizes once and multiplies row by row.

    Args and Returns: as :func:`linear`. Raises: as :func:`linear`.
    """
    qtype, rows, cols, xs, result = _arguments(ggml_type, shape, x, out)
    n = xs.shape[0]
    if n == 0 or rows == 0:
        return result
    ready = _ready(qtype)
    if ready is None:  # numpy serves: dequantize once, then linear()'s numpy path row by row
        weights = _quant.dequantize(data, qtype, (rows, cols))
        for i in range(n):
            _matmul_numpy(data, qtype, rows, weights, xs[i : i + 1], result[i : i + 1])
        return result
    step = _invariant_rows(ready)
    for i in range(0, n, step):
        result[i : i + step] = _linear(data, qtype, (rows, cols), xs[i : i + step], None, split, tiled=False)
    return result


def _split_pool(raw: np.ndarray, split: bool) -> Any:
    """The compute pool that :func:`_split_rows` splits ``raw``'s rows over, or None (one range)."""
    limit = SPLIT_MIN_BYTES
    if not split or limit is None or raw.nbytes < limit:
        return None
    from . import pool as _pool_module

    pool = _pool_module._current_pool()
    if pool is None or pool.n_threads <= 1 or raw.shape[0] < 2 * pool.n_threads:
        return None
    return pool


#: the types with a tiled kernel (``matmat_tiled_<type>`` of :mod:`aioexperts._compute.kernels.tiles`)
_TILED_TYPES = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})


def tiled_types() -> frozenset[GGMLQuantizationType]:
    """The types :func:`linear` multiplies in tiles from :data:`TILED_MIN_TOKENS` tokens: Q4_K, Q5_K
    and Q6_K where the CPU has AVX-512 VNNI (``vpdpbusd``), else none (without it the Q4_K tiles ran
    no faster than the 4-token loops of :mod:`aioexperts._compute.kernels.rowdots`)."""
    if backend().name != "numba":
        return frozenset()
    return _TILED_TYPES if _tiles_fast() else frozenset()


def _warm_tiles(types: Iterable[GGMLQuantizationType]) -> list[str]:
    """Compile or load the tiled kernels of ``types`` through :func:`linear` (a one-block matrix of
    zeros times :data:`TILED_MIN_TOKENS` zero tokens), as a prefill would: a first prefill
    otherwise loads them while its first token waits. Their names, ``matmat_tiled_<type>``."""
    names = []
    for qtype in sorted(types, key=lambda t: t.name):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        raw = np.zeros((1, type_size), dtype=np.uint8)
        linear(raw, qtype, (1, block_size), np.zeros((TILED_MIN_TOKENS, block_size), np.float32), split=False)
        names.append(f"matmat_tiled_{qtype.name.lower()}")
    return names


@functools.cache
def _tiles_fast() -> bool:
    """:func:`aioexperts._compute.kernels.tiles.fast`, the module imported once (a prefill asks per product)."""
    from .kernels import tiles

    return tiles.fast()


def _tiled_kernel(ready: _Ready, qtype: GGMLQuantizationType) -> Callable[..., Any]:
    """``kernel(raw, xs, out)`` of a type of :func:`tiled_types` (x checked finite by the caller):
    whole tiles through the tiled kernel; a last part of fewer than :data:`TILED_MIN_TOKENS` tokens
    through the int8 batch kernel (a tile of padding would cost more)."""
    from .kernels import tiles

    tiled: Callable[..., Any] = getattr(tiles, f"matmat_tiled_{qtype.name.lower()}")
    batch = _kernel(ready, qtype, "matmat_int8")

    def run(raw: np.ndarray, xs: np.ndarray, out: np.ndarray) -> None:
        n = xs.shape[0]
        rest = n % tiles.TILE
        full = n - rest if rest < TILED_MIN_TOKENS else n
        tiled(raw, xs[:full], out[:full])
        if full < n:
            batch(raw, xs[full:], out[full:])

    return run


def _split_rows(raw: np.ndarray, run: Callable[[int, int], None], split: bool) -> None:
    """``run(r0, r1)`` over row ranges covering ``raw``: one range, or one per compute-pool thread.

    Split only when ``split`` is true, the process already has a compute pool (a runner made it; this never creates
    one) with more than one thread and ``raw`` holds at least :data:`SPLIT_MIN_BYTES`. The ranges go
    through :meth:`ComputePool.map`: the calling thread runs ranges itself and only idle workers
    help, so concurrent callers never run more threads than the pool has (busy pool: all inline).
    Every row's result is the same whatever the split (rows are independent).
    """
    rows = raw.shape[0]
    pool = _split_pool(raw, split)
    if pool is None:
        run(0, rows)
        return
    parts = pool.n_threads
    bounds = [rows * k // parts for k in range(parts + 1)]
    pool.map(lambda k: run(bounds[k], bounds[k + 1]), range(parts))


def _by_rows(
    kernel: Callable[..., None], raw: np.ndarray, xs: np.ndarray, out: np.ndarray
) -> Callable[[int, int], None]:
    """``run(r0, r1)`` for :func:`_split_rows`: ``kernel(raw[r0:r1], xs, part)`` into ``out[:, r0:r1]``
    (a ``(n, rows)`` kernel: every token at once)."""

    def run(r0: int, r1: int) -> None:
        if r0 == 0 and r1 == raw.shape[0]:
            kernel(raw, xs, out)
            return
        part = np.empty((xs.shape[0], r1 - r0), dtype=np.float32)
        kernel(raw[r0:r1], xs, part)
        out[:, r0:r1] = part

    return run


def _linear_numba(
    qtype: GGMLQuantizationType,
    ready: _Ready,
    raw: np.ndarray,
    xs: np.ndarray,
    out: np.ndarray,
    split: bool,
    tiled: bool = False,
) -> None:
    n = xs.shape[0]
    llama = precision() == "int8"
    if llama and n == 1 and ready.entry.int8_module is not None:
        # the decode step's common call: one token, on this thread or as one fan-out over the pool;
        # the kernel checks that x is finite itself (False: NaN or inf; the general path below)
        pool = _split_pool(raw, split)
        if pool is None:
            if _kernel(ready, qtype, "matvec_int8")(raw, xs[0], out[0]):
                return
        else:
            from .grouped import matvec_split

            if matvec_split(qtype, [(raw, (raw.shape[0], xs.shape[1]))], xs, [out[0]], 4 * pool.n_threads):
                return
    # the int8 kernels' quantizers lose NaN/inf (max() skips NaN): such x takes the round trip, which keeps them
    int8 = ready.entry.int8_module is not None and llama and bool(np.isfinite(xs).all())
    # numba serves here: tiled_types() without its backend check
    if int8 and tiled and n >= TILED_MIN_TOKENS and qtype in _TILED_TYPES and _tiles_fast():
        _split_rows(raw, _by_rows(_tiled_kernel(ready, qtype), raw, xs, out), split)
        return
    if int8 and ready.entry.int8_batched and 1 < n <= INT8_BATCH_MAX:
        _split_rows(raw, _by_rows(_kernel(ready, qtype, "matmat_int8"), raw, xs, out), split)
        return
    if int8 and n <= MATVEC_MAX_TOKENS:
        matvec_int8 = _kernel(ready, qtype, "matvec_int8")

        def tokens_int8(r0: int, r1: int) -> None:
            for t in range(n):
                matvec_int8(raw[r0:r1], xs[t], out[t, r0:r1])

        _split_rows(raw, tokens_int8, split)
        return
    if llama:  # the float kernels on llama.cpp's rounding of x: its integer products to float rounding
        _linear_float(qtype, ready, raw, _llama_activations(xs, qtype), out, split)
        _add_q8_1_sums(raw, qtype, raw.shape[0], xs, out)
    else:
        _linear_float(qtype, ready, raw, xs, out, split)


def _linear_float(
    qtype: GGMLQuantizationType, ready: _Ready, raw: np.ndarray, xs: np.ndarray, out: np.ndarray, split: bool
) -> None:
    n = xs.shape[0]
    if ready.entry.rows_module is not None and n <= ROWS_MAX_TOKENS:
        _split_rows(raw, _by_rows(_kernel(ready, qtype, "matrows"), raw, xs, out), split)
    elif n <= MATVEC_MAX_TOKENS:
        matvec = _kernel(ready, qtype, "matvec")

        def tokens(r0: int, r1: int) -> None:
            for t in range(n):
                matvec(raw[r0:r1], xs[t], out[t, r0:r1])

        _split_rows(raw, tokens, split)
    elif n <= SMALL_BATCH_MAX:
        _kernel(ready, qtype, "matmat")(raw, xs, out)
    else:  # a prefill: dequantized by row ranges, each range's BLAS product on its own worker
        _split_rows(raw, _by_rows(_dequant_matmul(_kernel(ready, qtype, "dequant")), raw, xs, out), split)


def _dequant_matmul(dequant: Callable[..., None]) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """``kernel(raw, xs, out)``: ``raw``'s rows dequantized into the thread's workspace, then
    ``out = xs @ W.T`` by BLAS (one thread per call: the pool caps it)."""

    def run(raw: np.ndarray, xs: np.ndarray, out: np.ndarray) -> None:
        weights = _workspace.matrix((raw.shape[0], xs.shape[1]))
        dequant(raw, weights)
        np.matmul(xs, weights.T, out=out)

    return run


FLASH_SPLIT_MIN = 4096
"""Query rows times heads times cached positions from which the flash attention splits its heads
over the compute pool's idle workers (below it the hand-off costs more than it saves)."""


def flash_kernel() -> Callable[..., None] | None:
    """ggml-cpu's one-chunk F16 flash attention, compiled, when numba serves; else None (the numpy
    backend).

    The callable is ``flash(q, k, v, start, scale, sinks, window, out)`` with ``k``/``v`` the
    float16 cache arrays themselves (C-contiguous, ``(n_kv, n_head_kv, head)``), the rest as
    :func:`aioexperts._compute.kernels.flash.flash_attend_f16`. It runs the vector kernel
    (``flash_attend_f16_bits``, on the cache's bits) where the target converts float16 in hardware
    and both head sizes are multiples of 32, its heads fanned out over the compute pool by KV head
    (:meth:`~aioexperts._compute.pool.ComputePool.fan_out`)
    from :data:`FLASH_SPLIT_MIN` (heads are independent: the same bits however split), else the
    scalar kernel on a float32 copy of the cache; the two give the same bits.
    """
    if backend().name != "numba":
        return None
    return _flash_callable()


@functools.cache
def _flash_callable() -> Callable[..., None] | None:
    """:func:`flash_kernel` once numba serves: made once per process (an import and a closure per
    decode layer cost about 5 us with the caches cold)."""
    try:
        module = importlib.import_module(f"{__package__}.kernels.flash")
        vector = importlib.import_module(f"{__package__}.kernels.halfvec").hardware_half()
    except Exception as exc:  # a broken numba/llvmlite can raise anything at import
        _fail(exc, "the flash attention kernel")
        return None
    from . import pool as _pool_module

    def flash(q: np.ndarray, k: np.ndarray, v: np.ndarray, *rest: Any) -> None:
        # the kernels looked up per call: the module's attributes, as a test may replace them
        if not (vector and k.shape[2] % 32 == 0 and v.shape[2] % 32 == 0):
            module.flash_attend_f16(q, k.astype(np.float32), v.astype(np.float32), *rest)
            return
        k16 = np.ascontiguousarray(k).view(np.uint16)
        v16 = np.ascontiguousarray(v).view(np.uint16)
        n_head = q.shape[1]
        pool = _pool_module._current_pool()
        if not flash_splits(pool, q.shape[0], n_head, k.shape[0]):
            module.flash_attend_f16_bits(q, k16, v16, *rest, 0, n_head)
            return
        if not _flash_fan_out(module, pool, q, k16, v16, *rest):
            module.flash_attend_f16_bits(q, k16, v16, *rest, 0, n_head)

    return flash


_flash_task: Any = None


def flash_splits(pool: Any, n_tokens: int, n_head: int, n_kv: int) -> bool:
    """Whether the flash attention of ``n_tokens`` queries of ``n_head`` heads over ``n_kv``
    positions fans its KV heads out over ``pool`` (a compute pool, or None): more than one thread
    and at least :data:`FLASH_SPLIT_MIN` query rows times heads times positions."""
    return pool is not None and pool.n_threads > 1 and n_tokens * n_head * n_kv >= FLASH_SPLIT_MIN


def flash_task_address() -> int | None:
    """The address of the flash attention's fan-out task (:func:`aioexperts._compute.kernels.flash.make_flash_task`),
    made on first call, where the vector kernel serves (numba, hardware float16); else None."""
    if not warm_flash_task():
        return None
    return int(_flash_task.address)


def compiled_kernel(module: str, name: str) -> Callable[..., Any] | None:
    """The kernel ``name`` of ``aioexperts._compute.kernels.<module>`` where numba serves, else None
    (the numpy backend, or a numba/llvmlite that fails at import: the caller's numpy code serves).
    Found once per backend choice (:func:`set_backend` and a failure start afresh): a decode token
    asks a few hundred times."""
    found = _state.kernels.get((module, name))
    if found is not None:
        return found
    if backend().name != "numba":
        return None
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(f"{__package__}.kernels.{module}"), name)
    except Exception as exc:  # a broken numba/llvmlite can raise anything at import
        _fail(exc, f"the {module} kernels")
        return None
    with _state.lock:
        if _state.failure is None and _state.forced != "numpy":
            _state.kernels[(module, name)] = fn
    return fn


def warm_flash_task() -> bool:
    """Make the flash attention's fan-out task now (a compile of about 0.5 s, not in a first decode
    step) where the vector kernel serves; True when it is ready."""
    global _flash_task
    if backend().name != "numba":
        return False
    try:
        module = importlib.import_module(f"{__package__}.kernels.flash")
        if not importlib.import_module(f"{__package__}.kernels.halfvec").hardware_half():
            return False
        with _state.lock:
            if _flash_task is None:
                _flash_task = module.make_flash_task()
    except Exception as exc:  # a broken numba/llvmlite can raise anything
        _fail(exc, "the flash attention's fan-out task")
        return False
    return True


def _flash_fan_out(
    module: ModuleType,
    pool: Any,
    q: np.ndarray,
    k16: np.ndarray,
    v16: np.ndarray,
    start: int,
    scale: float,
    sinks: np.ndarray,
    window: int,
    out: np.ndarray,
) -> bool:
    """The flash attention's query heads as one fan-out over the pool, an item per KV head (the
    same bits as one call: heads are independent); False when the fan-out is not ready."""
    global _flash_task
    if _flash_task is None:
        with _state.lock:
            if _flash_task is None:
                _flash_task = module.make_flash_task()
    n_kv, n_head_kv, head_v = v16.shape
    desc = module.flash_descriptor(q, n_head_kv, head_v, scale, sinks, window, out)
    module.set_flash_cache(desc, k16, v16, n_kv, start)
    return pool.fan_out(_flash_task.address, desc, n_head_kv) is not None


def _dequantize_compiled(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int, out: np.ndarray) -> bool:
    """The compiled exact kernel behind :func:`aioexperts._format.dequant.dequantize` (its ``Accelerator``).

    The arguments are checked there; False when numba does not serve ``qtype`` (or stops serving).
    """
    ready = _ready(qtype)
    if ready is None:
        return False
    try:
        _kernel(ready, qtype, "dequant")(_kernel_view(raw, rows, ready), out)
    except Exception as exc:
        if not _is_numba_error(exc):
            raise
        _fail(exc, f"the {qtype.name} kernels")
        return False
    return True


_quant.set_accelerator(_dequantize_compiled)


def ready_kernels() -> frozenset[str]:
    """The compiled kernels ready to run in this process now, e.g. ``"dequant_q4_k"`` (empty under numpy)."""
    with _state.lock:
        return frozenset(
            f"{kind}_{ready.entry.suffix}"
            for ready in _state.ready.values()
            for kind in ("matvec", "matmat", "dequant", "matvec_int8", "matmat_int8", "matrows")
            if getattr(ready, kind) is not None
        )


# ----------------------------------------------------------------------------------------------
# compile once: warm-up


def warmup(types: Iterable[GGMLQuantizationType | int], *, kinds: Iterable[KernelKind] | None = None) -> WarmupReport:
    """Compile, or load from the on-disk cache, every kernel the given ggml types need.

    Call it before the first token (``MoERunner.warmup`` does it for the
    model's types) so that no compile happens while a token waits. Types without a compiled kernel
    are ignored. Blocking: from a worker thread under an event loop. The first call of a process
    that loads or compiles something logs its cost once (INFO).

    Args:
        types: ggml types (of the experts, shared experts, routers).
        kinds: the kernels per type (default: the three float kernels, plus the int8 one-token
            kernel when the precision is ``"int8"``).

    Returns:
        A :class:`WarmupReport`.
    """
    t0 = time.perf_counter()
    wanted = sorted({_qtype(t) for t in types}, key=lambda t: t.name)
    chosen: tuple[KernelKind, ...] = tuple(kinds) if kinds is not None else KERNEL_KINDS
    if kinds is None and precision() == "int8":
        chosen = (*chosen, "matvec_int8", "matmat_int8")
    names: list[str] = []
    loaded = compiled = 0
    for qtype in wanted:
        ready = _ready(qtype)
        if ready is None:
            continue
        for kind in chosen:
            if kind == "matvec_int8" and not ready.entry.int8_module:
                continue
            if kind == "matmat_int8" and not ready.entry.int8_batched:
                continue
            if kind == "matrows" and not ready.entry.rows_module:
                continue
            name = f"{kind}_{ready.entry.suffix}"
            try:
                if getattr(ready, kind) is None:
                    fn, n_loaded, n_compiled = _compile(qtype, kind)
                    setattr(ready, kind, fn)
                    loaded += n_loaded
                    compiled += n_compiled
            except Exception as exc:
                if not _is_numba_error(exc):
                    raise
                _fail(exc, name)
                break
            names.append(name)
    if kinds is None and precision() == "int8":
        names.extend(_warm_tiles(set(wanted) & tiled_types()))
    status = backend()
    report = WarmupReport(
        backend=status,
        types=tuple(t.name for t in wanted),
        kernels=tuple(names) if status.name == "numba" else (),
        loaded=loaded,
        compiled=compiled,
        seconds=time.perf_counter() - t0,
        cache_dir=status.cache_dir,
    )
    if loaded or compiled:
        _log_once(
            "warmup",
            logging.INFO,
            "%d kernels for %s ready in %.2f s (%d loaded from %s, %d compiled)",
            len(names),
            ", ".join(report.types),
            report.seconds,
            loaded,
            report.cache_dir or "no cache",
            compiled,
        )
    return report
