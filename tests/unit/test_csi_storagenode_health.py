"""The CSI plugin's view of a storage node's Health answer, and the background checks.

The backend client is replaced by a stub answering what each test sets:
these tests are about what the plugin makes of an answer (up or down, the
gauge, the log line on a change, the volume condition), not about the call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from backend.api.proto import backend_pb2
from csi import messages
from csi.config import PluginConfig, StorageNodeConfig
from csi.storagenodehealth import UP_METRIC, StorageNodeHealth
from csi.storagenodes import PROBE_TIMEOUT, StorageNodes


class _Client:
    def __init__(self, answer: backend_pb2.HealthResponse) -> None:
        self.answer = answer

    def health(self, timeout: float | None = None) -> backend_pb2.HealthResponse:
        return self.answer


def _nodes(monkeypatch: pytest.MonkeyPatch, answer: backend_pb2.HealthResponse) -> StorageNodes:
    nodes = StorageNodes(PluginConfig(storage_nodes=(StorageNodeConfig("sn1", "unix:/x"),)))
    client: Any = _Client(answer)
    monkeypatch.setattr(nodes, "client", lambda name, secrets=None: client)
    return nodes


def test_a_node_low_on_space_but_serving_keeps_the_plugin_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = backend_pb2.HealthResponse(
        ok=False, serving=True, low_space=True, message="pool free space 3% (still serving)"
    )
    health = _nodes(monkeypatch, answer).health("sn1")
    assert health.ok
    assert "3%" in health.message


def test_a_node_that_does_not_serve_counts_as_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = backend_pb2.HealthResponse(ok=False, serving=False, message="ganesha is down")
    health = _nodes(monkeypatch, answer).health("sn1")
    assert not health.ok
    assert "ganesha is down" in health.message


# ------------------------------------------------------------ background checks


class _Switch:
    """A client whose Health answer the test changes; an RpcError when ``down``."""

    def __init__(self) -> None:
        self.down: str | None = None

    def health(self, timeout: float | None = None) -> backend_pb2.HealthResponse:
        assert timeout is not None and timeout <= PROBE_TIMEOUT  # every call is bounded
        if self.down is not None:
            raise _Unavailable(self.down)
        return backend_pb2.HealthResponse(ok=True, serving=True, message="ok")


class _Unavailable(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def _watched(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[StorageNodeHealth, _Switch, CollectorRegistry]:
    nodes = StorageNodes(PluginConfig(storage_nodes=(StorageNodeConfig("sn1", "unix:/x"),)))
    switch = _Switch()
    client: Any = switch
    monkeypatch.setattr(nodes, "client", lambda name, secrets=None: client)
    registry = CollectorRegistry()
    return StorageNodeHealth(nodes, interval=60, registry=registry), switch, registry


def _up(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value(UP_METRIC, {"storage_node": "sn1"})


def test_each_check_sets_the_gauge_and_keeps_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, switch, registry = _watched(monkeypatch)
    assert _up(registry) is None and watch.nodes.problem("sn1") is None  # never asked
    watch.check("sn1")
    assert _up(registry) == 1.0 and watch.nodes.problem("sn1") is None
    switch.down = "connection refused"
    watch.check("sn1")
    assert _up(registry) == 0.0
    assert watch.nodes.problem("sn1") == "storage node sn1: connection refused"
    switch.down = None
    watch.check("sn1")
    assert _up(registry) == 1.0 and watch.nodes.problem("sn1") is None


def test_a_line_is_logged_when_a_node_changes_never_while_it_stays(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    watch, switch, _ = _watched(monkeypatch)
    caplog.set_level(logging.INFO, logger="moorage.csi.storagenodes")
    watch.check("sn1")
    switch.down = "connection refused"
    for _ in range(3):
        watch.check("sn1")
    switch.down = None
    for _ in range(3):
        watch.check("sn1")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "up: storage node sn1: ok"),
        ("WARNING", "down: storage node sn1: connection refused"),
        ("INFO", "up: storage node sn1: ok"),
    ]


def test_the_checks_run_in_the_background_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, switch, registry = _watched(monkeypatch)
    switch.down = "connection refused"
    watch.interval = 0.01
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while _up(registry) != 0.0:
            assert time.monotonic() < deadline, "no check ran"
            time.sleep(0.01)
    finally:
        watch.stop()
    assert not any(t.name == "health-sn1" for t in threading.enumerate())


def test_a_node_last_seen_down_makes_its_volumes_abnormal() -> None:
    volume = backend_pb2.Volume(id="v1", state="ready")
    assert not messages.condition(volume).abnormal
    condition = messages.condition(volume, "storage node sn1: ganesha is not running")
    assert condition.abnormal
    assert condition.message == "volume is ready; storage node sn1: ganesha is not running"
