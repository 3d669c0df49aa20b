"""The picture of ``--mode timeline``: an SVG drawn by hand (no plotting library).

Time runs left to right over the first decode tokens. At the top: the tokens (alternating bands),
the device (time with at least one read in flight), and the forward pass (expert compute, stalls).
Below, two lanes per MoE layer: I/O (each expert load from submission to completion; demand reads
dark, prefetches light, speculative reads lighter, the time a load was queued before submission as a
thin line) and compute
(the layer step from its start to its last compute job's end as an outline, its compute jobs
filled, its stall in red).
"""

from __future__ import annotations

from html import escape
from typing import Any

import numpy as np

from .timeline import summary_line

__all__ = ("COLOURS", "render_svg")

COLOURS = {
    "demand": "#1f4e9c",
    "prefetch": "#7fb2e5",
    "speculative": "#b9d3ee",
    "queued": "#9a9a9a",
    "compute": "#f28e2b",
    "stall": "#d62728",
    "step": "#555555",
    "device": "#2c7fb8",
    "token_a": "#f4f4f4",
    "token_b": "#e6e6e6",
}

WIDTH = 1400
LEFT = 96
RIGHT = 16
LANE = 5
LAYER_GAP = 3
TOP_LANE = 10


def _col(table: dict[str, list[Any]], name: str) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in table.get(name, [])], np.float64)


