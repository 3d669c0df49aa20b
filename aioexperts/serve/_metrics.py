"""The server's counters and their Prometheus text exposition (``GET /metrics``, format 0.0.4).

Counters kept here (requests by endpoint and status, tokens in and out, cancelled generations,
the recent generation rate) are joined at scrape time with the model's, the store's and the
scheduler's own counters: live sequences and their KV cache bytes, expert hit rate, bytes read
per token, slab bytes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioexperts import Model

    from ._prompt_cache import PromptCache
    from ._scheduler import Scheduler

__all__ = ("CONTENT_TYPE", "RATE_WINDOW_SECONDS", "Metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The content type of the Prometheus text format."""

RATE_WINDOW_SECONDS = 10.0
"""``aioexperts_generation_tokens_per_second`` counts the tokens of this many last seconds."""

_Sample = tuple[dict[str, str], float]


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + "n").replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return "{" + ",".join(escaped) + "}"


def _family(name: str, kind: str, help_text: str, samples: Iterable[_Sample]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(labels)} {value:.17g}" for labels, value in samples]
    return lines


class Metrics:
    """What the server counts itself (the model, store and scheduler keep their own counters).

    Attributes:
        requests: ``(endpoint, status)`` -> responses sent.
        prompt_tokens, completion_tokens: tokens of the admitted prompts / generated.
        cancelled: generations cancelled (client gone, or server shutdown past its deadline).
    """

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cancelled = 0
        self._recent: deque[float] = deque()
        self._started = time.monotonic()

    def token(self) -> None:
        """One token generated (counted, and in the rate window)."""
        self.completion_tokens += 1
        now = time.monotonic()
        self._recent.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0] < now - RATE_WINDOW_SECONDS:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last :data:`RATE_WINDOW_SECONDS` (all requests)."""
        now = time.monotonic()
        self._trim(now)
        return len(self._recent) / max(1e-9, min(RATE_WINDOW_SECONDS, now - self._started))

    def render(self, model: Model, scheduler: Scheduler, cache: PromptCache | None = None) -> str:
        """The Prometheus text of every metric (``cache``: the prompt cache's, when there is one)."""
        ms = model.statistics()
        st = model.store.statistics()
        run = ms.tokens_prefilled + ms.tokens_decoded
        out: list[str] = []

        def add(name: str, kind: str, help_text: str, value: float | Iterable[_Sample]) -> None:
            samples = [({}, float(value))] if isinstance(value, int | float) else value
            out.extend(_family("aioexperts_" + name, kind, help_text, samples))

        add(
            "requests_total",
            "counter",
            "HTTP responses by endpoint and status.",
            [({"endpoint": ep, "status": str(code)}, n) for (ep, code), n in sorted(self.requests.items())],
        )
        add("prompt_tokens_total", "counter", "Prompt tokens of admitted generations.", self.prompt_tokens)
        add("completion_tokens_total", "counter", "Tokens generated.", self.completion_tokens)
        add(
            "generation_tokens_per_second",
            "gauge",
            f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:g} s, all requests together.",
            self.tokens_per_second(),
        )
        add("requests_cancelled_total", "counter", "Generations cancelled (client gone, shutdown).", self.cancelled)
        add("requests_running", "gauge", "Generations holding a slot.", scheduler.running)
        add("queue_depth", "gauge", "Requests waiting for a slot.", scheduler.queued)
        add("queue_capacity", "gauge", "Requests that may wait (--queue).", scheduler.queue_size)
        add("parallel_slots", "gauge", "Generations that run at once (--parallel).", scheduler.parallel)
        add("requests_rejected_total", "counter", "Requests refused: queue full or shutting down.", scheduler.rejected)
        add("queue_seconds_total", "counter", "Seconds admitted requests waited for a slot.", scheduler.queue_seconds)
        add("sequences_live", "gauge", "Sequences whose KV cache is allocated.", ms.live_sequences)
        add("kv_cache_bytes_in_use", "gauge", "Bytes of the allocated KV caches.", ms.kv_bytes_in_use)
        add("tokens_prefilled_total", "counter", "Tokens run in prompt batches.", ms.tokens_prefilled)
        add("tokens_decoded_total", "counter", "Tokens run one at a time.", ms.tokens_decoded)
        add(
            "decode_steps_batched_total",
            "counter",
            "Decode steps that ran several sequences' tokens together (cross-request batching).",
            ms.batched_steps,
        )
        add("decode_tokens_batched_total", "counter", "Tokens of those steps.", ms.batched_tokens)
        add("expert_requests_total", "counter", "Experts asked of the store.", st.requests)
        add("expert_hits_total", "counter", "Of those, resident in the slab.", st.hits)
        add("expert_misses_total", "counter", "Of those, read from the file.", st.misses)
        add("expert_hit_rate", "gauge", "Expert hits per request since the start.", st.hit_rate)
        add("expert_bytes_read_total", "counter", "Bytes the expert reads returned.", st.bytes_read)
        add(
            "expert_bytes_read_per_token",
            "gauge",
            "Expert bytes read per token run (prompt and generated) since the start.",
            st.bytes_read / run if run else 0.0,
        )
        add(
            "expert_requests_by_source_total",
            "counter",
            "Experts asked of the store, by where they came from (the sources sum to the requests): "
            "cached (resident before the request), prefetched in time, prefetched late (the request "
            "waited for the read), demand (a read the request started or joined).",
            [
                ({"source": "cached"}, st.cached_hits),
                ({"source": "prefetched_in_time"}, st.prefetched_in_time),
                ({"source": "prefetched_late"}, st.prefetched_late),
                ({"source": "demand"}, st.demand_misses),
            ],
        )
        add(
            "expert_low_tier_misses_total",
            "counter",
            "Demand misses whose read went to the low tier.",
            st.low_tier_misses,
        )
        add(
            "expert_tier_upgrades_total",
            "counter",
            "Reads of low-tier copies again at full precision, started (a failed one keeps the low copy).",
            st.tier_upgrades,
        )
        add(
            "expert_low_tier_prefetches_total",
            "counter",
            "Prefetches read from the low tier.",
            st.low_tier_prefetches,
        )
        add(
            "expert_low_tier_prefetch_hits_total",
            "counter",
            "Requests served by a prefetch read from the low tier (in time or late).",
            st.low_tier_prefetch_hits,
        )
        add(
            "expert_tier_upgrades_deferred_total",
            "counter",
            "Upgrades of low-tier copies put off because the reads were behind.",
            st.tier_upgrades_deferred,
        )
        add(
            "expert_stall_seconds_total",
            "counter",
            "Seconds the MoE layers waited for expert reads with nothing to compute.",
            ms.stall_seconds,
        )
        add(
            "expert_stall_seconds_per_token",
            "gauge",
            "Stall seconds per token run (prompt and generated) since the start.",
            ms.stall_seconds / run if run else 0.0,
        )
        busy = st.device_busy_seconds
        add("device_busy_seconds_total", "counter", "Seconds with at least one expert read in flight.", busy)
        add(
            "device_read_bytes_per_second",
            "gauge",
            "Bytes read per second while reads were in flight, since the start.",
            st.device_rate or 0.0,
        )
        add("slab_bytes", "gauge", "Bytes of the slab of expert slots.", st.n_slots * st.slot_bytes)
        add("slab_slots", "gauge", "Slots of the slab (one expert each).", st.n_slots)
        pc_hits = cache.hits if cache else 0
        add("prompt_cache_hits_total", "counter", "Requests that continued a cached sequence.", pc_hits)
        reused = cache.reused_tokens if cache else 0
        add("prompt_tokens_cached_total", "counter", "Prompt tokens kept from the prompt cache.", reused)
        add("prompt_cache_entries", "gauge", "Sequences in the prompt cache.", cache.entries if cache else 0)
        add("prompt_cache_bytes", "gauge", "KV cache bytes of those sequences.", cache.bytes if cache else 0)
        budget = cache.capacity_bytes if cache else 0
        add("prompt_cache_capacity_bytes", "gauge", "The prompt cache's budget (--prompt-cache-bytes).", budget)
        evicted = cache.evictions if cache else 0
        add("prompt_cache_evictions_total", "counter", "Cached sequences closed to stay in the budget.", evicted)
        return "\n".join(out) + "\n"
