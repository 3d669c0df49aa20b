"""PNG plots from a results dict (``aioexperts-bench --plot DIR``; needs ``pip install aioexperts[plot]``).

- ``reads_vs_depth.png``: read rate and CPU per GiB against queue depth (io_uring, threads, fio);
- ``reads_vs_size.png``: the same against read size at the bench's depth;
- ``token_timeline.png``: one pipelined token: reads per layer (submit to completion) and the
  compute step per layer, on one time axis, showing the overlap.

Each file is written to a temporary name and renamed, so an interrupted run leaves none half done.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from aioexperts import ConfigError

__all__ = ("PLOT_NAMES", "write_plots")

#: The files :func:`write_plots` may write into its directory.
PLOT_NAMES = ("reads_vs_depth.png", "reads_vs_size.png", "token_timeline.png")

_COLORS = {"io_uring": "tab:blue", "threads": "tab:orange", "fio": "tab:green"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'aioexperts[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=90)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def _series(points: dict[str, Any], method: str, key: str) -> tuple[list[float], list[float], list[list[float]]]:
    xs: list[float] = []
    ys: list[float] = []
    err: list[list[float]] = [[], []]
    for x, by in sorted(points.items(), key=lambda kv: int(kv[0])):
        if method in by and by[method][key]["median"] is not None:
            s = by[method][key]
            xs.append(int(x))
            ys.append(s["median"])
            err[0].append(s["median"] - s["min"])
            err[1].append(s["max"] - s["median"])
    return xs, ys, err


def _sweep_plot(plt: Any, sweep: dict[str, Any], which: str, title: str, xlabel: str, directory: str, name: str) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    points = sweep[which]
    scale = 1 if which == "depths" else 1024
    for ax, key, label in ((axes[0], "gb_per_s", "GB/s (1e9 B/s)"), (axes[1], "cpu_s_per_gib", "CPU s per GiB")):
        for method in ("io_uring", "threads", "fio"):
            xs, ys, err = _series(points, method, key)
            if xs:
                ax.errorbar([x / scale for x in xs], ys, yerr=err, marker="o", capsize=3, label=method,
                            color=_COLORS[method])  # fmt: skip
        if which == "sizes" and sweep.get("native", {}).get("io_uring"):
            s = sweep["native"]["io_uring"][key]
            ax.plot([sweep["native_size"] / scale], [s["median"]], "s", color=_COLORS["io_uring"], label="io_uring")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = _save(fig, directory, name)
    plt.close(fig)
    return path


def _timeline_plot(plt: Any, timeline: dict[str, Any], directory: str) -> str:
    fig, ax = plt.subplots(figsize=(10, 4))
    layers = sorted(
        {c["layer"] for c in timeline["compute"]} | {r["layer"] for r in timeline["reads"] if r["layer"] is not None}
    )
    row = {layer: i for i, layer in enumerate(layers)}
    for r in timeline["reads"]:
        if r["layer"] is None:
            continue
        y = row[r["layer"]] - 0.2
        ax.plot([r["start_ms"], r["end_ms"]], [y, y], color="tab:blue", alpha=0.35, linewidth=2)
    for c in timeline["compute"]:
        ax.barh(row[c["layer"]] + 0.15, c["end_ms"] - c["start_ms"], left=c["start_ms"], height=0.25,
                color="tab:red", alpha=0.8)  # fmt: skip
    ax.axvline(timeline["token_ms"], color="k", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    ax.set_xlabel("ms since the token started")
    ax.invert_yaxis()
    ax.plot([], [], color="tab:blue", linewidth=2, label="reads in flight (submit to completion)")
    ax.barh([], [], color="tab:red", label=f"compute ({timeline['synthetic_ms_per_layer']:.1f} ms synthetic step)")
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"one pipelined token ({timeline['token_ms']:.0f} ms): I/O per layer vs compute per layer")
    fig.tight_layout()
    path = _save(fig, directory, "token_timeline.png")
    plt.close(fig)
    return path


def write_plots(results: dict[str, Any], directory: str) -> list[str]:
    """Write every plot the results allow into ``directory``; returns the paths.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    out = []
    sweep = results.get("sweep")
    if sweep:
        out.append(_sweep_plot(plt, sweep, "depths", "cold reads against queue depth", "queue depth", directory,
                               "reads_vs_depth.png"))  # fmt: skip
        out.append(
            _sweep_plot(
                plt,
                sweep,
                "sizes",
                f"cold reads against read size (depth {sweep['depth_for_sizes']})",
                "read size (KiB)",
                directory,
                "reads_vs_size.png",
            )  # fmt: skip
        )
    timeline = (results.get("tokens") or {}).get("timeline")
    if timeline:
        out.append(_timeline_plot(plt, timeline, directory))
    return out
