"""This process's memory cgroups, read from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``.

One reader for the slab budget (:mod:`aioexperts._model.memory`) and the bench's cgroups
(``aioexperts_bench.cgroup``, through the public :func:`aioexperts.testing.memory_cgroups`).
``root`` is ``/`` except in tests, which fake the files under it.
"""

from __future__ import annotations

import os

__all__ = ("cgroup_mounts", "memory_cgroups")


def cgroup_mounts(root: str = "/") -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """``(mount point, mount root)`` of the cgroup v2 hierarchy and of the v1 memory controller."""
    v2 = v1 = None
    try:
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mount_point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2" and v2 is None:
            v2 = (mount_point, mount_root)
        elif fstype == "cgroup" and "memory" in tail[2].split(",") and v1 is None:
            v1 = (mount_point, mount_root)
    return v2, v1


def memory_cgroups(root: str = "/") -> list[tuple[str, str]]:
    """``("v1" | "v2", directory)`` of this process's memory cgroups (v1 memory controller, v2 hierarchy).

    ``directory`` is under ``root`` (``/`` but in tests), the mount's root taken off the cgroup path
    (as inside a container's cgroup namespace). Empty when neither is mounted or readable.
    """
    v2_mount, v1_mount = cgroup_mounts(root)
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[tuple[str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, cgroup_path = parts
        if controllers == "" and v2_mount is not None:
            kind, mount = "v2", v2_mount
        elif "memory" in controllers.split(",") and v1_mount is not None:
            kind, mount = "v1", v1_mount
        else:
            continue
        point, mount_root = mount
        rel = cgroup_path
        if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root + "/")):
            rel = rel[len(mount_root) :]
        found.append((kind, os.path.join(root, point.lstrip("/"), rel.strip("/"))))
    return found
