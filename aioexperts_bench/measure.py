"""Timing primitives and statistics of the benches: wall and CPU clocks, medians with ranges.

Every figure the bench prints is a median over rounds with its minimum and maximum; ratios
between methods are computed per round (the two passes were adjacent in time) and summarised the
same way.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ("GB", "GIB", "Clock", "Spread", "rotated", "spread")

#: Units of every figure: GB is 10^9 bytes, GiB 2^30 bytes.
GB = 1e9
GIB = float(1 << 30)


class Clock:
    """Wall time, this process's CPU time and its reaped children's CPU time over a block.

    ``with Clock() as c: ...`` then ``c.seconds``, ``c.cpu`` (user + system of every thread of
    this process, io_uring workers included; also apart as ``c.user`` and ``c.system``) and
    ``c.child_cpu`` (of children that exited).
    """

    seconds: float
    cpu: float
    user: float
    system: float
    child_cpu: float

    def __enter__(self) -> Clock:
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._c0 = self._r0.ru_utime + self._r0.ru_stime
        self._k0 = _cpu(resource.RUSAGE_CHILDREN)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.user = r.ru_utime - self._r0.ru_utime
        self.system = r.ru_stime - self._r0.ru_stime
        self.cpu = self.user + self.system
        self.child_cpu = _cpu(resource.RUSAGE_CHILDREN) - self._k0


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class Spread:
    """Median, minimum and maximum of some samples (NaN samples are left out).

    Attributes:
        median: the median (the mean of the middle two for an even count).
        low, high: the smallest and largest sample.
        n: samples used.
    """

    median: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, Any]:
        """``{"median", "min", "max", "n"}``."""
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}

    def fmt(self, spec: str = ".2f") -> str:
        """``"1.23 (1.01-1.40)"``; only the median for a single sample; ``"-"`` for none."""
        if self.n == 0:
            return "-"
        if self.n == 1 or self.low == self.high:
            return format(self.median, spec)
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


def spread(samples: Iterable[float | None]) -> Spread:
    """The :class:`Spread` of ``samples`` (None and NaN are skipped)."""
    xs = sorted(float(x) for x in samples if x is not None and not math.isnan(float(x)))
    if not xs:
        return Spread(math.nan, math.nan, math.nan, 0)
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return Spread(median, xs[0], xs[-1], len(xs))


def rotated(items: Sequence[str], round_index: int) -> list[str]:
    """``items`` rotated left by ``round_index`` (round 0 keeps the order)."""
    if not items:
        return []
    k = round_index % len(items)
    return [*items[k:], *items[:k]]
