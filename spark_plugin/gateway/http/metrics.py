"""``sos gateway --metrics HOST:PORT``: the gateway's Prometheus endpoint (docs/DEPLOY.md,
Gateway metrics), answering "is my checkpoint protected?":

- the spool's lag behind the SOS server: bytes, records, and seconds since the oldest record
  not yet durable there (from samples of the writer's last sequence number every
  SAMPLE_INTERVAL s: exact to that interval);
- the writer's state (``sos_gateway_writer_state{state}``: 1 for the current one of ok,
  retrying, quota_exceeded, failed, closed) and its replicator's errors;
- the latency of the barriers (what a sync RENAME, DELETE or file body waits for) and their
  number (``sos_gateway_barrier_waits_total``: with ``--barrier commit`` a few per batch, not
  one per state file), and the batches whose commit is refused after a rebuild (protocol.md 3.4);
- the last batch committed per checkpoint: a RENAME (or rename2) onto ``CHECKPOINT/commits/N``
  this gateway performed, its number and Unix time;
- whether a newer writer fenced the gateway;
- the requests served by operation (the same bounded set of names as the stop summary).

Series are computed at scrape time by a collector over the gateway's own state; the barriers
and the renames are what the namespace tells its observer (:class:`GatewayMetrics` is one,
:class:`~spark_plugin.gateway.webhdfs.core.NamespaceObserver`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spark_plugin.gateway.http.server import Gateway
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace

__all__ = ["MAX_CHECKPOINTS", "SAMPLE_INTERVAL", "WRITER_STATES", "GatewayMetrics", "commit_of"]

log = logging.getLogger(__name__)

#: the writer's states (JournalWriter.status()["state"])
WRITER_STATES = ("ok", "retrying", "quota_exceeded", "failed", "closed")
#: how often the writer's last sequence number is sampled for the lag in seconds
SAMPLE_INTERVAL = 0.5
#: at most this many checkpoints get a series of their own (the oldest-committed beyond it
#: are dropped: a label's values stay few)
MAX_CHECKPOINTS = 256
_BARRIER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def commit_of(rel: str) -> tuple[str, int] | None:
    """(checkpoint as an absolute path, batch) if ``rel`` (namespace-relative) is
    ``CHECKPOINT/commits/N``."""
    parent, _, name = rel.rpartition("/")
    if not (name.isascii() and name.isdigit()):
        return None
    if parent == "commits":
        return "/", int(name)
    if parent.endswith("/commits"):
        return "/" + parent[: -len("/commits")], int(name)
    return None


class GatewayMetrics(Collector):
    """The gateway's series (module docstring); the namespace's observer
    (:meth:`barrier_waited`, :meth:`renamed`), :meth:`serve` starts the endpoint,
    :meth:`close` stops the sampler."""

    def __init__(self, gateway: Gateway, ns: WebHdfsNamespace) -> None:
        self.gateway = gateway
        self.ns = ns
        self.registry = CollectorRegistry()
        self.barrier_seconds = Histogram(
            "sos_gateway_barrier_seconds",
            "Time a barrier waited until the journal was durable (sync RENAME, "
            "DELETE, TRUNCATE, MKDIRS and file bodies)",
            buckets=_BARRIER_BUCKETS,
            registry=self.registry,
        )
        self.barrier_waits = Counter(
            "sos_gateway_barrier_waits",
            "Requests that waited for a barrier (protocol.md 3.4: with --barrier commit, a "
            "checkpoint's state files are answered without one)",
            registry=self.registry,
        )
        self.registry.register(self)
        self._lock = threading.Lock()
        self.commits: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._samples: collections.deque[tuple[int, float]] = collections.deque()  # (last seq, time)
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._httpd: Any = None

    # ------------------------------------------------------------------ the namespace's observer
    def barrier_waited(self, seconds: float) -> None:
        self.barrier_seconds.observe(seconds)
        self.barrier_waits.inc()

    def renamed(self, rel_dst: str) -> None:
        found = commit_of(rel_dst)
        if found is not None:
            self.committed(*found)

    def committed(self, checkpoint: str, batch: int) -> None:
        with self._lock:
            self.commits[checkpoint] = (batch, time.time())
            self.commits.move_to_end(checkpoint)
            while len(self.commits) > MAX_CHECKPOINTS:
                self.commits.popitem(last=False)

    # ------------------------------------------------------------------ lag
    def sample(self) -> None:
        """Note the writer's last sequence number now; forget samples already durable."""
        writer = self.ns.writer
        if writer is None:
            return
        status = writer.status()
        last, acked = int(status["last_seq"]), int(status["acked_seq"])
        now = time.time()
        with self._lock:
            if not self._samples or self._samples[-1][0] != last:
                self._samples.append((last, now))
            while len(self._samples) > 1 and self._samples[1][0] <= acked:
                self._samples.popleft()  # a newer sample is durable too: the oldest is not needed
            if self._samples and self._samples[0][0] <= acked:
                self._samples.popleft()

    def lag_seconds(self, acked: int) -> float:
        """Seconds since the oldest record not durable on the server was first seen (0: none)."""
        with self._lock:
            for seq, when in self._samples:
                if seq > acked:
                    return max(0.0, time.time() - when)
        return 0.0

    def _run_sampler(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL):
            try:
                self.sample()
            except Exception:
                log.exception("metrics: sampling the writer failed")

    # ------------------------------------------------------------------ collector
    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._collect())
        except Exception:  # a scrape must not fail the endpoint: logged, the series left out
            log.exception("gateway metrics failed")
            return []

    def _collect(self) -> Iterable[Metric]:
        writer = self.ns.writer
        fenced = GaugeMetricFamily(
            "sos_gateway_fenced",
            "1 once a newer writer fenced this gateway (it then refuses every request and exits with code 3)",
        )
        fenced.add_metric([], 1.0 if self.gateway.fenced is not None else 0.0)
        yield fenced
        up = GaugeMetricFamily("sos_gateway_up", "1 while the gateway serves (0 while it drains or is fenced)")
        up.add_metric([], 0.0 if (self.gateway.draining or self.gateway.fenced is not None) else 1.0)
        yield up
        in_flight = GaugeMetricFamily(
            "sos_gateway_batches_in_flight",
            "Batches in flight when the cache was rebuilt from the server, whose commit is refused "
            "until the query runs them again (protocol.md 3.4)",
        )
        in_flight.add_metric([], float(len(self.ns.inflight.batches)))
        yield in_flight
        if writer is not None:
            self.sample()
            status = writer.status()
            acked = int(status["acked_seq"])
            lag_b = GaugeMetricFamily(
                "sos_gateway_spool_lag_bytes", "Journal bytes in the spool not yet durable on the SOS server"
            )
            lag_b.add_metric([], float(status["unshipped_bytes"]))
            lag_r = GaugeMetricFamily(
                "sos_gateway_spool_lag_records", "Journal records not yet durable on the SOS server"
            )
            lag_r.add_metric([], float(max(0, int(status["last_seq"]) - acked)))
            lag_s = GaugeMetricFamily(
                "sos_gateway_spool_lag_seconds",
                "Age of the oldest journal record not yet durable on the SOS server (0: none)",
            )
            lag_s.add_metric([], self.lag_seconds(acked))
            state = GaugeMetricFamily(
                "sos_gateway_writer_state", "The journal writer's state: 1 for the current one", labels=["state"]
            )
            for name in WRITER_STATES:
                state.add_metric([name], 1.0 if status["state"] == name else 0.0)
            errors = CounterMetricFamily(
                "sos_gateway_replicator_errors",
                "Errors of the replicator shipping the journal (each retried; a fatal one, e.g. fenced, stops it)",
            )
            errors.add_metric([], float(int(status["reconnects"]) + (1 if status["state"] == "failed" else 0)))
            epoch = GaugeMetricFamily("sos_gateway_writer_epoch", "The fence epoch this gateway's writer holds")
            epoch.add_metric([], float(status["epoch"]))
            gen = GaugeMetricFamily("sos_gateway_journal_generation", "The journal generation being written")
            gen.add_metric([], float(status["generation"]))
            yield from (lag_b, lag_r, lag_s, state, errors, epoch, gen)
        batch = GaugeMetricFamily(
            "sos_gateway_last_commit_batch",
            "Last batch committed per checkpoint (a rename onto CHECKPOINT/commits/N through this gateway)",
            labels=["checkpoint"],
        )
        when = GaugeMetricFamily(
            "sos_gateway_last_commit_timestamp_seconds", "Unix time of that commit", labels=["checkpoint"]
        )
        with self._lock:
            commits = list(self.commits.items())
        for checkpoint, (n, t) in commits:
            batch.add_metric([checkpoint], float(n))
            when.add_metric([checkpoint], t)
        yield batch
        yield when
        reqs = CounterMetricFamily(
            "sos_gateway_requests", "Requests with a valid token served, by operation", labels=["op"]
        )
        secs = CounterMetricFamily(
            "sos_gateway_request_seconds", "Time spent serving them, by operation", labels=["op"]
        )
        for op, s in sorted(list(self.gateway.stats.items())):
            reqs.add_metric([op], float(s.count))
            secs.add_metric([op], s.seconds)
        yield reqs
        yield secs

    # ------------------------------------------------------------------ endpoint
    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Start the endpoint (a daemon thread) and the sampler; returns the bound address."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        self._sampler = threading.Thread(target=self._run_sampler, name="sos-gateway-metrics", daemon=True)
        self._sampler.start()
        return host, int(httpd.server_port)

    def close(self) -> None:
        self._stop.set()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


def serve_metrics(
    gateway: Gateway, ns: WebHdfsNamespace, listen: str, parse: Callable[[str], tuple[str, int]]
) -> GatewayMetrics:
    """Observe ``ns`` and serve the endpoint on ``listen`` (parsed by ``parse``)."""
    host, port = parse(listen)
    metrics = GatewayMetrics(gateway, ns)
    ns.observer = metrics
    bound = metrics.serve(host, port)
    log.info("metrics on http://%s:%d/metrics", *bound)
    return metrics
