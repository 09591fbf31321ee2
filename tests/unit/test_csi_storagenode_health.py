"""The CSI plugin's view of a storage node's Health answer."""

from __future__ import annotations

from typing import Any

import pytest

from backend.proto import backend_pb2
from csi.config import PluginConfig, StorageNodeConfig
from csi.storagenodes import StorageNodes


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


def test_a_node_that_does_not_serve_makes_the_plugin_not_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = backend_pb2.HealthResponse(ok=False, serving=False, message="ganesha is down")
    health = _nodes(monkeypatch, answer).health("sn1")
    assert not health.ok
    assert "ganesha is down" in health.message
