"""``/metrics`` says where the experts came from and where the pass waited (issue 36)."""

from __future__ import annotations

import pytest

from serve.serving import ServerThread, metrics, post, wait_for

SOURCES = ("cached", "prefetched_in_time", "prefetched_late", "demand")


def test_the_expert_sources_sum_to_the_requests_and_stalls_are_reported(served: ServerThread) -> None:
    status, _ = post(served, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "temperature": 0})
    assert status == 200

    def quiet() -> dict[str, float] | None:
        m = metrics(served)
        return m if m["aioexperts_requests_running"] == 0 else None

    m = wait_for(quiet)
    by_source = [m[f'aioexperts_expert_requests_by_source_total{{source="{s}"}}'] for s in SOURCES]
    assert sum(by_source) == m["aioexperts_expert_requests_total"] > 0
    assert m["aioexperts_expert_low_tier_misses_total"] == 0  # the tier is off by default
    assert m["aioexperts_expert_tier_upgrades_total"] == 0
    assert 0 <= m["aioexperts_expert_stall_seconds_total"]
    assert m["aioexperts_expert_stall_seconds_per_token"] * (
        m["aioexperts_tokens_prefilled_total"] + m["aioexperts_tokens_decoded_total"]
    ) == pytest.approx(m["aioexperts_expert_stall_seconds_total"])
    assert m["aioexperts_device_busy_seconds_total"] >= 0 and m["aioexperts_device_read_bytes_per_second"] >= 0
