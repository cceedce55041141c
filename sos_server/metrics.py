"""Prometheus metrics of one server (its own registry, so tests can run many servers)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

__all__ = ["Metrics", "NamespaceStats", "NullMetrics"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamespaceStats:
    """One namespace's figures at a scrape (the ``sos_namespace_*`` series, label ``namespace``)."""

    namespace: str
    data_bytes: int  # its objects' data bytes
    objects: int
    charged_bytes: int  # what its byte quota counts: data + 4096 per object (+ objects being created)
    quota_bytes: int | None  # its byte quota (its own or --namespace-quota), None: none
    fence_epoch: int
    appends: int  # acknowledged appends since the server started
    append_bytes: int  # their data bytes
    last_append: float | None  # unix time of the last acknowledged append (before one: newest object file's mtime)


class _NamespaceCollector(Collector):
    """Builds the per-namespace series at each scrape from *source* (the engine's figures):
    nothing on the append path but two dict updates. Namespaces are made by the operator
    (a key is needed before one exists), so the label's values stay few."""

    def __init__(self, source: Callable[[], list[NamespaceStats]]) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self.source()
        except Exception:  # a scrape must not fail the endpoint: logged, the series left out
            log.exception("per-namespace metrics failed")
            return []
        ns = ["namespace"]
        data = GaugeMetricFamily("sos_namespace_bytes", "Data bytes stored in the namespace's objects", labels=ns)
        objects = GaugeMetricFamily("sos_namespace_objects", "Objects in the namespace", labels=ns)
        charged = GaugeMetricFamily(
            "sos_namespace_quota_used_bytes",
            "Bytes the namespace's byte quota counts: data bytes plus 4096 per object (protocol.md 1.9)",
            labels=ns,
        )
        quota = GaugeMetricFamily(
            "sos_namespace_quota_bytes",
            "The namespace's byte quota (its own, else serve --namespace-quota); absent when it has none",
            labels=ns,
        )
        fence = GaugeMetricFamily(
            "sos_namespace_fence_epoch", "The namespace's fence epoch (a new writer raises it)", labels=ns
        )
        last = GaugeMetricFamily(
            "sos_namespace_last_append_timestamp_seconds",
            "Unix time of the namespace's last durable (acknowledged) append; until one since the start, the"
            " newest object file's modification time; absent for a namespace without objects",
            labels=ns,
        )
        appends = CounterMetricFamily(
            "sos_namespace_appends", "Appends acknowledged (durable) in the namespace", labels=ns
        )
        appended = CounterMetricFamily(
            "sos_namespace_append_bytes", "Data bytes appended and acknowledged in the namespace", labels=ns
        )
        for st in stats:
            v = [st.namespace]
            data.add_metric(v, st.data_bytes)
            objects.add_metric(v, st.objects)
            charged.add_metric(v, st.charged_bytes)
            if st.quota_bytes is not None:
                quota.add_metric(v, st.quota_bytes)
            fence.add_metric(v, st.fence_epoch)
            if st.last_append is not None:
                last.add_metric(v, st.last_append)
            appends.add_metric(v, st.appends)
            appended.add_metric(v, st.append_bytes)
        return [data, objects, charged, quota, fence, last, appends, appended]


_M = TypeVar("_M", bound=MetricWrapperBase)  # a metric; its labels(...) child is of its own type

