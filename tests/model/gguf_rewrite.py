"""Rewrite a GGUF fixture with changes (drop tensors, change tensor data or metadata) via the gguf package."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def rewrite(
    src: Path,
    dst: Path,
    *,
    drop: Iterable[str] = (),
    patch: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    metadata: Mapping[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    arch: str | None = None,
    keep_tensors: bool = True,
    add: Mapping[str, np.ndarray] | None = None,
    drop_keys: Iterable[str] = (),
) -> Path:
    """Copy ``src`` to ``dst`` without the tensors in ``drop``, with ``patch[name](data)`` for others
    (each tensor gets its data's shape: a patch may reshape it; a quantized tensor's data are its
    rows of bytes).

    ``metadata`` adds or replaces keys ``{key: (value, type)}``; ``arch`` renames the architecture
    (and its key prefix); ``keep_tensors=False`` writes the metadata alone; ``add`` appends float32
    tensors ``{name: numpy-order array}``; ``drop_keys`` leaves metadata keys out.
    """
    reader = gguf.GGUFReader(src)
    old_arch = str(reader.fields["general.architecture"].contents())
    new_arch = arch or old_arch
    writer = gguf.GGUFWriter(dst, new_arch)
    dropped = set(drop)
    skipped_keys = set(drop_keys)
    extra = dict(metadata or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = new_arch + name[len(old_arch) :] if name.startswith(old_arch + ".") else name
        if key in extra or name in skipped_keys:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for key, (value, vtype) in extra.items():
        writer.add_key_value(key, value, vtype)
    if keep_tensors:
        for t in reader.tensors:
            if t.name in dropped:
                continue
            data = np.array(t.data)  # numpy order; a quantized tensor's rows of bytes
            if patch and t.name in patch:
                data = patch[t.name](data)
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)  # the shape is the data's
        for name, array in (add or {}).items():
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
