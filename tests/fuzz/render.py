"""The long fuzz run's table in docs/fuzzing.md, rendered from its results file (never typed).

``python tests/fuzz/render.py docs/results/fuzz-2026-12-03.json docs/fuzzing.md`` rewrites the
region between ``<!-- fuzz:long-run -->`` and ``<!-- /fuzz:long-run -->``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- fuzz:long-run -->", "<!-- /fuzz:long-run -->"


def render(results: dict[str, Any], name: str) -> str:
    """The Markdown table of a ``run_long.py`` summary (``name``: the results file, for the heading)."""
    lines = [
        BEGIN,
        f"<!-- rendered by tests/fuzz/render.py from {name}; do not edit by hand -->",
        f"From `{name}` ({results['started']}, {results['machine']['cpus']} CPUs, nice {results['machine']['nice']}; "
        f"{results['inputs']:,} inputs in {results['elapsed_s']:.0f} s, {results['inputs_per_second']:.0f}/s; "
        f"peak RSS {results['peak_rss_bytes'] / 2**20:.0f} MiB):",
        "",
        "| door | inputs | inputs/s | unexpected | hangs | slowest wall / CPU s | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for door, s in results["doors"].items():
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(s["outcomes"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {door} | {s['inputs']:,} | {s['inputs_per_second']:.0f} | {s['unexpected_total']} | {s['hangs']} "
            f"| {s['slowest_input_s']:.2f} / {s['slowest_input_cpu_s']:.2f} | {outcomes} |"
        )
    mem = results["header_memory"]
    lines += [
        "",
        f"Header memory: {mem['samples']:,} samples, at most {mem['max_peak_bytes'] / 1024:.0f} KiB "
        f"(tracemalloc), {mem['violations']} above `{mem['bound']}`.",
        END,
    ]
    return "\n".join(lines)


def render_into(results_path: Path, doc: Path) -> str:
    """``doc``'s text with its region rendered from ``results_path``."""
    text = doc.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    name = results_path.as_posix()
    return text[:start] + render(json.loads(results_path.read_text()), name) + text[end:]


if __name__ == "__main__":
    results, target = Path(sys.argv[1]), Path(sys.argv[2])
    target.write_text(render_into(results, target))
