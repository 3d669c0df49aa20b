"""ggml's own CPU mat-vec, through ctypes on the ``libggml*`` that llama-cpp-python ships.

The kernels bench (``bench/kernels.py``) times this beside the fused kernels, in the same rounds,
so its "x ggml" column is measured on the machine that runs it. Needs the ``baseline`` extra
(``pip install 'aioexperts[baseline]'``: llama-cpp-python, built from source); without it,
:func:`unavailable_reason` says why in one line.

Only functions are bound (``ggml.h``, ``ggml-cpu.h``); the one struct passed is the by-value
``ggml_init_params``, and of the ``ggml_cplan`` that ``ggml_graph_plan`` returns only its first
field is read (``work_size``: the bytes of the work buffer, so that the context holding it is
large enough; ggml's release builds return NULL from a full context and crash later).

The product is the graph llama.cpp runs for one dense projection of one token:
``ggml_mul_mat(W, x)`` in a context on plain CPU memory (no repacked buffer types), computed by
``ggml_graph_compute_with_ctx`` (``ggml/src/ggml-cpu/ggml-cpu.c``, ``ggml_compute_forward_mul_mat``),
which quantizes ``x`` to the type's ``vec_dot_type`` (Q8_K for the k-quants and IQ4_XS, Q8_0 for
the 32-blocks, F16/BF16 for those) and runs ``ggml_vec_dot_<type>_<vec_dot_type>`` per row.

ggml aborts the process on a failed ``GGML_ASSERT``: every argument is checked here first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from aioexperts import AioExpertsError, ConfigError, FormatError, OptionalDependencyError, UnsupportedTypeError

__all__ = (
    "BaselineMismatchError",
    "GgmlLibrary",
    "GgmlMatVec",
    "agreement_tolerance",
    "check_agreement",
    "load",
    "relative_error",
    "unavailable_reason",
)

Q = GGMLQuantizationType


class BaselineMismatchError(AioExpertsError):
    """A baseline a bench compares against (ggml's own kernel) gave a different answer, or failed."""


#: weight types whose CPU mat-vec this binding runs (the compiled kernels' types, and F32)
SUPPORTED = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
     Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4}
)  # fmt: skip

#: relative L2 error allowed between ggml and an exact float product, by what ggml rounds ``x`` to:
#: 8-bit blocks (Q8_K / Q8_0, per-value error up to 1/254 of the block maximum), bf16 (8 bits of
#: mantissa), f16 (11 bits), none (F32)
_TOLERANCE = {Q.F32: 1e-5, Q.F16: 2e-3, Q.BF16: 1.5e-2}
_INT8_TOLERANCE = 2.5e-2

_GGML_TYPE_F32 = 0
_SCRATCH_MARGIN = 1 << 12  # bytes beyond the work buffer: its object header and alignment

