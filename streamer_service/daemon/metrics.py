"""Prometheus metrics of the daemon, served at ``GET /metrics`` (unix socket) and on the metrics
listener (``serve --metrics-port``, :mod:`streamer_service.daemon.scrape`).

One registry per daemon (not the process-global one), so tests can run several. Counters are
updated when a session ends or a request fails; gauges are read from the daemon at scrape time.
Names follow the Prometheus conventions: ``streamer_`` prefix, base units, the unit last
(``_bytes``, ``_seconds``), ``_total`` on counters. docs/daemon.md lists them all (a test
scrapes a daemon and checks that list, the dashboard and the alert rules against it).

Throughput is exported the Prometheus way, as two counters to divide:
``rate(streamer_storage_read_bytes_total[5m]) / rate(streamer_storage_read_seconds_total[5m])``
is the storage GB/s while loading, over any window; the gauge
``streamer_last_session_read_bytes_per_second`` is the same for the last session alone.
``streamer_storage_read_bytes_total / streamer_load_unique_bytes_total`` is how often each needed
byte was read from storage: 1 when every byte is read once per node, below 1 when loads are
served from the resident copy.

There is no retry counter: Run:ai retries tensor reads inside its native reader and reports
only the final outcome, and the cloud SDKs retry metadata requests internally
(``STREAMER_STORAGE_RETRIES``). Requests that still failed count in ``streamer_errors_total``,
sessions that failed in ``streamer_session_failures_total``.
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from .stats import DaemonStats, SessionSummary

__all__ = ["Metrics", "LoadTimes", "build_info", "CONTENT_TYPE", "LOAD_SECONDS_BUCKETS", "FIRST_TENSOR_SECONDS_BUCKETS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From a cached 1 GB checkpoint (about a second) to a multi-TB one over a slow link (an hour).
LOAD_SECONDS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# The first batch lands after one slot's worth of reads (a slot is 256 MiB by default).
FIRST_TENSOR_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


@dataclass
class LoadTimes:
    """When a session started streaming (every rank joined), had its first tensor ready for a
    rank, and ended; ``time.monotonic()`` values, ``None`` until they happen."""

    started: float | None = None
    first_ready: float | None = None
    ended: float | None = None

    def mark(self, event: str) -> None:
        """Record ``event`` (``started``, ``first_ready``, ``ended``) the first time it happens."""
        if getattr(self, event) is None:
            setattr(self, event, time.monotonic())


def build_info(revision: str) -> dict[str, str]:
    """The labels of ``streamer_build_info``: our versions, Run:ai's, Python's, the source revision."""

    def version(distribution: str) -> str:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    return {
        "version": version("streamer-service"),
        "client_version": version("streamer-client"),
        "runai_version": version("runai-model-streamer"),
        "python_version": platform.python_version(),
        "revision": revision,
    }


class _Gauges(Collector):
    def __init__(self, read: Callable[[], DaemonStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._read()
        for name, doc, value in (
            ("streamer_shm_in_use_bytes", "Shared-memory segment bytes held by sessions and the idle pool", stats.shm_in_use),
            ("streamer_shm_budget_bytes", "The shared-memory budget (STREAMER_SHM_BUDGET)", stats.shm_budget),
            ("streamer_shm_peak_bytes", "Most segment bytes held at once since start", stats.shm_peak),
            ("streamer_shm_page_size_bytes", "Page size backing the shm dir's segments (2 MiB: huge pages)", stats.shm_page_size),
            ("streamer_shm_idle_segments", "Idle segments kept for the next load", stats.segments_idle),
            ("streamer_resident_bytes", "Checkpoint bytes kept in shared memory for reloads", stats.resident.resident_bytes),
            (
                "streamer_retention_budget_bytes",
                "The retention budget (STREAMER_RETENTION_BUDGET; 0: nothing kept)",
                stats.resident.retention_budget,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "streamer_resident_served_bytes",
            "Bytes handed to ranks from memory kept by earlier loads",
            value=stats.resident.resident_bytes_served,
        )
        yield GaugeMetricFamily("streamer_sessions_active", "Sessions joining or streaming", value=len(stats.sessions))


class Metrics:
    def __init__(self, read_stats: Callable[[], DaemonStats], *, build: dict[str, str] | None = None) -> None:
        # No ``*_created`` series: in the 0.0.4 text format each is one more gauge per counter and
        # histogram, which dashboards never read (prometheus_client's switch is process-wide).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.storage_bytes = Counter(
            "streamer_storage_read_bytes", "Bytes read from storage into shared memory", ["scheme"], registry=r
        )
        self.unique_bytes = Counter(
            "streamer_load_unique_bytes",
            "Bytes of the tensors the ranks of each session selected, each tensor counted once (the union)",
            ["scheme"],
            registry=r,
        )
        self.delivered_bytes = Counter(
            "streamer_rank_delivered_bytes", "Bytes handed to ranks, by rank number", ["rank"], registry=r
        )
        self.read_seconds = Counter(
            "streamer_storage_read_seconds",
            "Seconds sessions spent reading, first storage request to last byte landed (waits for slow ranks included)",
            ["scheme"],
            registry=r,
        )
        self.last_rate = Gauge(
            "streamer_last_session_read_bytes_per_second",
            "Storage bytes per second of the last session that read any",
            ["scheme"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "streamer_load_duration_seconds",
            "Sessions that completed: every rank joined to every rank released its last tensor",
            ["scheme"],
            buckets=LOAD_SECONDS_BUCKETS,
            registry=r,
        )
        self.first_tensor_seconds = Histogram(
            "streamer_time_to_first_tensor_seconds",
            "Every rank joined to the first tensor ready for a rank (from storage or the resident copy)",
            ["scheme"],
            buckets=FIRST_TENSOR_SECONDS_BUCKETS,
            registry=r,
        )
        self.sessions = Counter("streamer_sessions", "Sessions ended, by outcome (done, failed)", ["outcome"], registry=r)
        self.session_failures = Counter(
            "streamer_session_failures",
            "Sessions that failed, by error type (StorageError, ObjectChangedError, ...)",
            ["type"],
            registry=r,
        )
        self.errors = Counter("streamer_errors", "Requests refused or failed, by error type", ["type"], registry=r)
        self.metadata = Counter(
            "streamer_metadata_pulls", "Metadata pulls, by cache result (hit: no storage request)", ["result"], registry=r
        )
        Info("streamer_build", "Versions of this daemon (the value is always 1)", registry=r).info(build or {})
        # Standard process metrics (process_resident_memory_bytes, process_cpu_seconds_total,
        # process_open_fds, ...), python_info and the GC counters.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        r.register(_Gauges(read_stats))

    def session_ended(
        self, summary: SessionSummary, scheme: str, read_seconds: float, *, unique_bytes: int, times: LoadTimes, error: str | None
    ) -> None:
        self.storage_bytes.labels(scheme=scheme).inc(summary.bytes_read)
        self.unique_bytes.labels(scheme=scheme).inc(unique_bytes)
        self.read_seconds.labels(scheme=scheme).inc(read_seconds)
        if summary.bytes_read and read_seconds > 0:
            self.last_rate.labels(scheme=scheme).set(summary.bytes_read / read_seconds)
        for rank, info in summary.ranks.items():
            if info.status != "failed":  # handed out, but the rank could not use it
                self.delivered_bytes.labels(rank=str(rank)).inc(info.bytes_delivered)
        self.sessions.labels(outcome=summary.state).inc()
        if error is not None:
            self.session_failures.labels(type=error).inc()
        if times.started is not None and times.first_ready is not None:
            self.first_tensor_seconds.labels(scheme=scheme).observe(times.first_ready - times.started)
        if summary.state == "done" and times.started is not None and times.ended is not None:
            self.load_seconds.labels(scheme=scheme).observe(times.ended - times.started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