#: the tier's request and wait durations (a PUT to S3 Standard: 20-50 ms; moto here: 10-30 ms)
_TIER_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_SYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._request_metrics(self.registry)
        self._connection_metrics(self.registry)
        self._storage_metrics(self.registry)
        self._tier_metrics(self.registry)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """What the requests did: appends, reads, opcodes, errors, group-commit syncs."""
        self.appends = Counter("sos_appends", "Appends acknowledged (durable)", registry=r)
        self.append_bytes = Counter("sos_append_bytes", "Bytes appended and acknowledged", registry=r)
        self.read_bytes = Counter("sos_read_bytes", "Bytes returned by READ", registry=r)
        self.requests = Counter("sos_requests", "Requests handled, by opcode", ["op"], registry=r)
        self.errors = Counter("sos_errors", "ERROR replies sent, by code", ["code"], registry=r)
        self.sync_seconds = Histogram(
            "sos_sync_seconds",
            "Duration of one group-commit batch (all its fdatasyncs)",
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.sync_files = Counter("sos_synced_files", "fdatasync calls made by group commit", registry=r)

    def _connection_metrics(self, r: CollectorRegistry) -> None:
        """The connections: open, accepted, and closed for a timeout or to make room."""
        self.connections = Gauge("sos_open_connections", "Open client connections", registry=r)
        self.connections_total = Counter("sos_connections", "Connections accepted", registry=r)
        self.handshake_timeouts = Counter(
            "sos_handshake_timeouts",
            "Connections closed for not authenticating within --handshake-timeout",
            registry=r,
        )
        self.send_timeouts = Counter(
            "sos_send_timeouts",
            "Connections closed because their replies were not read within --send-timeout",
            registry=r,
        )
        self.unauthenticated = Gauge(
            "sos_unauthenticated_connections", "Open connections that have not authenticated yet", registry=r
        )
        self.evicted = Counter(
            "sos_unauthenticated_evicted",
            "Connections not authenticated yet closed (ERROR BUSY) to make room for a newcomer: the pre-AUTH"
            " pool (--max-unauthenticated) or --max-connections was full",
            registry=r,
        )

    def _storage_metrics(self, r: CollectorRegistry) -> None:
        """The data directory: retention, completed generations, open files, start-up repairs."""
        self.gc_removed = Counter("sos_gc_removed_objects", "Objects removed by retention", registry=r)
        self.generations_completed = Counter(
            "sos_generations_completed",
            "Journal generations whose ready object was sealed (retention counts them once --min-age old)",
            registry=r,
        )
        self.open_files = Gauge(
            "sos_open_object_files",
            "Object write descriptors open (at most --max-open-objects while clean)",
            registry=r,
        )
        self.repairs = Counter(
            "sos_torn_tail_repairs",
            "Object files whose torn tail (an unacknowledged write) was cut at start-up",
            registry=r,
        )
        self.damaged = Counter(
            "sos_damaged_ranges",
            "Damaged stretches of object files found at start-up and kept (READ of them, APPEND/SEAL to their"
            " objects answer CORRUPT)",
            registry=r,
        )

    def _tier_metrics(self, r: CollectorRegistry) -> None:
        """The object-store tier (serve --tier): per namespace, and the whole server's."""

        def per_namespace(kind: type[_M], name: str, documentation: str) -> _M:
            return kind(name, documentation, ["namespace"], registry=r)

        self.tier_lag_bytes = per_namespace(
            Gauge, "sos_tier_lag_bytes", "Bytes acknowledged (durable on this server) and not yet in the tier's store"
        )
        self.tier_lag_seconds = per_namespace(
            Gauge,
            "sos_tier_lag_seconds",
            "Age of the oldest acknowledged byte (or seal) not yet in the tier's store; 0 when none",
        )
        self.tier_last_error = per_namespace(
            Gauge,
            "sos_tier_last_error_timestamp_seconds",
            "When the last upload to the tier's store failed (Unix time)",
        )
        self.tier_failing = per_namespace(
            Gauge, "sos_tier_failing", "1 while uploads of the namespace fail (retried with back-off), else 0"
        )
        self.tier_fenced = per_namespace(
            Gauge,
            "sos_tier_fenced",
            "1 when the store holds a higher fence marker: another server took the namespace over"
            " and this one stopped uploading it",
        )
        self.tier_ignored_fences = per_namespace(
            Gauge,
            "sos_tier_ignored_fence_markers",
            "Fence markers in the store this server does not believe (empty, other content, far above every"
            " epoch known, or holding the key of its own marker): logged and ignored, never obeyed",
        )
        self.tier_uploaded_bytes = per_namespace(
            Counter, "sos_tier_uploaded_bytes", "Bytes this server wrote to the tier's store (pieces it created)"
        )
        self.tier_conflicts = per_namespace(
            Counter,
            "sos_tier_conflicts",
            "Objects whose upload a conflict stopped (a different piece exists in the store:"
            " a zombie server or damage; nothing is overwritten)",
        )
        self.tier_pieces = Counter(
            "sos_tier_pieces_written", "Pieces this server created in the tier's store", registry=r
        )
        self.tier_upload_errors = Counter(
            "sos_tier_upload_errors", "Failed rounds of uploads to the tier's store (each retried)", registry=r
        )
        self._tier_log_metrics(r)

    def _tier_log_metrics(self, r: CollectorRegistry) -> None:
        """The tier's flushes and compaction (protocol.md 4.3a, 4.3b) and its store requests."""
        self.tier_flushes = Counter(
            "sos_tier_flushes",
            "Flushed objects this server wrote (one PUT each, every namespace's new bytes)",
            registry=r,
        )
        self.tier_flush_bytes = Histogram(
            "sos_tier_flush_bytes",
            "Bytes per flushed object",
            buckets=(1024, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 8 << 20),
            registry=r,
        )
        self.tier_flush_objects = Histogram(
            "sos_tier_flush_objects", "Objects per flushed object", buckets=(1, 2, 5, 10, 30, 100, 1000), registry=r
        )
        self.tier_compacted = Counter(
            "sos_tier_compacted_flushes",
            "Flushed objects compaction deleted (their bytes are in per-object pieces)",
            registry=r,
        )
        self.tier_compaction_lag = Gauge(
            "sos_tier_compaction_lag_seconds",
            "Age of the oldest flushed object left after the last compaction pass (0: none)",
            registry=r,
        )
        self.tier_flushed_objects = Gauge(
            "sos_tier_flushed_objects_left",
            "Flushed objects the last compaction pass left in the store (named in a warning)",
            registry=r,
        )
        self.tier_object_pieces = Histogram(
            "sos_tier_object_pieces",
            "Pieces in an object's run after compaction wrote it (the last 64 at most)",
            buckets=(1, 2, 4, 8, 16, 24, 32, 64),
            registry=r,
        )
        self.tier_requests = Counter(
            "sos_tier_requests", "Requests to the tier's store, by operation", ["op"], registry=r
        )
        self.tier_request_seconds = Histogram(
            "sos_tier_request_seconds",
            "Duration of one request to the tier's store, by operation (a listing: all its pages)",
            ["op"],
            buckets=_TIER_BUCKETS,
            registry=r,
        )
        self.tier_wait_seconds = Histogram(
            "sos_tier_wait_seconds",
            "How long a TIER_WAIT answered OK waited on this server for the bucket (0 if it held the bytes)",
            buckets=_TIER_BUCKETS,
            registry=r,
        )

    def watch_namespaces(self, source: Callable[[], list[NamespaceStats]]) -> None:
        """Export the ``sos_namespace_*`` series from *source*, called at each scrape (in the
        endpoint's thread: it must only read)."""
        self.registry.register(_NamespaceCollector(source))

    def serve(self, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
        """Start the HTTP endpoint in a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)

    # small helpers so callers need not know prometheus
    def appended(self, nbytes: int) -> None:
        self.appends.inc()
        self.append_bytes.inc(nbytes)

    def synced(self, seconds: float, files: int) -> None:
        self.sync_seconds.observe(seconds)
        self.sync_files.inc(files)

    def error(self, name: str) -> None:
        self._child(self.errors, "code", name).inc()

    def request(self, op: str) -> None:
        self._child(self.requests, "op", op).inc()

    def _child(self, metric: _M, label: str, value: str) -> _M:
        """``metric.labels(label=value)``, looked up once per value (a per-request lookup
        was 6 % of the server's CPU at 4 KiB appends: docs/BENCHMARKS.md, step 6)."""
        children = self.__dict__.setdefault("_children", {})
        key = (id(metric), value)
        child: _M | None = children.get(key)
        if child is None:
            child = children[key] = metric.labels(**{label: value})
        return child


class NullMetrics(Metrics):
    """Metrics that go nowhere (unit tests of one layer)."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
