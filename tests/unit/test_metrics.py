"""The storage node's metrics name no volume or node unless asked (``--metrics-detail``).

The metrics port has no authentication; NBD export names are
``<volume-id>@<node-id>``.  The collector runs here on a fake service (a real
SQLite catalog, a fixed capacity, the default configuration);
tests/integration/test_backend_metrics.py scrapes a real daemon.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from backend.catalog.db import Catalog
from backend.metrics import StorageNodeCollector
from backend.operation import ServiceConfig
from backend.pool import Pool
from backend.service import StorageService
from backend.views import CapacityInfo
from nbd.exports import ExportStats

VOLUME = "0123456789abcdef0123456789abcdef"
EXPORTS = [f"{VOLUME}@node-a", f"{VOLUME}@node-b"]


class FakeService:
    def __init__(self, catalog: Catalog, pool: Pool) -> None:
        self.catalog = catalog
        self.config = ServiceConfig()
        self.pool = pool

    def capacity(self) -> CapacityInfo:
        return CapacityInfo(10 << 30, 8 << 30, 1 << 30, 1.0, 9 << 30)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[StorageService]:
    catalog = Catalog.for_data_dir(tmp_path)
    catalog.migrate()
    try:
        yield cast(StorageService, FakeService(catalog, Pool(tmp_path / "pool")))
    finally:
        catalog.dispose()


def scrape(collector: StorageNodeCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in\n{text}"
    return float(m[1])


def collector(
    service: StorageService, exports: list[tuple[str, ExportStats, int]], detail: bool = False
) -> StorageNodeCollector:
    return StorageNodeCollector(service, lambda: exports, lambda: (True, 0), detail=detail)


def stats(written: int) -> ExportStats:
    return ExportStats(requests=written // 4096, read_bytes=0, written_bytes=written, errors=0)


def test_by_default_no_volume_or_node_is_named(service: StorageService) -> None:
    text = scrape(collector(service, [(EXPORTS[0], stats(4096), 1), (EXPORTS[1], stats(8192), 2)]))
    assert VOLUME not in text
    assert "node-a" not in text and "node-b" not in text
    assert "export=" not in text
    assert sample(text, "moorage_nbd_exports") == 2
    assert sample(text, "moorage_nbd_connections") == 3
    assert sample(text, "moorage_nbd_written_bytes_total") == 12288
    assert sample(text, "moorage_nbd_requests_total") == 3
    assert sample(text, "moorage_ganesha_up") == 1


def test_with_detail_each_export_has_its_series(service: StorageService) -> None:
    exports = [(EXPORTS[0], stats(4096), 1), (EXPORTS[1], stats(8192), 2)]
    text = scrape(collector(service, exports, detail=True))
    for name, st, connections in exports:
        labels = f'{{export="{name}"}}'
        assert sample(text, f"moorage_nbd_export_written_bytes_total{labels}") == st.written_bytes
        assert sample(text, f"moorage_nbd_export_connections{labels}") == connections
    assert sample(text, "moorage_nbd_written_bytes_total") == 12288  # the totals too


def test_the_totals_keep_what_exports_gone_or_made_anew_counted(service: StorageService) -> None:
    exports = [(EXPORTS[0], stats(40960), 1)]
    c = collector(service, exports)
    assert sample(scrape(c), "moorage_nbd_written_bytes_total") == 40960
    exports[:] = [(EXPORTS[1], stats(4096), 1)]  # the first export gone
    assert sample(scrape(c), "moorage_nbd_written_bytes_total") == 45056
    exports[:] = [(EXPORTS[1], stats(8192), 1), (EXPORTS[0], stats(4096), 1)]  # made anew
    assert sample(scrape(c), "moorage_nbd_written_bytes_total") == 53248
    exports[:] = [(EXPORTS[1], stats(4096), 1), (EXPORTS[0], stats(8192), 1)]  # B anew
    assert sample(scrape(c), "moorage_nbd_written_bytes_total") == 40960 + 8192 + 4096 + 8192


def test_quarantined_images_are_counted(service: StorageService) -> None:
    assert sample(scrape(collector(service, [])), "moorage_quarantined_images") == 0
    folder = service.pool.root / "quarantine"
    folder.mkdir(parents=True)
    (folder / f"volume-{VOLUME}.img").write_bytes(b"x")
    (folder / f"snapshot-{VOLUME}.1.img").write_bytes(b"y")
    (folder / "notes.txt").write_text("not an image")
    text = scrape(collector(service, []))
    assert sample(text, "moorage_quarantined_images") == 2
    assert VOLUME not in text


def test_the_time_spent_serving_nbd_requests_is_in_seconds(service: StorageService) -> None:
    exports = [
        (EXPORTS[0], ExportStats(requests=4, service_ns=3_000_000_000), 1),
        (EXPORTS[1], ExportStats(requests=2, service_ns=500_000_000), 1),
    ]
    text = scrape(collector(service, exports, detail=True))
    assert sample(text, "moorage_nbd_request_seconds_total") == 3.5
    assert sample(text, f'moorage_nbd_export_request_seconds_total{{export="{EXPORTS[1]}"}}') == 0.5
    assert sample(text, "moorage_nbd_requests_total") == 6
