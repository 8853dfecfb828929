"""Prometheus metrics of the daemon, served at ``GET /metrics``.

One registry per daemon (not the process-global one), so tests can run several. Counters are
updated when a session ends or a request fails; gauges are read from the daemon at scrape time.

Throughput is exported the Prometheus way, as two counters to divide:
``rate(streamer_storage_bytes_read_total[5m]) / rate(streamer_storage_read_seconds_total[5m])``
is the storage GB/s while loading, over any window; the gauge
``streamer_last_session_read_bytes_per_second`` is the same for the last session alone.

There is no retry counter: Run:ai retries tensor reads inside its native reader and reports
only the final outcome, and the cloud SDKs retry metadata requests internally
(``STREAMER_STORAGE_RETRIES``). Requests that still failed count in ``streamer_errors_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Gauges(Collector):
    def __init__(self, read: Callable[[], dict]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._read()
        for name, doc, key in (
            ("streamer_shm_bytes_in_use", "Shared-memory segment bytes held (sessions and idle pool)", "shm_in_use"),
            ("streamer_shm_budget_bytes", "The shared-memory budget", "shm_budget"),
            ("streamer_shm_peak_bytes", "Most segment bytes held at once since start", "shm_peak"),
            ("streamer_segments_idle", "Idle segments kept for the next load", "segments_idle"),
            ("streamer_resident_bytes", "Checkpoint bytes kept in shared memory for reloads", "resident_bytes"),
            ("streamer_retention_budget_bytes", "The retention budget (0: nothing kept)", "retention_budget"),
        ):
            yield GaugeMetricFamily(name, doc, value=stats[key])
        yield CounterMetricFamily(
            "streamer_resident_bytes_served", "Bytes handed to ranks from memory kept by earlier loads", value=stats["resident_bytes_served"]
        )
        yield GaugeMetricFamily("streamer_sessions_active", "Sessions joining or streaming", value=len(stats["sessions"]))


class Metrics:
    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.storage_bytes = Counter(
            "streamer_storage_bytes_read", "Bytes read from storage into shared memory", ["scheme"], registry=self.registry
        )
        self.delivered_bytes = Counter(
            "streamer_rank_bytes_delivered", "Bytes handed to ranks, by rank number", ["rank"], registry=self.registry
        )
        self.read_seconds = Counter(
            "streamer_storage_read_seconds",
            "Seconds sessions spent reading, first storage request to last byte landed (waits for slow ranks included)",
            ["scheme"],
            registry=self.registry,
        )
        self.last_rate = Gauge(
            "streamer_last_session_read_bytes_per_second",
            "Storage bytes per second of the last session that read any",
            ["scheme"],
            registry=self.registry,
        )
        self.sessions = Counter("streamer_sessions", "Sessions ended, by outcome", ["outcome"], registry=self.registry)
        self.errors = Counter("streamer_errors", "Requests refused or failed, by error type", ["type"], registry=self.registry)
        self.metadata = Counter(
            "streamer_metadata_pulls", "Metadata pulls, by cache result (hit: no storage request)", ["result"], registry=self.registry
        )
        self.registry.register(_Gauges(read_stats))

    def session_ended(self, summary: dict, scheme: str, read_seconds: float) -> None:
        self.storage_bytes.labels(scheme=scheme).inc(summary["bytes_read"])
        self.read_seconds.labels(scheme=scheme).inc(read_seconds)
        if summary["bytes_read"] and read_seconds > 0:
            self.last_rate.labels(scheme=scheme).set(summary["bytes_read"] / read_seconds)
        for rank, info in summary["ranks"].items():
            self.delivered_bytes.labels(rank=str(rank)).inc(info["bytes_delivered"])
        self.sessions.labels(outcome=summary["state"]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
