"""The results file ``bench-results.json``: everything one bench run measured, with its context.

Top-level keys: ``schema`` (this format's version), ``aioexperts`` (version), ``date`` (UTC, ISO
8601), ``command``, ``units``, ``machine`` (:func:`.machine.machine_facts`), ``model``, ``parameters``,
``kernels`` (which kernels the executor ran: ``backend``, ``reason``, ``precision``), ``targets``
(each with ``met``), and the sections ``reads``, ``tokens``, ``loops``, ``sweep`` of
the parts that ran. Every raw round is kept at full precision; summaries are medians with min and
max over the rounds. The file is written atomically (a temporary file renamed into place), so an
interrupted run leaves no partial file.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from aioexperts._json import dump as dump_json  # the library's one strict JSON writer (NaN and inf: null)
from aioexperts._json import dumps as dumps_json
from aioexperts._json import json_safe

__all__ = (
    "SCHEMA",
    "UNITS",
    "dump_json",
    "dumps_json",
    "evaluate_targets",
    "json_safe",
    "load_results",
    "write_results",
    "write_text",
)

SCHEMA = 1
UNITS = {
    "GB": "1e9 bytes",
    "GiB": "2^30 bytes",
    "gb_per_s": "GB per second of wall time (bytes the reads returned)",
    "cpu_s_per_gib": "user + system CPU seconds of the process (every thread) per GiB read",
    "seconds": "wall seconds",
    "ms": "milliseconds",
    "us": "microseconds",
    "ratios": "per round (passes adjacent in time), then median, min and max over the rounds",
}


def write_results(path: str | os.PathLike[str], results: dict[str, Any]) -> None:
    """Write ``results`` as indented JSON to ``path`` atomically (:func:`write_text`)."""
    write_text(path, dumps_json(results, indent=1, sort_keys=False) + "\n")  # strict: NaN and inf become null


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically: a private temporary file beside it (``mkstemp``, never a
    fixed ``PATH.tmp`` that a user's file or symlink may hold), mode 0644, renamed over ``path``.

    Raises:
        OSError: the file cannot be written (the temporary file is removed).
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".partial", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a results file.

    Files written before the bench named its own store ``store`` keep its warm figures under
    ``reads.warm.engine`` and its slots under ``reads.parameters.engine_slots``; they are read under
    the new names.

    Raises:
        OSError: the file cannot be read (FileNotFoundError: there is none).
        ValueError: not a results file of a known schema (not UTF-8 JSON, not an object, another
            schema), naming the file.
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise ValueError(f"{os.fspath(path)}: not a bench results file (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{os.fspath(path)}: not a bench results file of schema {SCHEMA}")
    for parent, old, new in _RENAMED:
        node: Any = data
        for key in parent:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and old in node and new not in node:
            node[new] = node.pop(old)
    return data


#: ``(path of the parent, old key, new key)`` of the results keys renamed since schema 1 began
_RENAMED = ((("reads", "warm"), "engine", "store"), (("reads", "parameters"), "engine_slots", "store_slots"))


def _target(name: str, what: str, value: dict[str, Any] | None, limit: float, higher_is_better: bool) -> dict[str, Any]:
    median = None if value is None else value.get("median")
    met = None if median is None else (median >= limit if higher_is_better else median <= limit)
    return {
        "name": name,
        "what": what,
        "limit": limit,
        "direction": ">=" if higher_is_better else "<=",
        "value": value,
        "met": met,
    }


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each judged on the median of its per-round figures (``met`` None if not measured)."""
    out = []
    reads = results.get("reads") or {}
    ratios = reads.get("ratios") or {}
    out.append(
        _target("x_fio", "io_uring cold / fio replay of the same reads", ratios.get("io_uring_x_fio"), 0.95, True)
    )
    out.append(
        _target(
            "x_raw_same_memory",
            "io_uring cold / raw io_uring loop, same reads into as much memory (fio cannot)",
            ratios.get("io_uring_x_raw"),
            0.95,
            True,
        )
    )
    out.append(
        _target(
            "cpu_vs_fio",
            "io_uring CPU s/GiB / fio's on the same reads",
            ratios.get("cpu_io_uring_over_fio"),
            2.0,
            False,
        )
    )
    out.append(
        _target("x_mmap", "io_uring cold / mmap copy of the same reads", ratios.get("io_uring_x_mmap"), 3.0, True)
    )
    out.append(
        _target(
            "x_threads", "io_uring cold / thread pool of the same reads", ratios.get("io_uring_x_threads"), 1.0, True
        )
    )
    warm = (reads.get("warm") or {}).get("store") or {}
    out.append(
        _target("warm_hit", "warm experts() hit of one expert, us", warm.get("experts_single_us_per_hit"), 20.0, False)
    )
    tokens = results.get("tokens") or {}
    if tokens:
        out.append(
            _target(
                "overlap",
                "pipelined token / max(io only, compute only), same round",
                tokens.get("overlap"),
                float(tokens.get("target_overlap", 1.15)),
                False,
            )
        )
    return out
