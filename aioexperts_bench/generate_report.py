"""Tables of ``--mode generate`` results: printed by the bench, rendered into README and docs/bench.md.

:func:`render_markdown` turns one or more results files (e.g. the spread and the skewed model) into
the text between ``<!-- bench:generate -->`` and ``<!-- /bench:generate -->``; :func:`render_into`
replaces that region of a document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .machine import machine_label

__all__ = ("REGION", "load_generate_results", "merge_results", "render_into", "render_markdown", "text_report")

#: The region's name: ``<!-- bench:generate-headline -->`` ... ``<!-- /bench:generate-headline -->``
#: (a hyphenated name, which bench/render.py's regions leave alone).
REGION = "generate-headline"
_PATTERN = re.compile(r"(<!-- bench:generate-headline -->\n)(.*?)(<!-- /bench:generate-headline -->)", re.DOTALL)


def load_generate_results(path: str | Path) -> dict[str, Any]:
    """A results file of ``--mode generate``.

    Raises:
        OSError: the file cannot be read (FileNotFoundError: there is none).
        ValueError: another kind of file (not UTF-8 JSON, not an object, another schema), naming it.
    """
    raw = Path(path).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        what = "a results file of aioexperts-bench --mode generate"
        raise ValueError(f"{path} is not {what} (not JSON: {exc})") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("aioexperts-bench-generate/"):
        raise ValueError(f"{path} is not a results file of aioexperts-bench --mode generate")
    return data


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gb(value: Any) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


def _statuses(row: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for s in row["statuses"]:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{n}x {s}" for s, n in counts.items())


def _table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| limit | engine | runs | decode tok/s | p5 / p50 / p95 ms | prefill tok/s (cold) | TTFT s "
        "| major faults/token "
        "| device MB/token | peak RSS GB | page cache GB | hit rate (prefetched count) | slab GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        lines.append(  # noqa: PERF401 - one row per line of the table
            f"| {row['limit']} | {row['engine']} | {_statuses(row)} | {_f(row['decode_tok_s'], '.3f')} | "
            f"{_f(row['p5_ms'], '.0f')} / {_f(row['p50_ms'], '.0f')} / {_f(row['p95_ms'], '.0f')} | "
            f"{_f(row['prefill_tok_s'], '.1f')}{_cold(row)} | {_f(row['ttft_seconds'], '.1f')} | "
            f"{_f(row['major_faults_per_token'], '.0f')} | {_mb(row['device_bytes_per_token'])} | "
            f"{_gb(row['peak_rss_bytes'])} | {_gb(row['page_cache_bytes'])} | "
            f"{_f(row['hit_rate'], '.2f')} | {_gb(row['slab_bytes'])} |"
        )
    return lines


def _cold(row: dict[str, Any]) -> str:
    """`` (cold X)`` when the engine was warmed first and its cold prefill reported apart."""
    cold = row.get("cold_prefill_tok_s")
    return "" if cold is None else f" ({cold:.1f})"


def _sources_table(results: dict[str, Any]) -> list[str]:
    """Where aioexperts' decode tokens waited and where their experts came from (issue 36), per
    decode token; no lines for results files written before these figures existed. The column of
    prefetches read from the low tier only where a row has it (results of runs since it existed)."""
    rows = [r for r in results["summary"] if r.get("stall_ms_per_token") is not None]
    if not rows:
        return []
    low_prefetch = any(r.get("low_tier_prefetch_hits_per_token") is not None for r in rows)
    said = "of the prefetched, those read from the low tier; " if low_prefetch else ""
    column = " prefetched low tier |" if low_prefetch else ""
    lines = [
        "Per decode token (aioexperts): the stall on reads, the experts by source (cached: resident "
        "before the token asked; prefetched in time; prefetched late: the pass waited; "
        f"{said}demand misses, of them from the low tier), expert bytes read, the device rate while reads were "
        "in flight.",
        "",
        f"| limit | engine | stall ms/token | cached | prefetched in time | prefetched late |{column} demand misses "
        "(low tier) | expert MB/token | device GB/s while reading |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if low_prefetch else ""),
    ]
    for row in rows:
        low = f" {_f(row.get('low_tier_prefetch_hits_per_token'), '.0f')} |" if low_prefetch else ""
        lines.append(  # noqa: PERF401 - one row per line of the table
            f"| {row['limit']} | {row['engine']} | {_f(row['stall_ms_per_token'], '.0f')} | "
            f"{_f(row['cached_hits_per_token'], '.0f')} | {_f(row['prefetched_in_time_per_token'], '.0f')} | "
            f"{_f(row['prefetched_late_per_token'], '.0f')} |{low} {_f(row['demand_misses_per_token'], '.0f')} "
            f"({_f(row['low_tier_misses_per_token'], '.0f')}) | {_mb(row['expert_bytes_per_token'])} | "
            f"{_gb(row['device_bytes_per_second'])} |"
        )
    return lines


def _round_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    by_limit: dict[str, list[dict[str, Any]]] = {}
    for r in results["rounds"]:
        by_limit.setdefault(r["limit"], []).append(r)
    for limit, rounds in by_limit.items():
        parts = []
        for r in rounds:
            if r.get("decode_ratio") is None:
                ours = [
                    x.get("decode_tok_s")
                    for x in results["runs"]
                    if (x["engine"], x["limit"], x["round"]) == ("aioexperts", limit, r["round"])
                ]
                llama = ", ".join(f"{e} {s}" for e, s in (r.get("llama_statuses") or {}).items()) or "not run"
                rate = _f(ours[0] if ours else None, ".3f")
                parts.append(f"round {r['round'] + 1}: no ratio: {llama}; aioexperts {rate} tok/s")
                continue
            agree = ", ".join(
                f"{a['agree']}/{a['compared']} vs {engine}" for engine, a in (r.get("agreement") or {}).items() if a
            )
            pipeline = ""
            if r.get("pipeline_ratio") is not None:
                p = r["pipeline_ratio_parts"]
                pipeline = (
                    f"; decode / max(I/O, compute) {r['pipeline_ratio']:.2f} ({p['decode_s'] * 1e3:.0f} ms against "
                    f"I/O {p['io_s'] * 1e3:.0f} ms at fio's {r['fio']['gb_s']:.2f} GB/s, "
                    f"compute {p['compute_s'] * 1e3:.0f} ms)"
                )
            parts.append(
                f"round {r['round'] + 1}: decode {r['decode_ratio']:.2f}x, p95 {_f(r.get('p95_ratio'), '.3f')}x "
                f"of {r['baseline']}; greedy tokens agree {agree}{pipeline}"
            )
        lines.append(f"- limit {limit}: " + "; ".join(parts))
    return lines


def _target_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for t in results.get("targets", []):
        if t["threshold"] is None:
            gb = ", ".join(f"{v / 1e9:.2f} GB" for v in t["per_round"])
            lines.append(f"- {t['what']}: **{t['verdict']}** (slabs {gb})")
            continue
        values = ", ".join("-" if v is None else f"{v:.3g}" for v in t["per_round"])
        fits = " (llama.cpp's working set fits: the 0.7x bar)" if t.get("llama_fits") else ""
        if t["what"] == "outside":
            lines.append(
                f"- under {t['limit']}: share of a decode token spent outside compiled fan-outs (a fan-out counts "
                f"its kernels and the wait for its helpers) {t['op']} {t['threshold']:g}: per round {values}: "
                f"**{t['verdict']}**"
            )
            continue
        lines.append(
            f"- under {t['limit']}: {t['what']} ratio {t['op']} {t['threshold']:g}{fits}: per round {values}: "
            f"**{t['verdict']}**"
        )
    return lines


def _distinct_line(results: dict[str, Any]) -> str | None:
    rows = [r for r in results["summary"] if r.get("distinct_experts_min_mean_max")]
    if not rows:
        return None
    parts = [
        f"{r['limit']}: {r['distinct_experts_min_mean_max'][0]}-{r['distinct_experts_min_mean_max'][2]} "
        f"(mean {r['distinct_experts_min_mean_max'][1]:.0f})"
        for r in rows
    ]
    return "distinct experts touched per layer during decode (aioexperts): " + "; ".join(parts)


def _tier_line(results: dict[str, Any]) -> str | None:
    """The miss tier against the full-precision aioexperts, per round (issue 36; random weights)."""
    rounds = [r for r in results["rounds"] if r.get("tier_agreement") or r.get("tier_decode_ratio")]
    if not rounds:
        return None
    parts = []
    for r in rounds:
        agree = r.get("tier_agreement")
        parts.append(
            f"{r['limit']} round {r['round'] + 1}: decode {_f(r.get('tier_decode_ratio'), '.2f')}x"
            + (f", greedy tokens agree {agree['agree']}/{agree['compared']}" if agree else "")
        )
    return "the miss tier (aioexperts-tier) against aioexperts (random weights): " + "; ".join(parts)


def _split_line(results: dict[str, Any]) -> str | None:
    runs = [
        r for r in results["runs"] if r["engine"] == "aioexperts" and r["limit"] == "none" and r.get("seconds_per_part")
    ]
    if not runs:
        return None
    n = sum(r["tokens_decoded"] for r in runs)
    total = sum(sum(r["token_seconds"]) for r in runs)
    parts = {k: sum(r["seconds_per_part"][k] for r in runs) for k in runs[0]["seconds_per_part"]}
    other = total - sum(parts.values())
    shown = ", ".join(f"{k} {v / n * 1e3:.1f}" for k, v in parts.items()) + f", other {other / n * 1e3:.1f}"
    fanned = [
        r["fan_out_ms_per_token"] * r["tokens_decoded"] for r in runs if r.get("fan_out_ms_per_token") is not None
    ]
    if len(fanned) == len(runs):
        inside = sum(fanned) / 1e3
        shown += (
            f"; in compiled fan-outs {inside / n * 1e3:.0f} ({inside / total:.0%}), outside them "
            f"{(total - inside) / n * 1e3:.0f} ({1 - inside / total:.0%}: Python, numpy, BLAS, "
            "the compiled norms and RoPE, one-item products)"
        )
    return f"where an uncapped aioexperts decode token goes (ms per token): {shown}"


def _commit(commit: str | None) -> str:
    return f"aioexperts {commit[:10]}{'+dirty' if commit.endswith('+dirty') else ''}" if commit else ""


def _versions(machine: dict[str, Any], *, commit: bool = True) -> str:
    llama = machine.get("llama_cpp_python")
    shown = [_commit(machine.get("aioexperts_commit")) if commit else ""]
    shown.append(f"llama-cpp-python {llama}" if llama else "")
    return "".join(f"; {x}" for x in shown if x)


def _parameters(results: dict[str, Any]) -> tuple[str, list[str]]:
    """The run parameters: one phrase for one file, else one line per merged file."""
    params, m = results["parameters"], results["machine"]
    parts = results.get("parts") or []
    if len(parts) <= 1:
        return (
            f"{params['rounds']} round{'s' if params['rounds'] != 1 else ''}, prompt {params['prompt_tokens']} tokens, "
            f"{params['decode_tokens']} decode tokens per run, {params['threads']} threads" + _versions(m)
        ), []
    lines = [
        f"- limits {', '.join(p['limits'] or [])}: {p['rounds']} round{'s' if p['rounds'] != 1 else ''}, "
        f"prompt {p['prompt_tokens']} tokens, "
        f"{p['decode_tokens']} decode tokens per run; {_commit(p['aioexperts_commit']) or 'commit unknown'}; "
        f"started {p['date']}"
        for p in parts
    ]
    return f"{params['threads']} threads" + _versions(m, commit=False), [*lines, ""]


def text_report(results: dict[str, Any]) -> str:
    """The tables and verdicts of one results file, as Markdown."""
    m = results["machine"]
    load = m.get("load_average_at_start"), m.get("load_average_at_end")
    phrase, per_part = _parameters(results)
    head = [
        f"**{results['model']['name']}** ({results['model']['bytes'] / 1e9:.1f} GB), {results['date']}, "
        f"{machine_label(m)}; load average {_load(load[0])} at start, {_load(load[1])} at end; "
        f"{phrase}.",
        "",
        *per_part,
    ]
    body = [*head, *_table(results), ""]
    sources = _sources_table(results)
    if sources:
        body += [*sources, ""]
    body += _round_lines(results)
    for extra in (_distinct_line(results), _split_line(results), _tier_line(results)):
        if extra:
            body.append(f"- {extra}")
    body += [
        "",
        "Targets (issues 20, 33, 36; ratios to llama.cpp's best setting that decoded, or shares of a token):",
        *_target_lines(results),
    ]
    body += [f"- note: {n}" for n in results.get("notes", [])]
    if results.get("complete") is False:
        body.append(
            "- note: a bench was stopped by its time limit before its last round: these are the rounds it finished"
        )
    return "\n".join(body) + "\n"


def _load(values: Any) -> str:
    return "?" if not values else "/".join(f"{v:.1f}" for v in values)


def _without_unfinished_round(part: dict[str, Any]) -> dict[str, Any]:
    """A file of a stopped bench without the runs of the round it did not finish."""
    engines = part.get("parameters", {}).get("engines")
    if part.get("complete", True) or not engines or not part["runs"]:
        return part
    last = (part["runs"][-1]["limit"], part["runs"][-1]["round"])
    runs = [r for r in part["runs"] if (r["limit"], r["round"]) == last]
    if len(runs) == len(engines):
        return part
    return {**part, "runs": [r for r in part["runs"] if (r["limit"], r["round"]) != last]}


#: a round's figures taken from its own file as they are (they need that file's no-limit runs or fio)
_KEPT = ("fio", "pipeline_ratio", "pipeline_ratio_parts", "tier_pipeline_ratio", "tier_pipeline_ratio_parts")


def _prompt(part: dict[str, Any]) -> int:
    return int(part.get("parameters", {}).get("prompt_tokens") or 0)


TIER_ENGINE = "aioexperts-tier"


def _tier_policy(part: dict[str, Any]) -> str:
    """The miss tier's policy of a results file in a few words (what may differ between files)."""
    tier = part.get("parameters", {}).get("miss_tier") or {}
    words = [
        "upgrades" if tier.get("upgrade") else "no upgrades",
        "demand misses only" if tier.get("prefetches") is False else "",
        f"weight < {tier['max_gate_weight']}" if tier.get("max_gate_weight") is not None else "",
        f"behind > {tier['behind_seconds']} s" if tier.get("behind_seconds") is not None else "",
    ]
    return ", ".join(w for w in words if w)


