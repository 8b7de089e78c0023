"""GET /metrics: the runtime's counters in Prometheus text format, under llama-server's metric names.

Counters and instant gauges come from `runtime.stats()` (keys named like the metrics without the
`llamacpp:` prefix); a missing key reads 0. The two throughput gauges are averaged over the window between
two scrapes, as upstream does, from the change of the token and time totals since the previous scrape.
`n_tokens_max` is exposed as a gauge (a high-water mark is not a counter, and prometheus-client would rename
a counter without `_total`).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from app.server.state import ServerState

PREFIX = "llamacpp:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("n_decode_total", "Total number of decode steps"),
    ("spec_decode_num_draft_tokens_total", "Speculative: total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: total verification steps"),
    ("prompt_cache_hits_total", "rigserve: prompts that restored a host prompt-cache entry"),
    ("prompt_cache_misses_total", "rigserve: prompt-cache lookups that found nothing worth restoring"),
    ("prompt_cache_tokens_restored_total", "rigserve: prompt tokens restored from the host prompt cache"),
    ("step_seconds_total", "rigserve: time in engine steps that decoded a batch"),
    ("step_engine_seconds_total", "rigserve: of which inside llama_decode and the wait for the device"),
)
GAUGES = (
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests waiting for a slot"),
    ("n_busy_slots_per_decode", "Average number of busy slots per decode step"),
    ("prompt_cache_entries", "rigserve: entries in the host prompt cache"),
    ("prompt_cache_bytes", "rigserve: host RAM held by the prompt cache"),
    ("checkpoints_held", "rigserve: checkpoints held by all slots"),
    ("checkpoints_bytes", "rigserve: host RAM held by the slots' checkpoints"),
    ("buffer_pool_bytes", "rigserve: bytes in the pooled state buffers, in use or free"),
    ("buffer_pool_free_bytes", "rigserve: pooled state buffers ready for reuse"),
)


class _StatsCollector:
    """Reads one snapshot of the runtime's stats per scrape."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.state.runtime.stats() or {})
        prev, self.state.metrics_prev = self.state.metrics_prev, stats
        for name, doc in COUNTERS:
            m = Metric(PREFIX + name[: -len("_total")], doc, "counter")
            m.add_sample(PREFIX + name, {}, float(stats.get(name, 0)))
            yield m
        yield GaugeMetricFamily(PREFIX + "prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                                value=_rate(stats, prev, "prompt_tokens_total", "prompt_seconds_total"))
        yield GaugeMetricFamily(PREFIX + "predicted_tokens_seconds", "Average generation throughput in tokens/s",
                                value=_rate(stats, prev, "tokens_predicted_total", "tokens_predicted_seconds_total"))
        for name, doc in GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats.get(name, 0)))


def _rate(now: dict, prev: dict, tokens: str, seconds: str) -> float:
    dt = float(now.get(seconds, 0)) - float(prev.get(seconds, 0))
    dn = float(now.get(tokens, 0)) - float(prev.get(tokens, 0))
    return dn / dt if dt > 0 else 0.0


def render(state: ServerState) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(state))
    return generate_latest(registry)
