"""The storage node's Prometheus metrics, on a port of their own (``--metrics-listen``).

Read at scrape time, so they cost nothing between scrapes:

- ``moorage_volumes{type,state}``: volumes in the catalog;
- ``moorage_capacity_bytes{kind}``: the pool's ``total`` and ``free`` bytes,
  what is ``provisioned`` and what new volumes may still be given (``available``);
- ``moorage_pool_low_space``: 1 while the pool's free space is under
  ``--low-space-percent`` of it (health is then not ok), else 0;
- ``moorage_quarantined_images``: images in ``POOL/quarantine`` the catalog
  did not know at start, left for the operator (``moorage pool orphans``);
- ``moorage_nbd_exports`` and ``moorage_nbd_connections``: NBD exports and
  their open connections; ``moorage_nbd_requests_total``,
  ``moorage_nbd_read_bytes_total``, ``moorage_nbd_written_bytes_total``,
  ``moorage_nbd_errors_total`` and ``moorage_nbd_request_seconds_total`` (from
  reading each request to queueing its reply: over the requests, the mean
  service time): what every export did, summed (an export's counts are kept
  when it goes, up to its last scrape);
- only with ``detail`` (``--metrics-detail``), as the port has no
  authentication and export names are volume ids with node names:
  ``moorage_nbd_export_requests_total``, ``..._read_bytes_total``,
  ``..._written_bytes_total``, ``..._errors_total``, ``..._request_seconds_total`` and
  ``moorage_nbd_export_connections``, each by ``export`` (one per publication;
  a counter starts again when its export is made anew);
- ``moorage_ganesha_up`` and ``moorage_ganesha_restarts_total``;
- ``moorage_backend_operation_seconds{method,code}``: every API call, timed
  (observed by the gRPC server's error interceptor).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from backend import quarantine
from backend.catalog.models import Volume
from backend.service import StorageService
from backend.views import low_space_problem
from hostio.addresses import HostPort
from nbd.exports import ExportStats

log = logging.getLogger("moorage.backend.metrics")

REGISTRY = CollectorRegistry()
# ExportStats' counters: the metric's name (moorage_nbd_NAME_total), its help
# text, and the factor to its unit
_NBD_COUNTERS = {
    "requests": ("requests", "NBD requests.", 1),
    "read_bytes": ("read_bytes", "Bytes read over NBD.", 1),
    "written_bytes": ("written_bytes", "Bytes written over NBD.", 1),
    "errors": ("errors", "NBD requests answered with an error.", 1),
    "service_ns": (
        "request_seconds",
        "Seconds from reading each NBD request to queueing its reply, summed.",
        1e-9,
    ),
}
OPERATION_SECONDS = Histogram(
    "moorage_backend_operation_seconds",
    "Backend API calls by method and status code.",
    ["method", "code"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)


class StorageNodeCollector(Collector):
    def __init__(
        self,
        service: StorageService,
        nbd_stats: Callable[[], list[tuple[str, ExportStats, int]]],
        ganesha: Callable[[], tuple[bool, int]],
        *,
        detail: bool = False,
    ) -> None:
        self.service = service
        self.nbd_stats = nbd_stats
        self.ganesha = ganesha
        # per-export series (export names: volume ids and node names) only if asked
        self.detail = detail
        # the node-wide NBD counters: what exports gone (or made anew) had
        # counted at the last scrape, plus what each export has counted
        self._nbd_lock = threading.Lock()
        self._nbd_retired = ExportStats()
        self._nbd_last: dict[str, ExportStats] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        started = time.monotonic()
        volumes = GaugeMetricFamily(
            "moorage_volumes", "Volumes by type and state.", labels=["type", "state"]
        )
        query = select(Volume.type, Volume.state, func.count()).group_by(Volume.type, Volume.state)
        with self.service.catalog.read_session() as s:
            for vtype, vstate, count in s.execute(query):
                volumes.add_metric([vtype.value, vstate.value], count)
        yield volumes
        cap = self.service.capacity()
        capacity = GaugeMetricFamily(
            "moorage_capacity_bytes", "The pool's capacity.", labels=["kind"]
        )
        for what, value in (
            ("total", cap.total_bytes),
            ("free", cap.free_bytes),
            ("provisioned", cap.provisioned_bytes),
            ("available", cap.available_bytes),
        ):
            capacity.add_metric([what], value)
        yield capacity
        percent = self.service.config.low_space_percent
        low = low_space_problem(cap.total_bytes, cap.free_bytes, percent)
        yield GaugeMetricFamily(
            "moorage_pool_low_space", "The pool is low on free space.", value=int(low is not None)
        )
        yield GaugeMetricFamily(
            "moorage_quarantined_images",
            "Images the catalog did not know, in POOL/quarantine (moorage pool orphans).",
            value=quarantine.count(self.service.pool),
        )
        exports = self.nbd_stats()
        yield from self._nbd_totals(exports)
        if self.detail:
            yield from self._nbd_per_export(exports)
        up, restarts = self.ganesha()
        yield GaugeMetricFamily("moorage_ganesha_up", "ganesha serves NFS.", value=int(up))
        yield CounterMetricFamily(
            "moorage_ganesha_restarts", "ganesha restarts by its supervisor.", value=restarts
        )
        log.debug("metrics collected in %.3f s", time.monotonic() - started)

    def _nbd_totals(
        self, exports: list[tuple[str, ExportStats, int]]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Node-wide NBD series, without export names; the counters never go back."""
        with self._nbd_lock:
            now = {name: stats for name, stats, _ in exports}
            for name, last in self._nbd_last.items():
                current = now.get(name)
                if current is None or any(
                    getattr(current, f) < getattr(last, f) for f in _NBD_COUNTERS
                ):  # gone, or made anew (its counters started again)
                    for f in _NBD_COUNTERS:
                        setattr(
                            self._nbd_retired, f, getattr(self._nbd_retired, f) + getattr(last, f)
                        )
            self._nbd_last = now
            totals = {
                f: getattr(self._nbd_retired, f) + sum(getattr(s, f) for s in now.values())
                for f in _NBD_COUNTERS
            }
        yield GaugeMetricFamily("moorage_nbd_exports", "NBD exports.", value=len(exports))
        yield GaugeMetricFamily(
            "moorage_nbd_connections",
            "Open NBD connections.",
            value=sum(open_connections for _, _, open_connections in exports),
        )
        for f, (name, text, unit) in _NBD_COUNTERS.items():
            yield CounterMetricFamily(f"moorage_nbd_{name}", text, value=totals[f] * unit)

    def _nbd_per_export(
        self, exports: list[tuple[str, ExportStats, int]]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The same by export: export names are volume ids with node names."""
        per_export = {
            field: CounterMetricFamily(f"moorage_nbd_export_{name}", text, labels=["export"])
            for field, (name, text, _) in _NBD_COUNTERS.items()
        }
        connections = GaugeMetricFamily(
            "moorage_nbd_export_connections", "Open NBD connections.", labels=["export"]
        )
        for name, stats, open_connections in exports:
            for field, family in per_export.items():
                family.add_metric([name], getattr(stats, field) * _NBD_COUNTERS[field][2])
            connections.add_metric([name], open_connections)
        yield from per_export.values()
        yield connections


def serve_metrics(listen: HostPort, collector: StorageNodeCollector) -> None:
    """Serve :data:`REGISTRY`, with ``collector`` in it, over HTTP on ``listen``
    (no host: every address)."""
    try:
        start_http_server(listen.port, addr=listen.host or "0.0.0.0", registry=REGISTRY)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {listen}: {e.strerror or e}") from e
    REGISTRY.register(collector)
    log.info("metrics on http://%s/metrics", listen)
