"""Expert shards: the Ray tests (marked ``ray``) share one local cluster per session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster (``ray.init(num_cpus=2)``) for the whole session; shut down at the end."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'aioexperts[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
