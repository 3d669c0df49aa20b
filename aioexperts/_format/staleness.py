"""How a model file changed since a map or sidecar recorded its identity, in words.

A ``WEEPF001`` expert map and a miss-tier sidecar record each model file's size, device, inode and
``st_mtime_ns``; when those differ at use, the error says which file changed and how (another file,
an earlier or a later version, a size change), with local ISO times instead of raw numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

__all__ = ("IDENTITY_FIELDS", "file_change", "local_time")

#: a model's identity as a map or sidecar records it, one list per field with an int per model file
#: (bytes, ``st_dev``, ``st_ino``, ``st_mtime_ns``): ``StaleMapError.recorded`` / ``.current``
IDENTITY_FIELDS = ("sizes", "devs", "inos", "mtimes")


def local_time(ns: int, other: int) -> str:
    """``ns`` (an ``st_mtime_ns``) as a local ISO time, to the nanosecond if ``other`` falls in the
    same second (so that two times a touch apart read differently)."""
    seconds, fraction = divmod(ns, 10**9)
    try:
        iso = datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # a recorded time no calendar holds
        return f"{ns} ns after 1970"
    if seconds != other // 10**9:
        return iso
    return f"{iso[:19]}.{fraction:09d}{iso[19:]}"  # YYYY-MM-DDTHH:MM:SS.fffffffff+HH:MM


def file_change(name: str, what: str, recorded: Sequence[int], current: Sequence[int]) -> str:
    """Why ``what`` (``"the map"``, ``"the sidecar"``) does not fit model file ``name``: its recorded
    ``(size, st_dev, st_ino, st_mtime_ns)`` against the file's ``current`` one; ``""`` if they agree."""
    if tuple(recorded) == tuple(current):
        return ""
    (size_then, dev_then, ino_then, then), (size_now, dev_now, ino_now, now) = recorded, current
    if (dev_then, ino_then) != (dev_now, ino_now):
        return f"{what} was written for another file than {name} (a copy, or a file replaced since)"
    size = "" if size_then == size_now else f"; it is {size_now} bytes long, {what} recorded {size_then}"
    if now > then:
        return (
            f"{what} was written for an earlier version of {name} (modified {local_time(now, then)} after "
            f"{what}'s record of {local_time(then, now)}{size})"
        )
    return (
        f"{name} changed since {what} was written (modified {local_time(now, then)}, {what} recorded "
        f"{local_time(then, now)}{size})"
    )