#: (name, restype, argtypes) of every function used, and the library it lives in
_BASE_FUNCTIONS: tuple[tuple[str, Any, list[Any] | None], ...] = (
    ("ggml_tensor_overhead", ctypes.c_size_t, []),
    ("ggml_graph_overhead", ctypes.c_size_t, []),
    ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int]),
    ("ggml_blck_size", ctypes.c_int64, [ctypes.c_int]),
    ("ggml_type_size", ctypes.c_size_t, [ctypes.c_int]),
    ("ggml_row_size", ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
    ("ggml_init", ctypes.c_void_p, None),  # argtypes set below (the params struct)
    ("ggml_reset", None, [ctypes.c_void_p]),
    ("ggml_free", None, [ctypes.c_void_p]),
    ("ggml_new_tensor_2d", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
    ("ggml_get_data", ctypes.c_void_p, [ctypes.c_void_p]),
    ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
    ("ggml_mul_mat", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
    ("ggml_new_graph", ctypes.c_void_p, [ctypes.c_void_p]),
    ("ggml_build_forward_expand", None, [ctypes.c_void_p, ctypes.c_void_p]),
)
_CPU_FUNCTIONS: tuple[tuple[str, Any, list[Any] | None], ...] = (
    ("ggml_cpu_init", None, []),
    ("ggml_graph_plan", None, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),  # restype set below
    ("ggml_graph_compute_with_ctx", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
)
#: CPU features of the build (``ggml_cpu_has_*``, each ``int (void)``), for the results file
CPU_FEATURES = ("avx", "avx2", "avx_vnni", "avx512", "avx512_vnni", "f16c", "fma", "amx_int8")


class _InitParams(ctypes.Structure):
    """``struct ggml_init_params`` (ggml.h): passed by value to ``ggml_init``."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _PlanWorkSize(ctypes.Structure):
    """The first field of ``struct ggml_cplan`` (ggml-cpu.h), then room for the rest (56 bytes in 0.3.x).

    Returned by value: the caller provides the memory, so a larger buffer than the struct is safe.
    """

    _fields_ = [("work_size", ctypes.c_size_t), ("_rest", ctypes.c_byte * 504)]


def _library_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise OptionalDependencyError(
            "ggml's kernels are measured through llama-cpp-python, which is not installed "
            "(pip install 'aioexperts[baseline]'; it builds llama.cpp from source)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _find(lib_dir: Path, stem: str) -> Path:
    exact = lib_dir / f"{stem}.so"
    if exact.exists():
        return exact
    found = sorted(lib_dir.glob(f"{stem}.so*")) + sorted(lib_dir.glob(f"{stem}.dylib"))
    if not found:
        raise OptionalDependencyError(f"llama-cpp-python has no {stem}.so in {lib_dir}")
    return found[0]


def _bind(lib: ctypes.CDLL, path: Path, functions: tuple[tuple[str, Any, list[Any] | None], ...]) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for name, restype, argtypes in functions:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise OptionalDependencyError(
                f"{path.name} has no function {name} (llama-cpp-python too old or built without it; "
                "aioexperts[baseline] needs llama-cpp-python >= 0.3)"
            ) from None
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
        bound[name] = fn
    return bound


class GgmlLibrary:
    """The ggml functions of one llama-cpp-python install.

    Attributes:
        version: llama-cpp-python's version.
        paths: the shared libraries loaded (``libggml-base``, ``libggml-cpu``).
        features: ``{name: bool}`` CPU features the build uses (``ggml_cpu_has_<name>``).
    """

    def __init__(self, lib_dir: Path | None = None) -> None:
        lib_dir = _library_dir() if lib_dir is None else lib_dir
        base_path, cpu_path = _find(lib_dir, "libggml-base"), _find(lib_dir, "libggml-cpu")
        try:
            base = ctypes.CDLL(str(base_path), mode=ctypes.RTLD_GLOBAL)
            cpu = ctypes.CDLL(str(cpu_path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise OptionalDependencyError(f"cannot load llama-cpp-python's ggml libraries: {exc}") from exc
        self.fn = {**_bind(base, base_path, _BASE_FUNCTIONS), **_bind(cpu, cpu_path, _CPU_FUNCTIONS)}
        self.fn["ggml_init"].argtypes = [_InitParams]
        self.fn["ggml_graph_plan"].restype = _PlanWorkSize
        self.paths = (base_path, cpu_path)
        try:
            self.version = metadata.version("llama_cpp_python")
        except metadata.PackageNotFoundError:
            self.version = "?"
        self.features = {}
        for name in CPU_FEATURES:
            probe = getattr(cpu, f"ggml_cpu_has_{name}", None)
            if probe is not None:
                probe.restype, probe.argtypes = ctypes.c_int, []
                self.features[name] = bool(probe())
        self.fn["ggml_cpu_init"]()

    def type_value(self, qtype: GGMLQuantizationType | int) -> int:
        """The ggml enum value of ``qtype``, checked against ``ggml_type_name`` of this build.

        Raises:
            UnsupportedTypeError: the type is not one this binding runs, or this ggml names the
                value differently (its enum moved).
        """
        try:
            q = Q(int(qtype))
        except ValueError:
            raise UnsupportedTypeError(f"ggml type {qtype!r} is unknown to gguf-py") from None
        if q not in SUPPORTED:
            raise UnsupportedTypeError(f"the ggml baseline does not run {q.name}")
        name = self.fn["ggml_type_name"](int(q))
        if name is None or name.decode().lower() != q.name.lower():
            raise UnsupportedTypeError(f"this ggml names type {int(q)} {name!r}, not {q.name}")
        return int(q)

    def context(self, mem_size: int) -> int:
        """A new ``ggml_context`` owning ``mem_size`` bytes (free it with ``ggml_free``)."""
        ctx = self.fn["ggml_init"](_InitParams(mem_size, None, False))
        if not ctx:
            raise MemoryError(f"ggml_init could not allocate {mem_size} bytes")
        return int(ctx)


_LIBRARY: GgmlLibrary | None = None


def load() -> GgmlLibrary:
    """The process's :class:`GgmlLibrary` (loaded once).

    Raises:
        OptionalDependencyError: llama-cpp-python is not installed, its libraries do not load, or a
            function is missing (the message names it).
    """
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = GgmlLibrary()
    return _LIBRARY


def unavailable_reason() -> str | None:
    """``None`` if ggml's kernels can be timed here, else one line saying why not."""
    try:
        load()
    except OptionalDependencyError as exc:
        return str(exc)
    return None


class GgmlMatVec:
    """``x @ W.T`` for one token by ggml's CPU backend (``ggml_mul_mat``), on a private copy of ``W``.

    The weight, the input and the output live in one ggml context; each :meth:`compute` runs the
    one-node graph with ``n_threads`` threads and its work buffer (the quantized ``x``; ``work_size``
    bytes, from ``ggml_graph_plan``) in a second context that is reset first, so calls do not grow
    memory. Not thread-safe. Use as a context
    manager or call :meth:`close`.

    Args:
        data: the matrix bytes in ggml block layout (``rows * row_bytes`` bytes, any buffer).
        ggml_type: the ggml type of the bytes.
        shape: ``(rows, cols)`` in numpy order (ggml ``ne = {cols, rows}``); ``cols`` a multiple of
            the block size.
        n_threads: threads of ``ggml_graph_compute_with_ctx`` (>= 1).
        library: the :class:`GgmlLibrary` (default: :func:`load`).

    Raises:
        OptionalDependencyError: no usable ggml (see :func:`load`).
        UnsupportedTypeError: a type this binding does not run.
        FormatError: the byte count does not fit ``shape`` and the type.
        ConfigError: a shape or thread count out of range.
    """

    def __init__(
        self,
        data: Any,
        ggml_type: GGMLQuantizationType | int,
        shape: tuple[int, int],
        *,
        n_threads: int = 1,
        library: GgmlLibrary | None = None,
    ) -> None:
        self._lib = load() if library is None else library
        fn = self._lib.fn
        self.ggml_type = Q(self._lib.type_value(ggml_type))
        rows, cols = (int(v) for v in shape)
        if rows < 1 or cols < 1:
            raise ConfigError(f"shape {shape} must be two positive sizes")
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
            raise ConfigError(f"n_threads must be an int >= 1, not {n_threads!r}")
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        if cols % block or fn["ggml_blck_size"](int(self.ggml_type)) != block:
            raise ConfigError(f"{cols} columns are not whole {self.ggml_type.name} blocks of {block}")
        raw = np.frombuffer(data, dtype=np.uint8)
        expected = rows * (cols // block) * type_size
        if raw.size != expected or fn["ggml_row_size"](int(self.ggml_type), cols) * rows != expected:
            raise FormatError(
                f"{raw.size} bytes do not hold a {rows} x {cols} {self.ggml_type.name} matrix ({expected})"
            )
        self.shape = (rows, cols)
        self.n_threads = n_threads
        overhead = int(fn["ggml_tensor_overhead"]())
        size = 3 * overhead + int(fn["ggml_graph_overhead"]()) + expected + 4 * (cols + rows) + 4 * 256
        self._ctx = self._lib.context(size)
        self._scratch = 0
        try:
            weight = fn["ggml_new_tensor_2d"](self._ctx, int(self.ggml_type), cols, rows)
            x = fn["ggml_new_tensor_2d"](self._ctx, _GGML_TYPE_F32, cols, 1)
            if fn["ggml_nbytes"](weight) != expected or fn["ggml_nbytes"](x) != 4 * cols:
                raise FormatError(f"ggml sizes the {self.ggml_type.name} tensor differently from gguf-py")
            ctypes.memmove(fn["ggml_get_data"](weight), raw.ctypes.data, expected)
            out = fn["ggml_mul_mat"](self._ctx, weight, x)
            if fn["ggml_nbytes"](out) != 4 * rows:
                raise FormatError(f"ggml_mul_mat gave {fn['ggml_nbytes'](out)} output bytes, not {4 * rows}")
            self._graph = fn["ggml_new_graph"](self._ctx)
            fn["ggml_build_forward_expand"](self._graph, out)
            self.work_size = int(fn["ggml_graph_plan"](self._graph, n_threads, None).work_size)
            if self.work_size > 1 << 30:
                raise FormatError(f"ggml_graph_plan asks for {self.work_size} work bytes (ggml_cplan changed?)")
            self._scratch = self._lib.context(overhead + self.work_size + _SCRATCH_MARGIN)
            self._x = np.ctypeslib.as_array(
                ctypes.cast(fn["ggml_get_data"](x), ctypes.POINTER(ctypes.c_float)), (cols,)
            )
            self._out = np.ctypeslib.as_array(
                ctypes.cast(fn["ggml_get_data"](out), ctypes.POINTER(ctypes.c_float)), (rows,)
            )
        except BaseException:
            self.close()
            raise
        self._compute = fn["ggml_graph_compute_with_ctx"]
        self._reset = fn["ggml_reset"]

    def set_input(self, x: np.ndarray) -> None:
        """Copy one token ``x`` (``(cols,)`` or ``(1, cols)`` float32) into the graph's input.

        Raises:
            ConfigError: wrong dtype or size.
        """
        xs = np.asarray(x)
        if xs.dtype != np.float32 or xs.size != self.shape[1] or xs.ndim not in (1, 2):
            raise ConfigError(f"x must be {self.shape[1]} float32 values, not {xs.dtype} of shape {xs.shape}")
        self._live()[0][...] = xs.reshape(-1)

    def compute(self) -> np.ndarray:
        """Run the graph on the current input; returns a view of ggml's ``(rows,)`` float32 output.

        The view is overwritten by the next call: copy it to keep it.

        Raises:
            BaselineMismatchError: ggml reported a status other than success.
        """
        if not self._scratch:
            raise ConfigError("the ggml mat-vec is closed")
        self._reset(self._scratch)
        status = self._compute(self._scratch, self._graph, self.n_threads)
        if status != 0:
            raise BaselineMismatchError(f"ggml_graph_compute_with_ctx returned status {status}")
        return self._out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """:meth:`set_input` then :meth:`compute`; returns a new ``(1, rows)`` float32 array."""
        self.set_input(x)
        return self.compute().copy().reshape(1, -1)

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._ctx:
            raise ConfigError("the ggml mat-vec is closed")
        return self._x, self._out

    def close(self) -> None:
        """Free ggml's memory (idempotent); the views handed out become invalid."""
        for attr in ("_scratch", "_ctx"):
            ctx = getattr(self, attr, 0)
            if ctx:
                self._lib.fn["ggml_free"](ctx)
                setattr(self, attr, 0)

    def __enter__(self) -> GgmlMatVec:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||`` (L2, float64); ``inf`` when ``want`` is zero and ``got`` is not."""
    g, w = np.asarray(got, np.float64).reshape(-1), np.asarray(want, np.float64).reshape(-1)
    den, num = float(np.linalg.norm(w)), float(np.linalg.norm(g - w))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def agreement_tolerance(ggml_type: GGMLQuantizationType | int) -> float:
    """The relative L2 error ggml's product may have against an exact one, for a weight type.

    All of it comes from the rounding of ``x`` to the type's ``vec_dot_type`` (``type_traits_cpu``
    in ``ggml/src/ggml-cpu/ggml-cpu.c``): 8-bit blocks for the quantized types, F16/BF16 otherwise.
    """
    return _TOLERANCE.get(Q(int(ggml_type)), _INT8_TOLERANCE)


def check_agreement(ggml_out: np.ndarray, reference: np.ndarray, ggml_type: GGMLQuantizationType | int) -> float:
    """The relative L2 error of ggml's product against ``reference``; raises if beyond the tolerance.

    Raises:
        BaselineMismatchError: the two disagree by more than :func:`agreement_tolerance` (the bytes
            were read as another type, or a kernel is wrong), or ggml's output is not finite.
    """
    q = Q(int(ggml_type))
    err = relative_error(ggml_out, reference)
    tol = agreement_tolerance(q)
    if not np.isfinite(np.asarray(ggml_out)).all() or not err <= tol:
        raise BaselineMismatchError(
            f"ggml's {q.name} mat-vec and ours disagree: relative L2 error {err:.3g} > {tol:g} allowed"
        )
    return err
