"""The hang watchdog (tests/hang_watchdog.py): a test that hangs past its limit ends the run fast."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A hang of the kind issue 31 saw: pytest-timeout's signal lands inside an asyncio task step, the
# task keeps the ``Failed`` as its result, and the test waits forever for what that task was to do.
HANGING_TEST = """
import asyncio
import time


def test_waits_for_a_task_that_swallowed_the_timeout():
    async def main():
        async def spin():
            while True:
                time.sleep(0.05)  # the timeout's signal lands in this step
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(spin())
        await asyncio.Event().wait()  # never set: only the watchdog ends this
        task.cancel()

    asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_a_test_hung_past_its_timeout_ends_the_run_with_exit_3(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent),
        "AIOEXPERTS_HANG_GRACE_S": "2",
    }
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "hang_watchdog", "-p", "no:cacheprovider", "-o", "timeout=1",
             "-q", str(tmp_path / "test_hang.py")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the hung test was not ended by the watchdog within 60 s")
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "HANG: " in proc.stderr and "test_waits_for_a_task_that_swallowed_the_timeout" in proc.stderr
    assert "Thread" in proc.stderr  # every thread's stack, to say where it hung
    assert elapsed < 30, elapsed
