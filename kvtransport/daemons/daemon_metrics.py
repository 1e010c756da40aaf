"""A Prometheus endpoint for the daemons (``--metrics-port``), from the stats they keep.

Nothing here touches the data plane's hot path. Two sources feed one registry:

- every finished transfer's record (the JSON line ``--stats`` writes: the daemons hand it
  to their stats writer, which :class:`MetricsStats` wraps) updates counters and
  histograms: transfers by outcome, bytes, utility at the deadline, repair ratio and
  policy decision latency;
- at scrape time a collector reads the engine's live ``stats()``: transfers in flight,
  datagrams dropped by reason, the UDP socket's counters, control requests.

The HTTP server is prometheus_client's (its own thread; the ``metrics`` extra). Metric
names (all prefixed ``kvtransport_``)::

    transfers_total{role, outcome}           finished transfers (sender: finish reason,
                                             receiver: complete/deadline/abort/...)
    transfer_bytes_total{role}               bytes of finished transfers (sender: submitted,
                                             receiver: announced by the manifest)
    delivered_bytes_total{role}              sender: bytes the receiver decoded in order;
                                             receiver: bytes of complete blocks' symbols
    utility_at_deadline{role="receiver"}     histogram of the utility recovered per transfer
    repair_ratio{role}                       histogram of repair / source symbols per transfer
    decision_latency_seconds{role="sender"}  histogram of per-transfer mean policy decision
                                             time; decision_latency_p99_seconds: the last one's
    active_transfers{role}                   in flight now
    dropped_datagrams_total{role, reason}    datagrams dropped, by reason
    socket_{datagrams,bytes}_{sent,received}_total{role}, control_requests_total{role}
    pacing_mbps{role="sender"}               the link's pacing rate now (below its rate
                                             while the queue guard caps it)
    queue_cuts_total{role="sender"}          times the queue guard lowered it
"""

from __future__ import annotations

import logging
from typing import Any

from kvtransport.errors import UserError
from kvtransport.extras import require

log = logging.getLogger("kvtransport.metrics")

UTILITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
LATENCY_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3)
SOCKET_COUNTERS = ("datagrams_sent", "bytes_sent", "datagrams_received", "bytes_received")


def parse_metrics_address(spec: str) -> tuple[str, int]:
    """``--metrics-port``: ``PORT`` (on 127.0.0.1) or ``HOST:PORT``; UserError otherwise."""
    host, sep, port = spec.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        value = int(port)
    except ValueError:
        raise UserError(f"--metrics-port {spec!r} is not PORT or HOST:PORT") from None
    if not 0 <= value <= 65535:
        raise UserError(f"--metrics-port {spec!r}: port must be 0..65535")
    return host or "127.0.0.1", value


