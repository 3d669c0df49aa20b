"""Tables from a results dict, for the terminal (rich) and for the docs (markdown).

Both renderings come from the same :class:`Section` list, built only from the results file, so
the tables in README.md and docs/bench.md are exactly what ``aioexperts-bench`` printed.
Figures are medians with the range (min-max) over the rounds; ratios are per round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from .machine import machine_label

__all__ = ("SECTIONS", "Section", "build_sections", "markdown", "print_sections")

#: Section names, as used in the docs' marked regions ``<!-- bench:NAME -->``.
SECTIONS = ("header", "reads", "warm", "tokens", "executor", "targets", "loops", "summary")


@dataclass
class Section:
    """One table: a short title (under 80 columns), headers, rows, and notes printed below."""

    name: str
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def _fmt(value: dict[str, Any] | None, spec: str = ".2f") -> str:
    if not value or value.get("median") is None:
        return "-"
    med, low, high = value["median"], value.get("min"), value.get("max")
    if low is None or high is None or value.get("n", 1) <= 1 or low == high:
        return format(med, spec)
    return f"{med:{spec}} ({low:{spec}}-{high:{spec}})"


def _spread(values: list[float]) -> dict[str, Any] | None:
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return {"median": median, "min": xs[0], "max": xs[-1], "n": len(xs)}


def _per_round_ratio(rounds: list[dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    return _spread(
        [
            r["cold"][num]["gb_per_s"] / r["cold"][den]["gb_per_s"]
            for r in rounds
            if num in r["cold"] and den in r["cold"] and r["cold"][den].get("gb_per_s")
        ]
    )


def _kernels(results: dict[str, Any]) -> str:
    """Which kernels the executor ran, as the results file recorded it (older files did not)."""
    k = results.get("kernels")
    if not k:
        return "numba kernels, numpy fallback; which served is not recorded in this results file"
    if k.get("backend") == "numba":
        return f"numba kernels, {k.get('precision', 'float')} precision"
    return f"numpy kernels ({k.get('reason') or 'the fallback'})"


def _header(results: dict[str, Any]) -> Section:
    machine = results.get("machine", {})
    model = results.get("model", {})
    rows = [
        ["date (UTC)", str(results.get("date", "?"))],
        ["machine", machine_label(machine)],
        ["aioexperts", str(results.get("aioexperts"))],
        ["model", f"{model.get('name')} ({model.get('bytes', 0) / 1e9:.2f} GB, {model.get('experts')} experts)"],
        ["command", str(results.get("command"))],
        ["event loop", str(results.get("parameters", {}).get("loop"))],
        *([["executor", _kernels(results)]] if results.get("kernels") else []),
        ["load average at start", ", ".join(f"{x:.2f}" for x in machine.get("load_average_at_start", []))],
    ]
    if machine.get("load_average_at_end"):
        rows.append(["load average at end", ", ".join(f"{x:.2f}" for x in machine["load_average_at_end"])])
    if results.get("note"):
        rows.append(["note", str(results["note"])])
    notes = [f"units: {', '.join(f'{k} = {v}' for k, v in results.get('units', {}).items() if k in ('GB', 'GiB'))}"]
    notes += results.get("warnings", [])
    return Section("header", "aioexperts bench run", ["", ""], rows, notes)


def _reads(reads: dict[str, Any]) -> list[Section]:
    rounds = reads["rounds"]
    n = reads["parameters"]["rounds"]
    rl = reads["read_list"]
    title = f"Cold reads, the same {rl['n_reads']} reads, {n} round{'s' if n > 1 else ''}: median (min-max)"
    headers = ["method", "GB/s", "CPU s/GiB", "bytes read", "memory", "x fio", "x mmap", "x threads"]
    rows = []
    failed = reads.get("failed") or {}
    for method, s in reads["summary"].items():
        memory = "-"
        passes = [r["cold"][method] for r in rounds if method in r["cold"]]
        if not passes and method in failed:
            rows.append([s["label"], "failed", *("-" for _ in headers[2:])])
            continue
        if passes:
            mem = passes[0].get("memory_bytes") or passes[0].get("slab_bytes")
            memory = "-" if not mem else f"{mem / 1e9:.2f} GB"
        rows.append(
            [
                s["label"],
                _fmt(s["gb_per_s"]),
                _fmt(s["cpu_s_per_gib"], ".3f"),
                " / ".join(str(b) for b in s["bytes_read"]),
                memory,
                _fmt(_per_round_ratio(rounds, method, "fio")) if method != "fio" else "1",
                _fmt(_per_round_ratio(rounds, method, "mmap")) if method != "mmap" else "1",
                _fmt(_per_round_ratio(rounds, method, "threads")) if method != "threads" else "1",
            ]
        )
    p = reads["parameters"]
    notes = [
        f"Work: the store's own reads of one cold pass ({rl['n_reads']} reads, {rl['bytes_requested']:,} bytes "
        f"requested, median {rl['median_read_bytes']:,} B), {p['experts_per_pass']} experts of uniform random "
        f"top-k routing; depth {p['depth']}; {p['n_threads']} threads for the thread pool and preadv; order "
        f"rotated each round.",
        f"Cold: {reads['drop_method']}, outside the timed and CPU-counted part.",
        "Ratios are per round (passes adjacent in time); CPU: user + system of the process per GiB read "
        "(fio: its own counters for the job).",
        "Memory: what the reads land in. fio has one buffer per I/O unit (iodepth x largest read); it has no "
        "option to read into more distinct memory.",
    ]
    ratios = reads.get("ratios", {})
    if ratios.get("fio_readv_x_fio"):
        notes.append(
            f"fio with readv (--nonvectored=0, the store's READV_FIXED) / fio's default READ_FIXED, per round: "
            f"{_fmt(ratios['fio_readv_x_fio'])}."
        )
    fio = next((r["cold"]["fio"] for r in rounds if "fio" in r["cold"]), None)
    if fio is not None and not fio.get("registered_files"):
        notes.append("fio ran without --registerfiles (fio refuses it with --read_iolog here).")
    for method, why in failed.items():
        label = reads["summary"].get(method, {}).get("label", method)
        notes.append(f"{label} failed and was left out of the rounds from then on: {why}")
    if fio is None and "fio" not in failed and not p.get("fio"):
        notes.append("fio was not installed: no fio replay, no ratios to fio.")
    if ratios.get("distinct_over_reused_memory"):
        notes.append(
            "Where reads land: the raw io_uring loop ran "
            f"{_fmt(ratios['distinct_over_reused_memory'])}x as fast into distinct memory as into {p['depth']} reused "
            "buffers (per round); fio always reads into reused buffers"
            + (
                f"; raw loop with reused buffers / fio: {_fmt(ratios['raw_reused_x_fio'])}."
                if ratios.get("raw_reused_x_fio")
                else "."
            )
        )
    mismatched = [
        r["round"] for r in rounds if "io_uring" in r["cold"] and not r["cold"]["io_uring"].get("same_reads_as_list")
    ]
    if mismatched:
        notes.append(f"The store's reads differed from the list in rounds {mismatched}.")
    probe = reads.get("host_cache")
    if probe:
        if probe.get("caveat"):
            notes.append("CAVEAT: " + probe["caveat"])
        else:
            fresh = probe.get("fresh_speedup")
            notes.append(
                f"Host-cache probe: an O_DIRECT re-read ran {probe['reread_speedup']:.2f}x the first read"
                + ("" if fresh is None else f", just-written data {fresh:.2f}x")
                + "; no sign of a cache below the guest."
            )
    return [Section("reads", title, headers, rows, notes)]


def _warm(results: dict[str, Any]) -> Section:
    warm = results["reads"].get("warm", {})
    store = warm.get("store", {})
    rows = []
    if store:
        rows.append(["experts(), 1 id", _fmt(store.get("experts_single_us_per_hit"), ".1f"),
                     _fmt(store.get("experts_single_us_per_hit"), ".1f"),
                     _fmt(store.get("experts_single_hits_per_s"), ",.0f"), "no"])  # fmt: skip
        rows.append(["experts(), top-k ids", _fmt(store.get("experts_topk_us_per_call"), ".1f"),
                     _fmt(store.get("experts_topk_us_per_hit"), ".1f"),
                     _fmt(store.get("experts_topk_hits_per_s"), ",.0f"), "no"])  # fmt: skip
        if store.get("moe_us_per_call"):
            rows.append(["moe() (executor)", _fmt(store.get("moe_us_per_call"), ",.0f"), "-",
                         _fmt(store.get("moe_hits_per_s"), ",.0f"), "no"])  # fmt: skip
    for method, label in (("pread", "buffered preadv, page cache"), ("mmap", "mmap copy, page cache")):
        w = warm.get(method)
        if w:
            rows.append([label, "-", _fmt(w["us_per_expert"], ",.0f"), _fmt(w["experts_per_s"], ",.0f"), "yes"])
    notes = [
        "Store: every expert resident in the slab; a hit pins a slot and hands out views, copying nothing, "
        f"so no GB/s. moe() includes routing and the executor's compute ({_kernels(results)}).",
        "preadv and mmap: a second replay of the list right after the cold one (page cache); per expert = "
        "3 reads copied.",
    ]
    headers = ["path", "us per call", "us per hit", "hits/s", "copies"]
    return Section("warm", "Warm hits: median (min-max) over the rounds", headers, rows, notes)


def _tokens(results: dict[str, Any]) -> list[Section]:
    tokens = results["tokens"]
    p = tokens["parameters"]
    rows = []
    for name, s in tokens["summary"].items():
        rows.append(
            [
                name,
                _fmt(s["ms_per_token"], ".1f"),
                _fmt(s["tokens_per_s"], ".2f"),
                _fmt(s["io_wait_ms_per_token"], ".1f"),
                _fmt(s["compute_ms_per_token"], ".1f"),
                _fmt({k: (v * 100 if isinstance(v, float) else v) for k, v in s["hit_rate"].items()}, ".0f"),
            ]
        )
    verdict = "met" if tokens.get("overlap_met") else "MISSED"
    notes = [
        f"overlap = pipelined / max(io only, compute only), per round: {_fmt(tokens['overlap'])}; "
        f"target <= {tokens['target_overlap']:g} (issue 12; 1.1 before): {verdict}.",
        f"serial / max(io, compute): {_fmt(tokens['serial_over_max'])} (2.0 = no overlap).",
        f"{p['tokens']} tokens of {p['routing']}; slab {p['slab_slots']} of {p['n_experts_total']} experts; "
        "synthetic compute calibrated each round to that round's io-only time per layer; compute only: "
        "all experts resident, same pipeline.",
    ]
    timeline = tokens.get("timeline", {})
    totals, loop_ms = timeline.get("phase_totals_ms"), timeline.get("loop_thread_ms")
    if totals and loop_ms:  # results files before the phases have none
        notes.append(
            f"timeline of pipelined token {timeline['token']} ({timeline['token_ms']:.1f} ms): route "
            f"{totals['route_ms']:.1f}, wait before compute {totals['wait_ms']:.1f} (for experts "
            f"{totals['io_wait_ms']:.1f}), compute {totals['compute_ms']:.1f}, hand-offs "
            f"{totals['handoff_ms']:.1f} ms; "
            f"loop thread: submit {loop_ms['submit_ms']:.1f} ms ({loop_ms['submit_calls']} calls), reap "
            f"{loop_ms['reap_ms']:.1f} ms ({loop_ms['reaps']} completions)."
        )
    headers = ["run", "ms/token", "tok/s", "I/O wait ms", "compute ms", "hit %"]
    sections = [
        Section(
            "tokens",
            f"Per token, {p['rounds']} round{'s' if p['rounds'] > 1 else ''}: median (min-max)",
            headers,
            rows,
            notes,
        )
    ]
    rows = []
    for fraction, s in tokens.get("executor", {}).items():
        rows.append(
            [
                f"{float(fraction):.0%}",
                str(s["slots"]),
                _fmt(s["tokens_per_s"], ".2f"),
                _fmt(s["ms_per_token"], ".0f"),
                _fmt(s["compute_ms_per_token"], ".0f"),
                _fmt(s["io_wait_ms_per_token"], ".1f"),
                _fmt({k: (v * 100 if isinstance(v, float) else v) for k, v in s["hit_rate"].items()}, ".0f"),
            ]
        )
    if rows:
        notes = [
            f"The model's MoE layers only, {p['executor_tokens']} tokens of random input per run, the model's "
            "router and the store's router prefetch; 0 % is the store's minimum slab (2 x top-k slots); 100 % "
            "loads every expert first.",
            f"The executor: {_kernels(results)}.",
        ]
        headers = ["slab", "slots", "tok/s", "ms/token", "compute ms", "I/O wait ms", "hit %"]
        sections.append(Section("executor", "The executor, tokens per second by slab size", headers, rows, notes))
    return sections


def _targets(results: dict[str, Any]) -> Section:
    rows = []
    for t in results.get("targets", []):
        met = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        rows.append([t["what"], f"{t['direction']} {t['limit']:g}", _fmt(t["value"], ".3g"), met])
    notes = ["Judged on the median of the per-round figures; the range is over the rounds."]
    return Section("targets", "Targets", ["target", "limit", "median (min-max)", "verdict"], rows, notes)


def _loops(results: dict[str, Any]) -> Section:
    rows = [[name, f"{v['yield_us']:.2f}", f"{v['task_event_us']:.1f}"] for name, v in results.get("loops", {}).items()]
    notes = ["yield: one `await anyio.lowlevel.checkpoint()`; task+event: start a task that sets an event, "
             "await it, join the task."]  # fmt: skip
    return Section("loops", "Cost of one await, per event loop (us)", ["loop", "yield", "task+event"], rows, notes)


def build_sections(results: dict[str, Any]) -> dict[str, Section]:
    """Every section the results allow, by name."""
    out: dict[str, Section] = {"header": _header(results)}
    if results.get("reads"):
        out["reads"] = _reads(results["reads"])[0]
        out["warm"] = _warm(results)
    if results.get("tokens"):
        for s in _tokens(results):
            out[s.name] = s
    if results.get("targets"):
        out["targets"] = _targets(results)
    if results.get("loops"):
        out["loops"] = _loops(results)
    return out


def _md_table(s: Section, with_title: bool = True) -> str:
    lines = []
    if with_title:
        lines += [f"**{s.title}**", ""]
    if s.name == "header":
        lines += [f"- {k}: {v}" for k, v in s.rows]
    else:
        lines.append("| " + " | ".join(s.headers) + " |")
        lines.append("|" + "|".join("---" for _ in s.headers) + "|")
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in s.rows]
    if s.notes:
        lines.append("")
        lines += [f"- {n}" for n in s.notes] if s.name != "header" else [f"- {n}" for n in s.notes]
    return "\n".join(lines)


def markdown(results: dict[str, Any], name: str) -> str:
    """The markdown of section ``name``; ``summary`` is the header, reads and targets together.

    Raises:
        KeyError: an unknown section, or one the results do not have.
    """
    sections = build_sections(results)
    if name == "summary":
        parts = [sections["header"], *(sections[k] for k in ("reads", "targets") if k in sections)]
        return "\n\n".join(_md_table(s) for s in parts)
    if name not in SECTIONS:
        raise KeyError(f"unknown section {name!r}; known: {', '.join(SECTIONS)}")
    return _md_table(sections[name])


def print_sections(results: dict[str, Any], console: Console) -> None:
    """Print every section as rich tables (titles as plain lines, so they never wrap in the table)."""
    for s in build_sections(results).values():
        console.print()
        console.print(f"[bold]{s.title}[/bold]")
        if s.name == "header":
            for k, v in s.rows:
                console.print(f"  {k}: {v}", highlight=False)
        else:
            table = Table(show_edge=True, pad_edge=False)
            for i, h in enumerate(s.headers):
                table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0, overflow="fold")
            for row in s.rows:  # the range under the median keeps the columns narrow
                table.add_row(*(c.replace(" (", "\n(", 1) if i else c for i, c in enumerate(row)))
            console.print(table)
        for n in s.notes:
            console.print(f"  {n}", style="dim", highlight=False)