def render_svg(results: dict[str, Any], tokens: int = 4) -> str:
    """The SVG text of the timeline of ``results`` (:func:`run_timeline_bench`'s), over its first
    ``tokens`` decode tokens; a picture that says so when nothing was recorded."""
    tl = results.get("timeline")
    title = f"aioexperts decode timeline: {escape(results['model']['name'])}"
    p = results.get("parameters", {})
    if not tl or not tl["tokens"]["start_ms"]:
        return _svg(120, [_text(LEFT, 30, title, 14, bold=True), _text(LEFT, 60, "no timeline was recorded", 12)])
    starts, ends = _col(tl["tokens"], "start_ms"), _col(tl["tokens"], "end_ms")
    k = max(1, min(tokens, int(np.sum(~np.isnan(ends)))))
    t0, t1 = float(starts[0]), float(ends[k - 1]) if not np.isnan(ends[k - 1]) else float(np.nanmax(ends))
    span = max(t1 - t0, 1e-6)
    plot_w = WIDTH - LEFT - RIGHT

    def x(ms: float) -> float:
        return LEFT + (min(max(ms, t0), t1) - t0) / span * plot_w

    s = results.get("summary") or {}
    run = results.get("run", {})
    header = [
        _text(LEFT, 22, title, 14, bold=True),
        _text(
            LEFT,
            40,
            f"{escape(str(p.get('engine', '')))}, memory limit {escape(str(p.get('limit_applied', '')))} of the model, "
            f"backend {escape(str(tl.get('backend')))}, {run.get('tokens_decoded', '?')} decode tokens "
            f"({k} drawn, {span:.0f} ms)",
            11,
        ),
        _text(LEFT, 56, escape(summary_line(s)), 11),
    ]
    parts: list[str] = []
    y = 72
    # tokens
    for i in range(k):
        fill = COLOURS["token_a"] if i % 2 == 0 else COLOURS["token_b"]
        parts.append(_rect(x(starts[i]), y, x(ends[i]) - x(starts[i]), TOP_LANE, fill))
        parts.append(_text(x(starts[i]) + 2, y + 8, f"token {i}", 8))
    parts.append(_text(4, y + 8, "tokens", 9))
    y += TOP_LANE + 4
    # device busy: the union of the reads' spans
    reads = tl["reads"]
    r_layer, r_kind = _col(reads, "layer"), _col(reads, "kind")
    r_q, r_s, r_d = _col(reads, "queued_ms"), _col(reads, "submitted_ms"), _col(reads, "done_ms")
    visible = (r_d >= t0) & (r_s <= t1)
    for a, b in _union(r_s[visible], r_d[visible]):
        parts.append(_rect(x(a), y, x(b) - x(a), TOP_LANE, COLOURS["device"]))
    parts.append(_text(4, y + 8, "device busy", 9))
    y += TOP_LANE + 4
    # the forward pass: expert compute and stalls
    steps, computes = tl["steps"], tl["computes"]
    s_layer, s_start, s_ready = _col(steps, "layer"), _col(steps, "start_ms"), _col(steps, "ready_ms")
    s_done, s_stall = _col(steps, "done_ms"), _col(steps, "stall_ms")
    c_layer, c_start, c_end = _col(computes, "layer"), _col(computes, "start_ms"), _col(computes, "end_ms")
    # a step's outline ends with its last compute job (its "done" also counts the caller's work the
    # executor ran in that job: in a Model, the next layer's attention)
    s_end = s_ready.copy()
    if len(c_end):
        np.fmax.at(s_end, _col(computes, "step").astype(np.int64), c_end)
    c_vis = (c_end >= t0) & (c_start <= t1)
    s_vis = (s_done >= t0) & (s_start <= t1)
    for a, b in zip(c_start[c_vis], c_end[c_vis], strict=True):
        parts.append(_rect(x(a), y, max(x(b) - x(a), 0.5), TOP_LANE, COLOURS["compute"]))
    for ready, stall in zip(s_ready[s_vis], s_stall[s_vis], strict=True):
        if stall > 0:
            parts.append(_rect(x(ready - stall), y, max(x(ready) - x(ready - stall), 0.5), TOP_LANE, COLOURS["stall"]))
    parts.append(_text(4, y + 8, "forward pass", 9))
    y += TOP_LANE + 8
    # per layer: I/O lane, compute lane
    layers = tl.get("layers") or sorted({int(v) for v in s_layer})
    for layer in layers:
        parts.append(_text(4, y + LANE + 3, f"layer {layer}", 8))
        sel = visible & (r_layer == layer)
        for q, a, b, kind in zip(r_q[sel], r_s[sel], r_d[sel], r_kind[sel], strict=True):
            if not np.isnan(q) and a - q > 0:
                parts.append(_line(x(q), x(a), y + LANE / 2, COLOURS["queued"]))
            colour = COLOURS[("demand", "prefetch", "speculative")[min(int(kind), 2)]]
            parts.append(_rect(x(a), y, max(x(b) - x(a), 0.5), LANE, colour, opacity=0.45))
        yc = y + LANE + 1
        sel = s_vis & (s_layer == layer)
        for a, b, ready, stall in zip(s_start[sel], s_end[sel], s_ready[sel], s_stall[sel], strict=True):
            parts.append(_rect(x(a), yc, max(x(b) - x(a), 0.5), LANE, "none", stroke=COLOURS["step"]))
            if stall > 0:
                parts.append(_rect(x(ready - stall), yc, max(x(ready) - x(ready - stall), 0.5), LANE, COLOURS["stall"]))
        sel = c_vis & (c_layer == layer)
        for a, b in zip(c_start[sel], c_end[sel], strict=True):
            parts.append(_rect(x(a), yc, max(x(b) - x(a), 0.5), LANE, COLOURS["compute"]))
        y += 2 * LANE + 1 + LAYER_GAP
    # token boundaries and the time axis
    bottom = y + 2
    parts.extend(
        f'<line x1="{x(edge):.1f}" y1="72" x2="{x(edge):.1f}" y2="{bottom}" stroke="#888" '
        'stroke-width="0.5" stroke-dasharray="2,2"/>'
        for edge in [*starts[:k], *ends[:k]]
    )
    step = _tick_step(span)
    tick = np.ceil(t0 / step) * step
    while tick <= t1:
        parts.append(f'<line x1="{x(tick):.1f}" y1="{bottom}" x2="{x(tick):.1f}" y2="{bottom + 4}" stroke="#000"/>')
        parts.append(_text(x(tick) - 10, bottom + 15, f"{tick - t0:.0f}", 9))
        tick += step
    parts.append(_text(WIDTH - RIGHT - 40, bottom + 15, "ms", 9))
    legend_y = bottom + 32
    legend = [
        ("demand read", COLOURS["demand"]),
        ("prefetch read", COLOURS["prefetch"]),
        ("speculative read", COLOURS["speculative"]),
        ("device busy", COLOURS["device"]),
        ("expert compute", COLOURS["compute"]),
        ("stall (waiting for reads)", COLOURS["stall"]),
    ]
    lx = LEFT
    for label, colour in legend:
        parts.append(_rect(lx, legend_y - 8, 10, 8, colour))
        parts.append(_text(lx + 14, legend_y, label, 10))
        lx += 30 + 7 * len(label)
    parts.append(_line(lx, lx + 14, legend_y - 4, COLOURS["queued"]))
    parts.append(_text(lx + 18, legend_y, "queued before submission", 10))
    parts.append(_rect(lx + 200, legend_y - 8, 14, 8, "none", stroke=COLOURS["step"]))
    parts.append(_text(lx + 218, legend_y, "layer step (start to end)", 10))
    return _svg(legend_y + 12, header + parts)


def _union(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    order = np.argsort(starts, kind="stable")
    out: list[tuple[float, float]] = []
    for a, b in zip(starts[order].tolist(), ends[order].tolist(), strict=True):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _tick_step(span: float) -> float:
    raw = span / 10
    base = 10 ** np.floor(np.log10(raw))
    for m in (1, 2, 5, 10):
        if m * base >= raw:
            return float(m * base)
    return float(10 * base)


def _rect(
    x: float, y: float, w: float, h: float, fill: str, *, stroke: str | None = None, opacity: float | None = None
) -> str:
    extra = f' stroke="{stroke}" stroke-width="0.6"' if stroke else ""
    extra += f' fill-opacity="{opacity}"' if opacity is not None else ""
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{fill}"{extra}/>'


def _line(x1: float, x2: float, y: float, colour: str) -> str:
    return f'<line x1="{x1:.1f}" y1="{y:.1f}" x2="{x2:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-width="1"/>'


def _text(x: float, y: float, text: str, size: int, *, bold: bool = False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}"{weight}>{text}</text>'


def _svg(height: float, parts: list[str]) -> str:
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="sans-serif">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n'
    )
