"""Write a model's miss-tier sidecar: every routed expert dequantized and re-quantized to a low type.

The file's layout and its key to the model: :mod:`aioexperts._format.tier_sidecar`. Each expert is
dequantized exactly (``_format/dequant.py``, ggml's ``dequantize_row_*``) and quantized with our
quantizers (:mod:`aioexperts._quant`, ggml's reference quantizers without an importance matrix), as
``llama-quantize`` would requantize it without ``--imatrix``.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .._errors import ConfigError, FormatError
from .._format.dequant import dequantize
from .._format.filemode import new_file_mode
from .._format.layout import Bank, build_layout
from .._format.model import GGUFModel, open_model
from .._format.tier_sidecar import (
    TIER_ARCH,
    TIER_KEYS,
    TIER_VERSION,
    bank_shapes,
    expert_bytes,
    model_identity,
    tier_expert_name,
)
from . import TIER_TYPES, quantize

__all__ = ("write_miss_tier",)

Progress = Callable[[int, int], None]
#: experts re-quantized at once before they are written (bounds the memory held)
_CHUNK = 32


def write_miss_tier(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    ggml_type: str = "Q3_K",
    *,
    progress: Progress | None = None,
    threads: int | None = None,
) -> Path:
    """Write the miss-tier sidecar of the model at ``model_path`` to ``out_path``.

    Blocking and CPU-bound (each expert is dequantized and quantized again: minutes per GB of
    experts); the file appears whole or not at all (written beside, then renamed).

    Args:
        model_path: the model (a GGUF file or any shard of a split set).
        out_path: the sidecar to write (replaced if it exists).
        ggml_type: ``"Q2_K"``, ``"Q3_K"`` or ``"IQ4_XS"``.
        progress: ``progress(expert bytes written, total)`` after each few experts.
        threads: experts re-quantized at once (the numba kernels release the GIL); default the
            CPUs this process may use.

    Returns:
        The path written.

    Raises:
        ConfigError: an unknown type, a matrix whose rows are not a multiple of 256 values, or an
            ``out_path`` that is empty, names a directory or is a file of the model (any shard,
            through any link).
        FormatError: the model is malformed, or changed while it was read.
        OSError: reading the model or writing the sidecar failed (a sidecar that cannot be
            created, in a missing or read-only folder, is named as ``out_path``, never as the
            temporary file written beside it).
    """
    low = TIER_TYPES.get(ggml_type)
    if low is None:
        raise ConfigError(f"the miss tier's type must be one of {', '.join(TIER_TYPES)}, got {ggml_type!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be an int >= 1 or None, got {threads!r}")
    n_threads = threads or len(os.sched_getaffinity(0))
    model = open_model(model_path)
    _check_output(out_path, model)
    layout = build_layout(model)
    plan: list[tuple[int, Bank, int]] = []  # layer, bank, bytes of one expert
    for moe in layout.layers.values():
        for bank in moe.banks:
            for projection, (_rows, cols) in bank_shapes(bank).items():
                if cols % 256:
                    raise ConfigError(
                        f"layer {moe.index} bank {bank.index}: {projection} rows of {cols} values; the K-quants "
                        "and IQ4_XS need a multiple of 256"
                    )
            plan.append((moe.index, bank, sum(expert_bytes(bank, low).values())))
    out = Path(out_path)
    writer = GGUFWriter(None, TIER_ARCH)  # its file is made below, once nothing else can fail first
    writer.add_name(f"aioexperts miss tier ({ggml_type}) of {os.path.basename(model.path)}")
    writer.add_uint32(TIER_KEYS["version"], TIER_VERSION)
    writer.add_uint32(TIER_KEYS["type"], int(low))
    for name, values in model_identity(model).items():
        writer.add_key_value(TIER_KEYS[name], values, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    for layer, bank, n_bytes in plan:
        for local in range(bank.n_experts):
            name = tier_expert_name(layer, bank.index, local)
            writer.add_tensor_info(name, (n_bytes,), np.dtype(np.int8), n_bytes, raw_dtype=GGMLQuantizationType.I8)
    total, written = sum(n_bytes * bank.n_experts for _, bank, n_bytes in plan), 0
    try:  # a fresh file of its own (O_EXCL), never one planted at a name another process can guess
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:  # name the user's path, not the temporary file's
        raise OSError(exc.errno, exc.strerror, os.fspath(out_path)) from None
    tmp = Path(tmp_name)
    pool = ThreadPoolExecutor(n_threads, thread_name_prefix="aioexperts-tier")
    try:
        made = os.fstat(fd)
        _open_on(writer, fd, tmp)
        files = writer.fout or []
        opened = os.fstat(files[0].fileno()) if files else None
        if opened is None or (opened.st_dev, opened.st_ino) != (made.st_dev, made.st_ino):
            raise OSError(errno.EEXIST, "the temporary file was replaced before it was opened", os.fspath(tmp))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for layer, bank, n_bytes in plan:

            def requantize(local: int, bank: Bank = bank, layer: int = layer, n_bytes: int = n_bytes) -> np.ndarray:
                data = np.empty(n_bytes, dtype=np.uint8)
                at = 0
                for segment in bank.locate(layer, local).segments:  # gate, up, down: one after another
                    raw = np.frombuffer(_read(model, segment.shard, segment.offset, segment.n_bytes), dtype=np.uint8)
                    low_bytes = quantize(dequantize(raw, segment.ggml_type, segment.shape), low).reshape(-1)
                    data[at : at + low_bytes.size] = low_bytes
                    at += low_bytes.size
                if at != n_bytes:  # bank_shapes and the segments disagree: never written short
                    raise FormatError(f"layer {layer} expert {local}: {at} low-tier bytes, expected {n_bytes}")
                return data

            for first in range(0, bank.n_experts, _CHUNK):  # in order; at most _CHUNK experts held
                chunk = range(first, min(first + _CHUNK, bank.n_experts))
                for data in pool.map(requantize, chunk):  # re-raises the first failure
                    writer.write_tensor_data(data.view(np.int8))
                    written += n_bytes
                if progress is not None:
                    progress(written, total)
        writer.close()
        os.fchmod(fd, new_file_mode())  # mkstemp makes 0600; a sidecar gets the mode of any new file
        now = os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
            raise OSError(errno.EEXIST, "the temporary file was replaced while it was written", os.fspath(tmp))
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        _unlink_if_ours(tmp, fd)
        raise
    finally:
        os.close(fd)
        pool.shutdown(cancel_futures=True)
    return out


def _check_output(out_path: str | os.PathLike[str], model: GGUFModel) -> None:
    """Refuse an output path that would lose something: empty, naming a directory, or any file of
    the model (by device and inode: a symlink, a hard link or ``dir/../MODEL`` is the model)."""
    name = os.fspath(out_path)
    if not name:
        raise ConfigError("the sidecar's path is empty")
    if name.endswith(os.sep) or os.path.isdir(name):
        raise ConfigError(f"the sidecar's path {name} names a directory, not a file")
    try:
        st = os.stat(name)
    except FileNotFoundError:
        return
    for shard in model.shards:
        if (st.st_dev, st.st_ino) == (shard.dev, shard.ino):
            raise ConfigError(f"the sidecar's path {name} is the model file {shard.path}: refusing to write over it")


def _open_on(writer: GGUFWriter, fd: int, tmp: Path) -> None:
    """Have ``writer`` write one file through a duplicate of ``fd`` (the ``mkstemp`` file), not by
    opening ``tmp`` by name (which follows whatever the name is by then). Done as ``gguf``'s
    ``open_output_file`` does for one file; a ``gguf`` whose writer differs opens by name instead
    (the caller then checks that the file opened is the one made)."""
    try:
        from gguf.gguf_writer import WriterState

        if writer.state is not WriterState.NO_FILE or len(writer.tensors) != 1:
            raise AttributeError("not one file to open")
        writer.path = tmp
        writer.fout = [os.fdopen(os.dup(fd), "wb")]
        writer.state = WriterState.EMPTY
    except (ImportError, AttributeError, TypeError):
        writer.open_output_file(tmp)


def _unlink_if_ours(tmp: Path, fd: int) -> None:
    """Remove the temporary file ``fd`` made, by name, unless that name is another file now."""
    try:
        made, now = os.fstat(fd), os.lstat(tmp)
    except OSError:
        return
    if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
        tmp.unlink(missing_ok=True)


def _read(model: GGUFModel, shard: int, offset: int, n_bytes: int) -> bytes:
    """``n_bytes`` at ``offset`` of shard ``shard``, checked to be the file that was parsed."""
    info = model.shards[shard]
    with open(info.path, "rb", buffering=0) as f:
        if not info.matches(os.fstat(f.fileno())):
            raise FormatError(f"{info.path} changed while the miss tier was written; write it again")
        data = os.pread(f.fileno(), n_bytes, offset)
    if len(data) != n_bytes:
        raise FormatError(f"{info.path}: {n_bytes} bytes at offset {offset} gave {len(data)} (truncated?)")
    return data