def merge_results(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several results files of one model (e.g. one per limit, run at different times) as one.

    The runs are concatenated (the rounds of a limit numbered on across the files); the rounds'
    ratios, the summary and the targets are computed again from the runs. The machine is the first
    part's, the load averages the least and the most seen.
    """
    from .generate import _round_summary, evaluate_targets, summarize

    first = parts[0]
    merged = dict(first)
    merged["machine"] = dict(first["machine"])
    starts = [p["machine"].get("load_average_at_start") for p in parts]
    ends = [p["machine"].get("load_average_at_end") for p in parts]
    merged["machine"]["load_average_at_start"] = min((x for x in starts if x), default=None)
    merged["machine"]["load_average_at_end"] = max((x for x in ends if x), default=None)
    dates = sorted({p["date"] for p in parts})
    merged["date"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    merged["command"] = "; ".join(p["command"] for p in parts)
    merged["parts"] = [
        {
            **{k: p.get("parameters", {}).get(k) for k in ("limits", "rounds", "prompt_tokens", "decode_tokens")},
            "aioexperts_commit": p["machine"].get("aioexperts_commit"),
            "date": p["date"],
        }
        for p in parts
    ]
    merged["notes"] = list(dict.fromkeys(n for p in parts for n in p.get("notes", [])))
    merged["complete"] = all(p.get("complete", True) for p in parts)
    runs: list[dict[str, Any]] = []
    offset: dict[str, int] = {}  # rounds of a limit numbered on across the files
    kept: dict[tuple[str, int], dict[str, Any]] = {}  # a round's own figures (fio's rate, pipeline ratios)
    # the no-limit row compares one prompt length: the longest any part ran with no limit
    prompts = [_prompt(p) for p in parts if any(r["limit"] == "none" for r in p["runs"])]
    longest = max(prompts, default=0)
    policies = {_tier_policy(p) for p in parts if any(r["engine"] == TIER_ENGINE for r in p["runs"])}
    for p in parts:
        p = _without_unfinished_round(p)
        if len(policies) > 1 and (policy := _tier_policy(p)) != _tier_policy(parts[-1]):
            # another tier policy than the last part's: its own rows, not averaged with the others
            label = f"{TIER_ENGINE} ({policy})"
            p = {**p, "runs": [{**r, "engine": label} if r["engine"] == TIER_ENGINE else r for r in p["runs"]]}
            merged["notes"].append(f"{label}: the tier runs of a part with another policy than the last part's")
        if any(r["limit"] == "none" for r in p["runs"]) and _prompt(p) < longest:
            merged["notes"].append(
                f"the no-limit runs of a part with a {_prompt(p)}-token prompt are left out of the no-limit "
                f"row (it compares {longest}-token prompts); that part's limited rounds keep their figures"
            )
            p = {**p, "runs": [r for r in p["runs"] if r["limit"] != "none"]}
        if not p["runs"]:
            continue
        here = {r["limit"]: offset.get(r["limit"], 0) for r in p["runs"]}
        runs += [{**r, "round": r["round"] + here[r["limit"]]} for r in p["runs"]]
        for rnd in p.get("rounds", []):
            if rnd["limit"] in here:
                kept[rnd["limit"], rnd["round"] + here[rnd["limit"]]] = {k: v for k, v in rnd.items() if k in _KEPT}
        for limit, base in here.items():
            offset[limit] = base + 1 + max(r["round"] for r in p["runs"] if r["limit"] == limit)
    merged["runs"] = runs
    keys = list(dict.fromkeys((r["limit"], r["round"]) for r in runs))
    merged["rounds"] = [
        {
            "limit": limit,
            "round": rnd,
            **_round_summary([r for r in runs if (r["limit"], r["round"]) == (limit, rnd)]),
            **kept.get((limit, rnd), {}),
        }
        for limit, rnd in keys
    ]
    merged["summary"] = summarize(merged)
    merged["targets"] = evaluate_targets(merged)
    return merged


def render_markdown(all_results: Sequence[dict[str, Any]], sources: Sequence[str]) -> str:
    """The region's text for several results files: those of one model on one kind of CPU merged,
    one section per model and CPU (runs of two machines are never pooled into one table or target);
    a CPU is its model name and, where recorded, its vector ISA (AMD EPYCs here come with and without
    AVX-512) and the ISA the engines were limited to (an AVX2 run on an AVX-512 CPU is its own section)."""
    by_model: dict[tuple[str, str, str], list[tuple[dict[str, Any], str]]] = {}
    for results, source in zip(all_results, sources, strict=True):
        machine = results.get("machine", {})
        limits = machine.get("isa_limits") or {}
        isa = " ".join(str(part) for part in (machine.get("cpu_vector_isa"), *limits.values()) if part)
        key = (results["model"]["name"], str(machine.get("cpu_model", "")), isa)
        by_model.setdefault(key, []).append((results, source))
    out = [f"<!-- rendered by bench/generate.py --render {' '.join(sources)} -- DOCS; do not edit by hand -->"]
    for items in by_model.values():
        names = ", ".join(f"`{source}`" for _, source in items)
        out.append(f"From {names}:\n")
        out.append(text_report(merge_results([r for r, _ in items])))
    return "\n".join(out)


def render_into(doc: str | Path, all_results: Sequence[dict[str, Any]], sources: Sequence[str]) -> bool:
    """Replace the ``bench:generate`` region of ``doc``; False when it has no such region."""
    path = Path(doc)
    text = path.read_text()
    body = render_markdown(all_results, sources)
    new, n = _PATTERN.subn(lambda m: m.group(1) + body + m.group(3), text)
    if n == 0:
        return False
    path.write_text(new)
    return True
