"""Markdown tables of the satellite benches, from their results files (never typed by hand).

Each function takes the JSON object a bench script wrote and returns markdown; ``bench/render.py
--extra`` puts them between ``<!-- bench:NAME -->`` markers. Figures are medians with the range
(min-max) over the rounds, as the scripts print them; a missed target says "missed".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ("EXTRA",)


def _r(s: dict[str, float] | None, spec: str = ".2f", scale: float = 1.0) -> str:
    if not s:
        return "-"
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    return f"{med:{spec}} ({lo:{spec}}-{hi:{spec}})"


def _flat(s: dict[str, float], key: str, spec: str) -> str:
    """``median (min-max)`` of a summary whose keys are flat: ``KEY_median``, ``KEY_min``, ``KEY_max``."""
    return _r({"median": s[f"{key}_median"], "min": s[f"{key}_min"], "max": s[f"{key}_max"]}, spec)


def _met(value: float, target: float, *, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "met" if ok else "**missed**"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _where(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    date = results.get("started") or results.get("date", "?")
    cpu = m.get("cpu", "")
    cores = m.get("cores_available", m.get("cpus", "?"))
    cpu = f" {cpu}" if cpu else ""
    return f"_{date}, {cores} vCPU{cpu}, Linux {m.get('kernel', '?')}; {results.get('_source', '')}_"


def kernels(results: dict[str, Any]) -> str:
    p = results["parameters"]
    gguf_target, ggml_target = p["targets"]["x_gguf"], p["targets"]["x_ggml"]
    ggml = p.get("ggml", {})
    measured = bool(ggml.get("measured"))  # older files divided by typed figures: shown as unmeasured
    rows = []
    for key, e in results["summary"]["kernels"].items():
        qtype, shape = key.split()
        row = [qtype, shape, _r(e["gbps"]["float"])]
        for prec in ("float", "int8"):
            if prec == "int8":
                row.append(_r(e["gbps"].get("int8")))
            xg, xm = e.get(f"x_gguf_{prec}"), e.get(f"x_ggml_{prec}")
            row.append("-" if xg is None else f"{xg['median']:.1f} {_met(xg['median'], gguf_target, at_most=False)}")
            if prec not in e["gbps"]:
                row.append("-")
            elif not measured:
                row.append("unmeasured")
            else:
                row.append("-" if xm is None else f"{_r(xm)} {_met(xm['median'], ggml_target, at_most=False)}")
        row.append(_r(e["gbps"].get("ggml")) if measured else "unmeasured")
        rows.append(row)
    if measured:
        errors = [
            (k, a) for k, a in ((k, e.get("ggml_agreement")) for k, e in results["summary"]["kernels"].items()) if a
        ]
        worst = max(errors, key=lambda ka: ka[1]["vs_float"] / ka[1]["tolerance"], default=None)
        ggml_text = (
            f"x ggml: ggml's time over ours in the same round (ggml's own CPU mat-vec, `ggml_mul_mat` of the same "
            f"bytes by the same token, one thread, llama-cpp-python {ggml.get('llama_cpp_python', '?')}; built with "
            + (", ".join(n for n, on in ggml.get("cpu_features", {}).items() if on) or "no SIMD features")
            + "), median (min-max) over rounds, target >= "
            f"{ggml_target:g}."
            + (
                ""
                if worst is None
                else f" Before timing, each ggml output was checked against the float kernel's: worst relative L2 "
                f"error {worst[1]['vs_float']:.2g} ({worst[0]}; tolerance {worst[1]['tolerance']:g}, from ggml's "
                "rounding of x to 8 bits or 16)."
            )
        )
    else:
        ggml_text = f"x ggml unmeasured: {ggml.get('reason', 'this results file predates the same-run measurement')}."
    batches = p.get("batches", [4, 16, 64, 256])
    more = []
    for key, e in results["summary"]["kernels"].items():
        qtype, shape = key.split()
        cold = e["gbps"].get("cold")
        more.append(
            [
                qtype,
                shape,
                "-" if cold is None else f"{cold['median']:.2f}",
                "-" if "x_numpy_float" not in e else f"{e['x_numpy_float']['median']:.1f}",
                "/".join(
                    f"{e[f'batch{n}_speedup']['median']:.1f}" if f"batch{n}_speedup" in e else "-" for n in batches
                ),
                "-"
                if "exact_gelems" not in e
                else f"{e['exact_gelems']['median']:.2f} ({e['exact_speedup']['median']:.1f})",
            ]
        )
    m = results.get("machine", {})
    if "load_average_start" in m and "load_average" in m:
        ggml_text += (
            f" Load average (1 min) {m['load_average_start'][0]:.1f} at the start, {m['load_average'][0]:.1f} at "
            f"the end, on {m.get('cores_available', '?')} cores shared with other work: the ratios, taken per round, "
            "are steadier than the GB/s."
        )
    return (
        f"Fused one-token kernels, one thread, GB/s of weight bytes; x gguf-py target >= {gguf_target:g}. "
        f"{ggml_text} {_where(results)}\n\n"
        + _table(
            ["type", "shape", "float GB/s", "x gguf", "x ggml", "int8 GB/s", "x gguf", "x ggml", "ggml GB/s"],
            rows,
        )
        + "\n\nThe same kernels, medians: the float kernel on weights in DRAM (cold GB/s), and speed-ups over the "
        "numpy kernels + BLAS for one token, for batches of "
        + "/".join(map(str, batches))
        + " tokens, and for exact dequantization (1e9 values/s, x numpy in brackets).\n\n"
        + _table(
            ["type", "shape", "cold GB/s", "x numpy", "batch " + "/".join(map(str, batches)) + " x numpy", "exact"],
            more,
        )
    )


def kernels_compile(results: dict[str, Any]) -> str:
    t = results["parameters"]["targets"]
    rows = []
    for key, e in results["summary"].get("compile", {}).items():
        cold = key.endswith("cold")
        target = t["cold_compile_s"] if cold else t["warm_start_s"]
        verdict = (
            f"<= {target:g} s: {_met(e['total_s']['median'], target, at_most=True)}"
            if "model" in key
            else "information"
        )
        rows.append(
            [key, _r(e["total_s"]), f"{e['kernels']} ({e['compiled']} compiled, {e['loaded']} loaded)", verdict]
        )
    return f"First use in a fresh process (import + warm-up), seconds. {_where(results)}\n\n" + _table(
        ["kernels of", "seconds", "kernels", "target"], rows
    )


def token_compute(results: dict[str, Any]) -> str:
    s, p = results["summary"], results["parameters"]
    t = p["targets"]
    rows = [["I/O only", _r(s["io_ms_per_token"], ".1f"), "-", "-"]]
    for threads in p["threads"]:
        e = s[f"threads_{threads}"]
        rows.append(
            [
                f"compute, {threads} thread(s)",
                _r(e["compute_ms_per_token"], ".1f"),
                f"x I/O {_r(e['compute_over_io'])}",
                f"<= {t['compute_over_io']}: "
                + _met(e["compute_over_io"]["median"], t["compute_over_io"], at_most=True),
            ]
        )
        rows.append(
            [
                f"pipelined, {threads} thread(s)",
                _r(e["pipelined_ms_per_token"], ".1f"),
                f"x max(I/O, compute) {_r(e['pipelined_over_max'])}",
                f"<= {t['pipelined_over_max']}: "
                + _met(e["pipelined_over_max"]["median"], t["pipelined_over_max"], at_most=True),
            ]
        )
    return (
        f"Built-in model, {p['tokens']} tokens of uniform random routing, 0 % reuse, {p['repeat']} rounds; "
        f"ms per token. {_where(results)}\n\n" + _table(["", "ms/token", "ratio", "target"], rows)
    )


def concurrency(results: dict[str, Any]) -> str:
    p = results["parameters"]
    rows = [
        [
            name,
            _r(e["sequential_ms_per_token"], ".1f"),
            _r(e["concurrent_ms_per_token"], ".1f"),
            _r(e["ratio"]),
            f"<= {p['target']}: {_met(e['ratio']['median'], p['target'], at_most=True)}",
        ]
        for name, e in results["summary"].items()
    ]
    return (
        f"{p['tokens']} tokens at once against one after another (every expert resident, compute pool of "
        f"{p['pool_threads']} threads), ms per token. {_where(results)}\n\n"
        + _table(["kernels", "one after another", "16 at once", "at once / one after another", "target"], rows)
    )


def split(results: dict[str, Any]) -> str:
    mib = results["parameters"]["expert_bytes"] / 2**20
    rows = [
        [
            k,
            _flat(s, "ms", ".1f"),
            _flat(s, "x_whole", ".2f"),
        ]
        for k, s in results["summary_ms"].items()
    ]
    return (
        f"One cold {mib:.1f} MiB expert, read whole or in chunks submitted together; "
        f"{results['parameters']['rounds']} rounds, a never-read expert each time. {_where(results)}\n\n"
        + _table(["chunk", "latency ms", "x whole (per round)"], rows)
    )


def rows(results: dict[str, Any]) -> str:
    p = results["parameters"]
    out = [
        [
            n,
            _flat(s, "rows_per_s", ".0f"),
            f"{s['bytes_per_useful_byte_median']:.1f}",
        ]
        for n, s in results["summary"].items()
    ]
    return (
        f"Random rows of a {p['n_rows']}-row table of {p['row_bytes']}-byte Q2_K rows, {p['calls']} calls per run, "
        f"{p['rounds']} rounds, a fresh store (cold row cache) per run. {_where(results)}\n\n"
        + _table(["rows per call", "rows/s", "bytes read per useful byte"], out)
    )


def pagecache(results: dict[str, Any]) -> str:
    p = results["parameters"]
    out = [
        [
            key,
            _flat(s, "gb_per_s", ".2f"),
            f"{s['resident_after_bytes_median'] / 1e9:.2f}",
        ]
        for key, s in results["summary"].items()
    ]
    return (
        f"Built-in model, {p['tokens']} tokens of uniform random top-8 per pass, every page of every expert "
        f"touched; {p['rounds']} round{'s' if p['rounds'] != 1 else ''}; GB = 1e9 bytes. {_where(results)}\n\n"
        + _table(["mode / pass", "payload GB/s", "model GB in the page cache after"], out)
    )


def pagecache_limited(results: dict[str, Any]) -> str:
    lim = results["memory_limited"]
    if "skipped" in lim:
        return f"Memory-limited run skipped: {lim['skipped']}"
    out = []
    for mode, e in lim.items():
        if mode == "limit_bytes":
            continue
        if "error" in e:
            out.append([mode, "error: " + " ".join(e["error"]), "", ""])
            continue
        passes = e["passes"]
        out.append(
            [
                mode,
                f"{passes[0]['gb_per_s']:.2f}",
                f"{passes[1]['gb_per_s']:.2f}",
                f"{e['failcnt']}",
            ]
        )
    return (
        f"Two passes over every expert of the built-in model (2.7 GB) in a cgroup limited to "
        f"{lim['limit_bytes'] >> 20} MiB (page cache charged to it). {_where(results)}\n\n"
        + _table(["mode", "pass 1 GB/s", "pass 2 GB/s", "memory.failcnt"], out)
    )


def soak(results: dict[str, Any]) -> str:
    p = results["parameters"]
    samples = results["samples"]
    last = samples[-1]
    verdict = "flat" if results["rss_flat"] and results["fds_flat"] else "**growing**"
    return (
        f"`moe()` from {p['tasks']} tasks with random cancellations and timeouts for {float(p['minutes']):g} minutes "
        f"({last['done']} layer calls done, {last['cancelled']} cancelled). {_where(results)}\n\n"
        + _table(
            ["", "first quarter (max)", "last quarter (max)", "verdict"],
            [
                [
                    "RSS MiB",
                    f"{results['rss_first_quarter_max_bytes'] / 2**20:.1f}",
                    f"{results['rss_last_quarter_max_bytes'] / 2**20:.1f}",
                    verdict,
                ],
                ["open descriptors", f"{results['fds_first']}", f"{results['fds_last']}", verdict],
            ],
        )
    )


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def accuracy(results: dict[str, Any]) -> str:
    p = results["parameters"]
    rows = [
        [
            name,
            "yes" if e["verified"] else "no",
            "yes" if all(e[prec]["ids_exact"] for prec in p["precisions"]) else "**no**",
            *(_e(e[prec]["moe_out_rel_l2"]) for prec in p["precisions"]),
        ]
        for name, e in results["summary"].items()
    ]
    return (
        f"Worst relative L2 error of `moe_out` against llama.cpp's over each fixture's MoE layers, through "
        f"`MoERunner.moe_result` ({p['kernels']} kernels), per precision of the one-token kernels. {_where(results)}"
        "\n\n"
        + _table(
            ["fixture", "routing verified", "ids exact", *(f"{prec} `moe_out` rel L2" for prec in p["precisions"])],
            rows,
        )
    )


def accuracy_detail(results: dict[str, Any]) -> str:
    rows = [
        [
            name,
            ", ".join(map(str, e["layers"])),
            "yes" if e["float"]["ids_exact"] else "**no**",
            _e(e["float"]["weights_max_abs"]),
            _e(e["float"]["moe_out_rel_l2"]),
            _e(e["float"]["shared_out_rel_l2"]),
        ]
        for name, e in results["summary"].items()
    ]
    return (
        "Default (float) precision, worst over each fixture's MoE layers: routing weights' largest absolute "
        f"error, relative L2 error of `moe_out` and `shared_out` against llama.cpp's. {_where(results)}\n\n"
        + _table(
            ["fixture", "layers", "ids exact", "weights max abs err", "`moe_out` rel L2", "`shared_out` rel L2"], rows
        )
    )


#: region name -> (committed results file, renderer)
EXTRA: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "kernels": ("docs/results/kernels.json", kernels),
    "kernelscompile": ("docs/results/kernels.json", kernels_compile),
    "tokencompute": ("docs/results/token_compute.json", token_compute),
    "concurrency": ("docs/results/concurrency.json", concurrency),
    "split": ("docs/results/split-reads.json", split),
    "rows": ("docs/results/rows.json", rows),
    "pagecache": ("docs/results/pagecache.json", pagecache),
    "pagecachelimited": ("docs/results/pagecache.json", pagecache_limited),
    "soak": ("docs/results/soak.json", soak),
    "accuracy": ("docs/results/accuracy.json", accuracy),
    "accuracydetail": ("docs/results/accuracy.json", accuracy_detail),
}
