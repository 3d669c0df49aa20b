"""The mode of a new file under the process's umask, for writers that create their file with
``tempfile.mkstemp`` (always 0600) and rename it into place: the final file gets the mode a plain
``open(path, "w")`` would have given it (0644 under the usual umask 022)."""

from __future__ import annotations

import os

__all__ = ("new_file_mode",)


def new_file_mode() -> int:
    """``0o666`` without the bits of the process's umask (read from ``/proc/self/status``: setting and
    restoring the umask to read it would race other threads; that is the fallback off Linux)."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
