"""A memory-limited cgroup for one bench run: created, joined by a child process, read, removed.

cgroup v1 (``memory.limit_in_bytes``) or v2 (``memory.max``, when the parent's
``cgroup.subtree_control`` has ``memory``). The group is made inside this process's own memory
cgroup, so it stays inside whatever already contains the bench. Creating it needs root (or a
delegated cgroup); :func:`unavailable_reason` says why it cannot be done, in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aioexperts.testing import memory_cgroups

__all__ = ("MemoryCgroup", "own_memory_cgroup", "unavailable_reason")


def own_memory_cgroup() -> tuple[str, str] | None:
    """``("v1" | "v2", directory)`` of this process's memory cgroup (v1 first; v2 only where the
    hierarchy delegates ``memory`` to children), or None."""
    groups = memory_cgroups()
    for kind, directory in groups:
        if kind == "v1":
            return kind, directory
    for kind, directory in groups:
        try:
            with open(os.path.join(directory, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    return kind, directory
        except OSError:
            pass
    return None


def unavailable_reason() -> str | None:
    """None when a memory cgroup can be made here, else why not (one line)."""
    own = own_memory_cgroup()
    if own is None:
        return "no cgroup memory controller is usable (v1 not mounted, v2 without memory in subtree_control)"
    if not os.access(own[1], os.W_OK):
        return f"cannot create a cgroup under {own[1]} (needs root or a delegated cgroup)"
    return None


@dataclass
class MemoryCgroup:
    """One cgroup with a memory limit. Use :meth:`create`, then :meth:`join_command` or
    :meth:`join` in the child, :meth:`facts` after the run, :meth:`remove` at the end.

    Attributes:
        version: ``"v1"`` or ``"v2"``.
        path: the cgroup's directory.
        limit_bytes: the limit written.
    """

    version: str
    path: str
    limit_bytes: int

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup:
        """Make ``name`` under this process's memory cgroup with ``limit_bytes`` (raises OSError)."""
        own = own_memory_cgroup()
        if own is None:
            raise OSError(unavailable_reason())
        version, parent = own
        path = os.path.join(parent, name)
        os.mkdir(path)
        group = cls(version, path, limit_bytes)
        try:
            group._write("memory.limit_in_bytes" if version == "v1" else "memory.max", str(limit_bytes))
            if version == "v2":
                group._write("memory.swap.max", "0", missing_ok=True)
        except BaseException:
            group.remove()
            raise
        return group

    def _write(self, name: str, text: str, *, missing_ok: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(text)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def join(self) -> None:
        """Move the calling process into the group (use as ``preexec_fn``)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def facts(self) -> dict[str, int | None]:
        """Peak usage, failed charges against the limit and OOM kills seen by the group."""
        if self.version == "v1":
            peak, failcnt = self._read("memory.max_usage_in_bytes"), self._read("memory.failcnt")
            control = self._read("memory.oom_control") or ""
            kills = dict(line.split() for line in control.splitlines() if len(line.split()) == 2).get("oom_kill")
            return {
                "peak_bytes": int(peak) if peak and peak.strip().isdigit() else None,
                "failcnt": int(failcnt) if failcnt and failcnt.strip().isdigit() else None,
                "oom_kills": int(kills) if kills is not None and kills.isdigit() else None,
            }
        peak = self._read("memory.peak")
        events = self._read("memory.events") or ""
        counts = dict(line.split() for line in events.splitlines() if len(line.split()) == 2)
        return {
            "peak_bytes": int(peak) if peak and peak.strip().isdigit() else None,
            "failcnt": int(counts["max"]) if counts.get("max", "").isdigit() else None,
            "oom_kills": int(counts["oom_kill"]) if counts.get("oom_kill", "").isdigit() else None,
        }

    def remove(self) -> None:
        """Remove the group (its processes must have exited; the page cache charged to it moves up)."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
