"""The plugin object in this process: what its start serves, its stop takes away.

``csi.plugin.Plugin`` in ``all`` mode with every listener asked for: the CSI
socket, kubelet's registration socket, ``/healthz`` and metrics, over real
unix sockets and TCP ports, and its background threads.  The storage node
its configuration names does not answer (nothing here needs one), and
nothing is mounted.  After ``stop()`` no socket file, no listener and no
thread of the plugin is left in this process.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from csi.config import PluginConfig, StorageNodeConfig
from csi.plugin import Plugin, ServeConfig, StartError
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.proto import pluginregistration_pb2 as reg
from csi.proto import pluginregistration_pb2_grpc as reg_grpc
from tests.conftest import free_port

HOST_PATH = "/var/lib/kubelet/plugins/csi.moorage.dev/csi.sock"
REGISTRATION_SOCKET = "csi.moorage.dev-reg.sock"


def new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads alive now that were not before: what the plugin left behind."""
    return {t for t in threading.enumerate() if t not in before and t.is_alive()}


def serve_config(root: Path) -> ServeConfig:
    # nothing listens on that port: the health checks find the storage node down
    silent = StorageNodeConfig(name="sn-a", address=f"127.0.0.1:{free_port()}")
    return ServeConfig(
        endpoint=f"unix://{root}/csi.sock",
        file=PluginConfig(storage_nodes=(silent,)),
        node_id="node-a",
        node_address="127.0.0.1",
        state_dir=root / "state",
        kubelet_dir=root / "kubelet",
        allow_private_mounts=True,  # this test mounts nothing; propagation has its own tests
        registration_dir=root / "registry",
        kubelet_registration_path=HOST_PATH,
        health_address=f"127.0.0.1:{free_port()}",
        metrics_address=f"127.0.0.1:{free_port()}",
        storage_node_check_interval=60,
    )


def listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def get(address: str, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
        return response.status, response.read().decode()


def sockets(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_socket())


def test_every_listener_answers_after_start_and_nothing_is_left_after_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = serve_config(tmp_path)
    assert config.health_address and config.metrics_address
    before = set(threading.enumerate())  # threads of earlier tests may end meanwhile
    plugin = Plugin(config, "all", registry=CollectorRegistry())
    caplog.set_level(logging.INFO, logger="moorage.csi")
    plugin.start()
    try:
        assert "csi plugin in all mode" in caplog.text
        with grpc.insecure_channel(config.endpoint) as channel:
            probe = pb_grpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=10)  # type: ignore[no-untyped-call]
            assert probe.ready.value
            info = pb_grpc.NodeStub(channel).NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10)  # type: ignore[no-untyped-call]
            assert info.node_id == "node-a@127.0.0.1"
        registration = tmp_path / "registry" / REGISTRATION_SOCKET
        with grpc.insecure_channel(f"unix://{registration}") as channel:
            plugin_info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=10)  # type: ignore[no-untyped-call]
            assert (plugin_info.name, plugin_info.endpoint) == ("csi.moorage.dev", HOST_PATH)
        assert get(config.health_address, "/healthz") == (200, "ok")
        status, metrics = get(config.metrics_address, "/metrics")
        assert status == 200 and "csi_plugin_operations_seconds" in metrics
        assert sockets(tmp_path) == sorted([tmp_path / "csi.sock", registration])
    finally:
        plugin.stop()
    assert "csi plugin stopped" in caplog.text
    assert sockets(tmp_path) == []
    assert not listening(config.health_address)
    assert not listening(config.metrics_address)
    assert new_threads(before) == set()
    plugin.stop()  # again: nothing to do


def test_a_refused_registration_ends_the_wait_with_kubelets_reason(tmp_path: Path) -> None:
    with Plugin(serve_config(tmp_path), "node", registry=CollectorRegistry()) as plugin:
        assert not plugin.wait(0)
        registration = tmp_path / "registry" / REGISTRATION_SOCKET
        refusal = reg.RegistrationStatus(plugin_registered=False, error="driver name taken")
        with grpc.insecure_channel(f"unix://{registration}") as channel:
            stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            stub.NotifyRegistrationStatus(refusal, timeout=10)
        assert plugin.wait(10)
        assert plugin.refusal == "driver name taken"
    assert sockets(tmp_path) == []


def test_a_start_that_fails_undoes_what_it_had_started(tmp_path: Path) -> None:
    """The registration socket comes last: everything before it is up when it fails."""
    config = serve_config(tmp_path)
    assert config.metrics_address and config.health_address
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / REGISTRATION_SOCKET).write_text("not a socket")
    before = set(threading.enumerate())  # threads of earlier tests may end meanwhile
    plugin = Plugin(config, "all", registry=CollectorRegistry())
    with pytest.raises(StartError, match="exists and is not a socket"):
        plugin.start()
    assert sockets(tmp_path) == []
    assert not listening(config.metrics_address)
    assert not listening(config.health_address)
    assert new_threads(before) == set()
    assert (tmp_path / "registry" / REGISTRATION_SOCKET).read_text() == "not a socket"
