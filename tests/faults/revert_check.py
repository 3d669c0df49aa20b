"""Undo each of issue 7's fixes in turn and check that the store state machine fails.

Run from a checkout (it edits the package's files and restores them, one fix at a time)::

    .venv/bin/python tests/faults/revert_check.py          # every fix
    .venv/bin/python tests/faults/revert_check.py 3a 5     # those whose label starts so

For each fix it runs ``tests/faults/test_store_state_machine.py`` (and the cache property test,
for comparison) with the ``find-only`` hypothesis profile: fresh examples, no example database,
no shrinking, 300 examples per event loop. A line per fix: the pytest summary of each test.
Fixes 4 (direct-I/O probing) and 8 (io_uring without probe) are below what the store machine
drives; their regression tests are in ``tests/io/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: State-machine examples per event loop (the default pass runs 30-60): some reverted fixes need a
#: rarer order of steps to show (3c: a Task.cancel() while the backend's release is running).
EXAMPLES = 300
TESTS = ("tests/faults/test_store_state_machine.py", "tests/cache/test_cache_properties.py")

#: label -> (file, the fixed code, the code before the fix)
REVERTS: dict[str, tuple[str, str, str]] = {
    "1 submit failure frees queued slots": (
        "aioexperts/_cache/scheduler.py",
        "        taken = max(0, min(taken, len(batch)))\n",
        "        taken = 0\n",
    ),
    "2 exception at a callback boundary": (
        "aioexperts/_cache/scheduler.py",
        "        except Exception as exc:  # a backend outside the contract: trust its count of reads taken\n",
        "        except OSError as exc:\n",
    ),
    "3a retry queued during close": (
        "aioexperts/_cache/scheduler.py",
        "        retries, self._retries = self._retries, deque()\n",
        "        retries: deque = deque()\n",
    ),
    "3b aclose re-raises a cancellation while reads are in flight": (
        "aioexperts/_store.py",
        "            held = await wait_through_cancellation(wait_idle) or held\n",
        "            with anyio.CancelScope(shield=True):\n                await wait_idle()\n",
    ),
    "3c aclose re-raises a cancellation during the release": (
        "aioexperts/_store.py",
        "        held = await wait_through_cancellation(wait_release, release.done.is_set) or held\n",
        "        with anyio.CancelScope(shield=True):\n            await anyio.to_thread.run_sync(release.done.wait)\n",
    ),
    "5 short direct read re-reads the window": (
        "aioexperts/_cache/scheduler.py",
        "align_down(n, self.alignment)",
        "0",
    ),
    "6 policy: mutate before deciding": (
        "aioexperts/_cache/cache.py",
        """        for entry in present:
            if entry.state is SlotState.READY and entry.key not in self._untracked:
                self._hook(self.policy.access, entry.key, "access")
        self._evict(victims)
        # mutation: nothing below calls out of the cache
        for entry in present:
            entry.pins += 1
""",
        """        for entry in present:
            entry.pins += 1
        for entry in present:
            if entry.state is SlotState.READY and entry.key not in self._untracked:
                self._hook(self.policy.access, entry.key, "access")
        self._evict(victims)
""",
    ),
    "7 wait=False queues behind waiting requests": (
        "aioexperts/_cache/cache.py",
        """        pinned = self._pin_all(unique, plans)
        if pinned is not None:
            return pinned
        wanted = set(unique)""",
        """        return await self._pin_in_turn(unique, plans)
        wanted = set(unique)""",
    ),
}


def run(test: str) -> str:
    """The last line of pytest's summary for ``test``."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    env = {**os.environ, "AIOEXPERTS_LONG_MACHINE": str(EXAMPLES)}
    done = subprocess.run(
        [*argv, "--hypothesis-profile=find-only", test], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else done.stderr.strip()[-200:]


def main() -> None:
    only = sys.argv[1:]
    for label, (path, fixed, before) in REVERTS.items():
        if only and not any(label.startswith(o) for o in only):
            continue
        file = ROOT / path
        source = file.read_text()
        if source.count(fixed) != 1:
            raise SystemExit(f"{label}: the fixed code is not found once in {path}; update this script")
        file.write_text(source.replace(fixed, before))
        try:
            results = {Path(t).name: run(t) for t in TESTS}
        finally:
            file.write_text(source)
        print(f"{label}: {results}", flush=True)


if __name__ == "__main__":
    main()
