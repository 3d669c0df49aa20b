"""A timeline of decode tokens: when each expert read was queued, submitted and completed, and when
each MoE layer step started, had its experts, computed and ended (issue 36).

A :class:`Timeline` is a recorder of fixed size: preallocated float64 arrays filled row by row on the
event loop's thread (no object per event); once an array is full its later events are counted in
:attr:`Timeline.dropped` and not kept. It sits above the I/O backend (the read scheduler writes a row
as a load completes, whatever backend read it: io_uring, the thread pool, a test's fake) and in the
local executor (a row per layer step, a row per compute job). Attach it with
:meth:`aioexperts.MoERunner.record_timeline`; the caller marks the tokens (:meth:`Timeline.begin_token`,
:meth:`Timeline.end_token`). Off (the default: no timeline attached) the store and the executor pay
one ``is None`` test per load and per layer step.

All times are ``time.perf_counter()`` seconds (the clock of ``time.perf_counter_ns`` too).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._checks import check_int

__all__ = ("COMPUTE_KINDS", "READ_KINDS", "Timeline", "busy_seconds")

#: read kinds: the load's priority when it completed (a prefetch someone waited for is ``demand``)
READ_KINDS = ("demand", "prefetch", "speculative")
#: compute job kinds: every expert of the step in one job after the reads, the resident experts
#: while the others were read (hits first), the read experts after them
COMPUTE_KINDS = ("all", "hits", "misses")

_READ_FIELDS = ("layer", "expert", "bytes", "kind", "queued", "submitted", "done")
_STEP_FIELDS = ("token", "layer", "calls", "experts", "misses", "start", "ready", "done", "stall")
_COMPUTE_FIELDS = ("step", "layer", "kind", "start", "end")
_TOKEN_FIELDS = ("start", "end")


class Timeline:
    """Records reads, layer steps, compute jobs and tokens into preallocated arrays (module docstring).

    Args:
        max_reads: expert loads kept at most (7 float64 each).
        max_steps: layer steps kept at most (9 float64 each); compute jobs: twice as many.
        max_tokens: tokens kept at most.

    Raises:
        ConfigError: a size that is not an int >= 1.

    Attributes:
        dropped: events not kept because their array was full.
    """

    def __init__(self, max_reads: int = 1 << 16, max_steps: int = 1 << 14, max_tokens: int = 1 << 12) -> None:
        self.max_reads, self.max_steps, self.max_tokens = max_reads, max_steps, max_tokens
        check_int(self, "max_reads", low=1)
        check_int(self, "max_steps", low=1)
        check_int(self, "max_tokens", low=1)
        self._reads = np.zeros((max_reads, len(_READ_FIELDS)), np.float64)
        self._steps = np.zeros((max_steps, len(_STEP_FIELDS)), np.float64)
        self._computes = np.zeros((2 * max_steps, len(_COMPUTE_FIELDS)), np.float64)
        self._tokens = np.zeros((max_tokens, len(_TOKEN_FIELDS)), np.float64)
        self._n_reads = self._n_steps = self._n_computes = self._n_tokens = 0
        self._token = -1  # the token being recorded (-1: between tokens)
        self.dropped = 0

    # -- recording (event loop thread) --------------------------------------------------------

    def begin_token(self) -> int:
        """A decode token's forward pass starts now; its index (layer steps until :meth:`end_token` carry it)."""
        i = self._n_tokens
        if i >= self.max_tokens:
            self.dropped += 1
            self._token = -1
            return -1
        self._tokens[i] = (time.perf_counter(), np.nan)
        self._n_tokens = i + 1
        self._token = i
        return i

    def end_token(self) -> None:
        """The token begun last ends now."""
        if self._token >= 0:
            self._tokens[self._token, 1] = time.perf_counter()
        self._token = -1

    def add_read(
        self, layer: int, expert: int, n_bytes: int, kind: int, queued: float, submitted: float, done: float
    ) -> None:
        """One expert load: ``kind`` an index of :data:`READ_KINDS`; times in perf_counter seconds
        (``queued`` NaN when not known)."""
        i = self._n_reads
        if i >= self.max_reads:
            self.dropped += 1
            return
        self._reads[i] = (layer, expert, n_bytes, kind, queued, submitted, done)
        self._n_reads = i + 1

    def add_step(
        self,
        layer: int,
        calls: int,
        experts: int,
        misses: int,
        start: float,
        ready: float,
        done: float,
        stall: float,
        computes: tuple[tuple[int, float, float], ...],
    ) -> None:
        """One layer step: its routed calls, distinct experts and misses (not resident at its
        start); when it started (after routing), had every expert pinned (``ready``) and ended; the
        seconds the pass stalled on reads in it; its compute jobs ``(kind, start, end)`` (``kind``
        an index of :data:`COMPUTE_KINDS`)."""
        i = self._n_steps
        if i >= self.max_steps:
            self.dropped += 1
            return
        self._steps[i] = (self._token, layer, calls, experts, misses, start, ready, done, stall)
        self._n_steps = i + 1
        for kind, a, b in computes:
            j = self._n_computes
            if j >= len(self._computes):
                self.dropped += 1
                continue
            self._computes[j] = (i, layer, kind, a, b)
            self._n_computes = j + 1

    # -- reading ------------------------------------------------------------------------------

    def reads(self) -> np.ndarray:
        """``(n, 7)`` float64 rows ``layer, expert, bytes, kind, queued, submitted, done`` (a copy)."""
        return self._reads[: self._n_reads].copy()

    def steps(self) -> np.ndarray:
        """``(n, 9)`` float64 rows ``token, layer, calls, experts, misses, start, ready, done, stall``."""
        return self._steps[: self._n_steps].copy()

    def computes(self) -> np.ndarray:
        """``(n, 5)`` float64 rows ``step, layer, kind, start, end`` (``step``: a row of :meth:`steps`)."""
        return self._computes[: self._n_computes].copy()

    def tokens(self) -> np.ndarray:
        """``(n, 2)`` float64 rows ``start, end`` (``end`` NaN while the token runs)."""
        return self._tokens[: self._n_tokens].copy()

    def clear(self) -> None:
        """Forget everything recorded (the arrays are kept)."""
        self._n_reads = self._n_steps = self._n_computes = self._n_tokens = 0
        self._token = -1
        self.dropped = 0

    def summary(self) -> dict[str, Any]:
        """What the recorded tokens add up to, over the window from the first token's start to the
        last finished token's end (seconds unless named otherwise):

        ``tokens``, ``wall_seconds``; ``device_busy_seconds`` (time with at least one read
        submitted and not completed) and ``device_busy_fraction`` (of the wall); ``stall_seconds``
        (the layer steps' waits on reads with nothing to compute) and ``stall_seconds_per_token``;
        ``compute_seconds`` (the wall less the stalls: everything the pass did besides waiting
        for reads) and ``compute_busy_fraction``; ``expert_compute_seconds`` (time with an expert
        compute job running); ``bytes_read`` and ``bytes_per_token``; ``reads``;
        ``pipeline_ratio``: ``wall / max(device_busy, compute)`` (1.0: the pass takes as long as the
        busier of I/O and compute; above 1, the time neither hid). ``dropped``: events not kept.
        Empty values (no finished token) are None.
        """
        tokens = self.tokens()
        done = tokens[~np.isnan(tokens[:, 1])] if len(tokens) else tokens
        out: dict[str, Any] = {"tokens": int(len(done)), "dropped": self.dropped}
        if not len(done):
            return out | dict.fromkeys(("wall_seconds", "pipeline_ratio"))
        t0, t1 = float(done[0, 0]), float(done[-1, 1])
        wall = t1 - t0
        reads, steps, computes = self.reads(), self.steps(), self.computes()
        inside = (reads[:, 6] >= t0) & (reads[:, 5] <= t1) if len(reads) else np.zeros(0, bool)
        busy = busy_seconds(reads[inside][:, 5:7], t0, t1) if len(reads) else 0.0
        in_steps = (steps[:, 5] >= t0) & (steps[:, 7] <= t1) if len(steps) else np.zeros(0, bool)
        stall = float(steps[in_steps, 8].sum()) if len(steps) else 0.0
        expert = busy_seconds(computes[:, 3:5], t0, t1) if len(computes) else 0.0
        compute = max(0.0, wall - stall)
        n = len(done)
        bytes_read = float(reads[inside, 2].sum()) if len(reads) else 0.0
        return out | {
            "wall_seconds": wall,
            "seconds_per_token": wall / n,
            "device_busy_seconds": busy,
            "device_busy_fraction": busy / wall if wall > 0 else None,
            "stall_seconds": stall,
            "stall_seconds_per_token": stall / n,
            "compute_seconds": compute,
            "compute_busy_fraction": compute / wall if wall > 0 else None,
            "expert_compute_seconds": expert,
            "expert_compute_fraction": expert / wall if wall > 0 else None,
            "reads": int(inside.sum()),
            "bytes_read": int(bytes_read),
            "bytes_per_token": bytes_read / n,
            "pipeline_ratio": wall / max(busy, compute) if max(busy, compute) > 0 else None,
        }

    def as_dict(self) -> dict[str, Any]:
        """Everything recorded as JSON-ready columns (times in ms from the first token's start, or
        from the first event when no token was marked), with :meth:`summary` under ``summary``."""
        tables = {
            "reads": (self.reads(), _READ_FIELDS, (4, 5, 6)),
            "steps": (self.steps(), _STEP_FIELDS, (5, 6, 7)),
            "computes": (self.computes(), _COMPUTE_FIELDS, (3, 4)),
            "tokens": (self.tokens(), _TOKEN_FIELDS, (0, 1)),
        }
        firsts = [float(np.nanmin(a[:, cols])) for a, _f, cols in tables.values() if len(a) and cols]
        origin = float(self._tokens[0, 0]) if self._n_tokens else (min(firsts) if firsts else 0.0)
        out: dict[str, Any] = {"read_kinds": list(READ_KINDS), "compute_kinds": list(COMPUTE_KINDS)}
        for name, (array, fields, times) in tables.items():
            columns: dict[str, list[Any]] = {}
            for k, field in enumerate(fields):
                col = array[:, k]
                if k in times:
                    columns[f"{field}_ms"] = [None if np.isnan(v) else round((v - origin) * 1e3, 4) for v in col]
                elif field == "stall":
                    columns["stall_ms"] = [round(v * 1e3, 4) for v in col]
                else:
                    columns[field] = [int(v) for v in col]
            out[name] = columns
        out["summary"] = self.summary()
        return out

    def __repr__(self) -> str:
        return (
            f"<aioexperts.Timeline {self._n_tokens} tokens, {self._n_steps} layer steps, {self._n_reads} reads"
            f"{f', {self.dropped} dropped' if self.dropped else ''}>"
        )


def busy_seconds(spans: np.ndarray, t0: float = -np.inf, t1: float = np.inf) -> float:
    """Seconds covered by at least one of ``spans`` (``(n, 2)`` start, end), clipped to ``[t0, t1]``."""
    if not len(spans):
        return 0.0
    a = np.clip(spans[:, 0], t0, t1)
    b = np.clip(spans[:, 1], t0, t1)
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    total, cur_a, cur_b = 0.0, float(a[0]), float(b[0])
    for x, y in zip(a[1:].tolist(), b[1:].tolist(), strict=True):
        if x > cur_b:
            total += cur_b - cur_a
            cur_a, cur_b = x, y
        elif y > cur_b:
            cur_b = y
    return total + max(0.0, cur_b - cur_a)
