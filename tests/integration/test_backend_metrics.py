"""The storage node's Prometheus metrics while a volume is written over NBD."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.backend_node import BackendNode, make_node
from tests.conftest import free_port
from tests.prometheus_text import scrape, scrape_text, value

FAMILIES = (
    "moorage_volumes",
    "moorage_capacity_bytes",
    "moorage_nbd_export_requests_total",
    "moorage_nbd_export_read_bytes_total",
    "moorage_nbd_export_written_bytes_total",
    "moorage_nbd_export_errors_total",
    "moorage_nbd_export_request_seconds_total",
    "moorage_nbd_export_connections",
    "moorage_nbd_exports",
    "moorage_nbd_connections",
    "moorage_nbd_requests_total",
    "moorage_nbd_read_bytes_total",
    "moorage_nbd_written_bytes_total",
    "moorage_nbd_errors_total",
    "moorage_nbd_request_seconds_total",
    "moorage_ganesha_up",
    "moorage_ganesha_restarts_total",
    "moorage_backend_operation_seconds_count",
)


def metered_node(root: Path, *extra: str) -> Iterator[tuple[BackendNode, int]]:
    port = free_port()
    node = make_node(root, extra_args=["--metrics-listen", f"127.0.0.1:{port}", *extra])
    try:
        node.start()
        yield node, port
    finally:
        node.teardown()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[BackendNode, int]]:
    """A node with metrics by export too (--metrics-detail)."""
    yield from metered_node(tmp_path / "node", "--metrics-detail")


@pytest.fixture
def plain_node(tmp_path: Path) -> Iterator[tuple[BackendNode, int]]:
    """A node with the default metrics: totals only."""
    yield from metered_node(tmp_path / "node")


def test_metrics_answer_and_the_byte_counters_move(node: tuple[BackendNode, int]) -> None:
    n, port = node
    with n.client() as c:
        v = c.create_volume(
            pb.CreateVolumeRequest(name="metered", type=pb.NBD, size_bytes=64 << 20)
        )
        target = c.publish(v.id, "n1", "127.0.0.1").nbd
    export = target.export_name
    uri = f"nbd://127.0.0.1:{target.port}/{export}"
    before = scrape(port)
    # a writer holds a connection open while the metrics are read
    writer = subprocess.Popen(
        [
            "qemu-io",
            "-f",
            "raw",
            "-c",
            "write -P 0x5a 0 32M",
            "-c",
            "flush",
            "-c",
            "read 0 8M",
            uri,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    during: list[dict[str, float]] = []
    scraper = threading.Thread(target=lambda: during.append(scrape(port)))
    scraper.start()
    assert writer.wait(120) == 0, writer.stderr.read() if writer.stderr else ""
    scraper.join()
    after = scrape(port)
    for family in FAMILIES:
        assert any(k.startswith(family) for k in after), f"{family} missing"
    assert value(after, "moorage_volumes", type="nbd", state="ready") == 1
    assert value(after, "moorage_ganesha_up") == 1
    assert value(after, "moorage_capacity_bytes", kind="provisioned") == 64 << 20
    assert value(after, "moorage_nbd_export_written_bytes_total", export=export) >= 32 << 20
    assert value(after, "moorage_nbd_export_read_bytes_total", export=export) >= 8 << 20
    written_before = before.get(f'moorage_nbd_export_written_bytes_total{{export="{export}"}}', 0)
    assert written_before < value(after, "moorage_nbd_export_written_bytes_total", export=export)
    assert value(after, "moorage_nbd_export_errors_total", export=export) == 0
    assert (
        value(after, "moorage_backend_operation_seconds_count", method="CreateVolume", code="OK")
        >= 1
    )
    assert during, "no scrape while the writer ran"


def test_by_default_the_metrics_name_no_volume_and_no_node(
    plain_node: tuple[BackendNode, int],
) -> None:
    n, port = plain_node
    with n.client() as c:
        v = c.create_volume(
            pb.CreateVolumeRequest(name="unnamed", type=pb.NBD, size_bytes=16 << 20)
        )
        target = c.publish(v.id, "secret-node", "127.0.0.1").nbd
    uri = f"nbd://127.0.0.1:{target.port}/{target.export_name}"
    subprocess.run(
        ["qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 1M", uri],
        check=True,
        capture_output=True,
        timeout=120,
    )
    text = scrape_text(port)
    assert v.id not in text
    assert "secret-node" not in text
    assert "export=" not in text
    samples = scrape(port)
    assert value(samples, "moorage_nbd_exports") == 1
    assert value(samples, "moorage_nbd_written_bytes_total") >= 1 << 20
    assert value(samples, "moorage_volumes", type="nbd", state="ready") == 1