class DaemonMetrics:
    """One daemon's registry: transfer records in, a scrape collector over its engine."""

    def __init__(self, role: str) -> None:
        prom = require("prometheus_client")
        self.role = role
        self.registry = prom.CollectorRegistry(auto_describe=True)
        labels = ["role"]
        r = self.registry
        self.transfers = prom.Counter(
            "kvtransport_transfers", "finished transfers by outcome", ["role", "outcome"],
            registry=r,
        )  # fmt: skip
        self.transfer_bytes = prom.Counter(
            "kvtransport_transfer_bytes", "bytes of finished transfers", labels, registry=r
        )
        self.delivered_bytes = prom.Counter(
            "kvtransport_delivered_bytes",
            "bytes that arrived usable (sender: decoded in order at the receiver)",
            labels,
            registry=r,
        )
        self.utility = prom.Histogram(
            "kvtransport_utility_at_deadline", "utility recovered per transfer", labels,
            buckets=UTILITY_BUCKETS, registry=r,
        )  # fmt: skip
        self.repair_ratio = prom.Histogram(
            "kvtransport_repair_ratio", "repair / source symbols per transfer", labels,
            buckets=RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.decision = prom.Histogram(
            "kvtransport_decision_latency_seconds",
            "mean policy decision time per transfer",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_p99 = prom.Gauge(
            "kvtransport_decision_latency_p99_seconds",
            "99th percentile policy decision time of the last finished transfer",
            labels,
            registry=r,
        )
        self.daemon: Any = None
        self._server: Any = None
        self._thread: Any = None

    # ------------------------------------------------------------------ transfers

    def record(self, rec: dict[str, Any]) -> None:
        """Account one finished transfer's record (the ``--stats`` JSON line)."""
        role = self.role
        if rec.get("role") not in (None, role):
            return
        if role == "sender":
            outcome = str(rec.get("finish_reason") or "unknown")
            source, repair = rec.get("source_sent", 0), rec.get("repair_sent", 0)
            delivered = rec.get("delivered_bytes", 0)
            dec = rec.get("decisions") or {}
            if dec.get("n"):
                self.decision.labels(role).observe(dec["mean_us"] * 1e-6)
                self.decision_p99.labels(role).set(dec["p99_us"] * 1e-6)
        else:
            outcome = str(rec.get("reason") or "unknown")
            source, repair = rec.get("source_received", 0), rec.get("repair_received", 0)
            delivered = 0
            if rec.get("bytes") and rec.get("blocks"):
                delivered = rec["bytes"] * rec.get("blocks_complete", 0) / rec["blocks"]
            self.utility.labels(role).observe(float(rec.get("utility", 0.0)))
        self.transfers.labels(role, outcome).inc()
        self.transfer_bytes.labels(role).inc(float(rec.get("bytes") or 0))
        self.delivered_bytes.labels(role).inc(float(delivered))
        if source:
            self.repair_ratio.labels(role).observe(repair / source)

    # ------------------------------------------------------------------ live state

    def attach(self, daemon: Any) -> None:
        """Read ``daemon.engine.stats()`` (and its control server) at every scrape."""
        self.daemon = daemon
        self.registry.register(_LiveCollector(self))

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (``/metrics``); returns the port it listens on."""
        prom = require("prometheus_client")
        try:
            self._server, self._thread = prom.start_http_server(port, host, self.registry)
        except OSError as exc:
            raise UserError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        bound = int(self._server.server_address[1])
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _LiveCollector:
    """Scrape-time values from the engine (read from the HTTP thread: the engine's
    ``stats()`` copies its dicts; a copy that races the loop is retried)."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        daemon, role = self.metrics.daemon, self.metrics.role
        stats = None
        for _ in range(5):
            try:
                stats = daemon.engine.stats()
                break
            except RuntimeError:  # a dict changed size under the copy: read again
                continue
        if stats is None:
            return
        active = GaugeMetricFamily(
            "kvtransport_active_transfers", "transfers in flight", labels=["role"]
        )
        active.add_metric([role], stats.get("active", 0))
        yield active
        drops = CounterMetricFamily(
            "kvtransport_dropped_datagrams", "datagrams dropped, by reason",
            labels=["role", "reason"],
        )  # fmt: skip
        for reason, n in sorted(stats.get("drop_reasons", {}).items()):
            drops.add_metric([role, reason], n)
        yield drops
        sock = stats.get("socket", {})
        for name in SOCKET_COUNTERS:
            c = CounterMetricFamily(f"kvtransport_socket_{name}", f"UDP {name}", labels=["role"])
            c.add_metric([role], sock.get(name, 0))
            yield c
        if "pacing_mbps" in stats:  # a sender host (kvtransport.hosts.sender_host)
            g = GaugeMetricFamily(
                "kvtransport_pacing_mbps",
                "the link's pacing rate (below --rate-mbps while the queue guard caps it)",
                labels=["role"],
            )
            g.add_metric([role], stats["pacing_mbps"])
            yield g
            c = CounterMetricFamily(
                "kvtransport_queue_cuts", "times the queue guard lowered the pacing rate",
                labels=["role"],
            )  # fmt: skip
            c.add_metric([role], stats["queue_cuts"])
            yield c
        control = getattr(daemon, "control", None)
        if control is not None:
            c = CounterMetricFamily(
                "kvtransport_control_requests", "control requests answered", labels=["role"]
            )
            c.add_metric([role], control.requests)
            yield c


class MetricsStats:
    """A stats writer (kvtransport.daemons.daemon.StatsWriter) that also feeds the metrics."""

    def __init__(self, writer: Any, metrics: DaemonMetrics) -> None:
        self.writer = writer
        self.metrics = metrics

    def write(self, record: dict[str, Any]) -> None:
        self.writer.write(record)
        try:
            self.metrics.record(record)
        except (TypeError, ValueError, KeyError) as exc:  # never let metrics stop a daemon
            log.warning("metrics: transfer record not counted: %s", exc)

    def close(self) -> None:
        self.writer.close()
        self.metrics.close()
