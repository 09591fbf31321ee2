"""The storage node's Prometheus metrics, on a port of their own (``--metrics-listen``).

Read at scrape time, so they cost nothing between scrapes:

- ``moorage_volumes{type,state}``: volumes in the catalog;
- ``moorage_capacity_bytes{kind}``: the pool's ``total`` and ``free`` bytes,
  what is ``provisioned`` and what new volumes may still be given (``available``);
- ``moorage_nbd_export_requests_total``, ``..._read_bytes_total``,
  ``..._written_bytes_total``, ``..._errors_total`` and
  ``moorage_nbd_export_connections``, each by ``export`` (one per publication;
  a counter starts again when its export is made anew);
- ``moorage_ganesha_up`` and ``moorage_ganesha_restarts_total``;
- ``moorage_backend_operation_seconds{method,code}``: every API call, timed
  (observed in ``backend/api.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from backend.catalog.models import Volume
from backend.service import StorageService
from nbd.exports import ExportStats

log = logging.getLogger("moorage.backend.metrics")

REGISTRY = CollectorRegistry()
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
    ) -> None:
        self.service = service
        self.nbd_stats = nbd_stats
        self.ganesha = ganesha

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        started = time.monotonic()
        volumes = GaugeMetricFamily(
            "moorage_volumes", "Volumes by type and state.", labels=["type", "state"]
        )
        query = select(Volume.type, Volume.state, func.count()).group_by(Volume.type, Volume.state)
        with self.service.catalog.session() as s:
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
        per_export = {
            field: CounterMetricFamily(f"moorage_nbd_export_{field}", text, labels=["export"])
            for field, text in (
                ("requests", "NBD requests."),
                ("read_bytes", "Bytes read over NBD."),
                ("written_bytes", "Bytes written over NBD."),
                ("errors", "NBD requests answered with an error."),
            )
        }
        connections = GaugeMetricFamily(
            "moorage_nbd_export_connections", "Open NBD connections.", labels=["export"]
        )
        for name, stats, open_connections in self.nbd_stats():
            for field, family in per_export.items():
                family.add_metric([name], getattr(stats, field))
            connections.add_metric([name], open_connections)
        yield from per_export.values()
        yield connections
        up, restarts = self.ganesha()
        yield GaugeMetricFamily("moorage_ganesha_up", "ganesha serves NFS.", value=int(up))
        yield CounterMetricFamily(
            "moorage_ganesha_restarts", "ganesha restarts by its supervisor.", value=restarts
        )
        log.debug("metrics collected in %.3f s", time.monotonic() - started)


def serve_metrics(address: str, collector: StorageNodeCollector) -> None:
    """Serve :data:`REGISTRY`, with ``collector`` in it, over HTTP on HOST:PORT."""
    host, _, port = address.rpartition(":")
    try:
        start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=REGISTRY)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {address}: {e.strerror or e}") from e
    REGISTRY.register(collector)
    log.info("metrics on http://%s/metrics", address)
