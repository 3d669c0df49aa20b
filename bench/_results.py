"""Helpers shared by the kernel benchmarks: machine facts, summaries of repeats, the JSON results file.

Every benchmark writes one JSON object: ``{"benchmark", "started", "machine", "parameters", "units",
"rounds": [...], "summary": {...}}``; ``rounds`` holds every measured round, so a figure in the docs
can be recomputed from the file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aioexperts.cli._common import error_text
from aioexperts_bench import cpu_vector_isa, dumps_json, source_commit

RESULTS_DIR = Path.cwd()


def machine_facts() -> dict[str, Any]:
    """CPU model and flags of interest, cores, memory, Python and library versions, load average."""
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "cores_available": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), ""
        )
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
        facts["cpu"] = model
        facts["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx", "f16c", "fma")) or "vnni" in f)
        facts["cpu_vector_isa"] = cpu_vector_isa(flags)
    except OSError:
        pass
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()[0]
        facts["mem_total_kib"] = int(meminfo.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    try:
        import llvmlite.binding as llvm
        import numba

        facts["numba"] = numba.__version__
        facts["llvm_cpu"] = llvm.get_host_cpu_name()
    except ImportError:
        facts["numba"] = None
    import gguf
    import numpy as np

    facts["numpy"] = np.__version__
    facts["gguf"] = getattr(gguf, "__version__", "?")
    return facts


def median_time(fn: Callable[[], object], calls: int) -> float:
    """The median wall time of ``calls`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_range(values: Sequence[float], spec: str = ".2f") -> str:
    """``median (min-max)``."""
    s = summary(values)
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def refuse_foreign(path: Path) -> Path:
    """``path``, unless it names something a bench did not write: an existing file that is not a
    JSON object (a model given by mistake, any other file) is never replaced (SystemExit, one line)."""
    if path.exists():
        try:
            ours = path.is_file() and path.read_bytes()[:1] == b"{" and isinstance(json.loads(path.read_text()), dict)
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise SystemExit(f"{path} exists and is not a results file: refusing to replace it (remove it first)")
    return path


def write_results(
    path: Path | None,
    name: str,
    parameters: dict[str, Any],
    units: dict[str, str],
    rounds: list[dict[str, Any]],
    summary_: dict[str, Any],
    started: float,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write the results file (default ``<name>-results.json`` here) and return its path.

    The committed copies the docs are rendered from live in ``docs/results/<name>.json``.
    ``machine`` adds facts to (or overrides) :func:`machine_facts`'s and the git commit of the
    aioexperts checkout that ran (``aioexperts_commit``, ``+dirty`` with local changes).
    """
    target = path if path is not None else RESULTS_DIR / f"{name}-results.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": time.time() - started,
        "machine": {**machine_facts(), "aioexperts_commit": source_commit(), **(machine or {})},
        "parameters": parameters,
        "units": units,
        "rounds": rounds,
        "summary": summary_,
    }
    refuse_foreign(target).write_text(dumps(payload))
    return target


def replace_region(doc: Path, region: str, lines: Sequence[str]) -> None:
    """Replace the text between ``<!-- bench:REGION -->`` and ``<!-- /bench:REGION -->`` in ``doc``
    with ``lines`` (the markers stay).

    Raises:
        SystemExit: ``doc`` has no such region.
    """
    text = doc.read_text()
    start, end = f"<!-- bench:{region} -->", f"<!-- /bench:{region} -->"
    if start not in text or end not in text:
        raise SystemExit(f"{doc}: no {start} ... {end} region")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


def dumps(payload: dict[str, Any]) -> str:
    """The results as JSON text: indented, except one line per round (the files stay small)."""
    rounds = payload.get("rounds", [])
    head = dumps_json({**payload, "rounds": []}, indent=1, default=str)
    lines = ",\n".join("  " + dumps_json(r, default=str) for r in rounds)
    return head.replace('"rounds": []', '"rounds": [\n' + lines + "\n ]", 1) + "\n"


def one_line_error(exc: BaseException) -> str:
    """``exc`` as one line for ``PROG: error: ...`` (:func:`aioexperts.cli._common.error_text`, its
    first line; the exception's type when it has no message)."""
    text = error_text(exc)
    return text.splitlines()[0] if text else type(exc).__name__
