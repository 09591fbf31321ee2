"""The node plugin doing the sidecars' two jobs itself: kubelet registration and /healthz.

A real ``moorage csi serve`` process with ``--registration-dir`` under a
temporary directory standing in for kubelet's ``plugins_registry``; this test
plays kubelet's part on the registration socket (Kubernetes' pluginregistration
v1: GetInfo, then NotifyRegistrationStatus) and the livenessProbe's on
``--health-address``.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.proto import pluginregistration_pb2 as reg
from csi.proto import pluginregistration_pb2_grpc as reg_grpc
from tests.conftest import free_port
from tests.csi_plugin import CsiPlugin, write_config

# The CSI socket's path as the host (kubelet) sees it: not where the test's plugin listens.
HOST_PATH = "/var/lib/kubelet/plugins/csi.moorage.dev/csi.sock"
SOCKET_NAME = "csi.moorage.dev-reg.sock"


def registering_plugin(root: Path, *extra: str) -> CsiPlugin:
    """A node plugin told to register itself through ``root/registry``."""
    registry = root / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    args = ["--registration-dir", str(registry), "--kubelet-registration-path", HOST_PATH]
    return CsiPlugin(root, "node", extra_args=[*args, *extra])


def registration_socket(plugin: CsiPlugin) -> Path:
    return plugin.root / "registry" / SOCKET_NAME


def start_registering(plugin: CsiPlugin, timeout: float = 30) -> CsiPlugin:
    """Start ``plugin`` and wait for its registration socket too.

    The plugin offers itself to kubelet only once its CSI socket answers, so
    the registration socket appears a moment after ``start()`` returns.
    """
    plugin.start()
    deadline = time.monotonic() + timeout
    while not registration_socket(plugin).exists():
        if plugin.proc is not None and plugin.proc.poll() is not None:
            raise RuntimeError(f"plugin exited {plugin.proc.returncode}:\n{plugin.log_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no registration socket after {timeout}s:\n{plugin.log_text()}")
        time.sleep(0.05)
    return plugin


def kubelet_stub(plugin: CsiPlugin) -> tuple[grpc.Channel, reg_grpc.RegistrationStub]:
    channel = grpc.insecure_channel(f"unix://{registration_socket(plugin)}")
    return channel, reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[CsiPlugin]:
    started = start_registering(registering_plugin(tmp_path))
    try:
        yield started
    finally:
        started.stop()


def http_get(port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ------------------------------------------------------------ registration


def test_kubelet_learns_the_driver_and_the_csi_socket_on_the_host(plugin: CsiPlugin) -> None:
    channel, stub = kubelet_stub(plugin)
    with channel:
        info = stub.GetInfo(reg.InfoRequest(), timeout=10)
    assert info.type == "CSIPlugin"
    assert info.name == "csi.moorage.dev"
    assert info.endpoint == HOST_PATH
    assert list(info.supported_versions) == ["1.0.0"]


def test_the_registration_socket_is_private_and_alone_in_the_registry(
    plugin: CsiPlugin,
) -> None:
    st = registration_socket(plugin).lstat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    # the directory it was bound in before the rename is gone
    assert os.listdir(plugin.root / "registry") == [SOCKET_NAME]


def test_a_successful_registration_keeps_the_plugin_serving(plugin: CsiPlugin) -> None:
    channel, stub = kubelet_stub(plugin)
    with channel:
        stub.GetInfo(reg.InfoRequest(), timeout=10)
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
        assert plugin.proc is not None
        with pytest.raises(subprocess.TimeoutExpired):
            plugin.proc.wait(2)
        assert plugin.answers()
        stub.GetInfo(reg.InfoRequest(), timeout=10)  # still there for kubelet
    assert "kubelet registered csi.moorage.dev" in plugin.log_text()


def test_a_refused_registration_stops_the_plugin_with_an_error(plugin: CsiPlugin) -> None:
    channel, stub = kubelet_stub(plugin)
    refusal = reg.RegistrationStatus(plugin_registered=False, error="driver name taken")
    with channel:
        stub.NotifyRegistrationStatus(refusal, timeout=10)  # answered before it stops
    assert plugin.proc is not None
    status = plugin.proc.wait(30)
    assert status == 1, plugin.log_text()
    assert "kubelet refused to register csi.moorage.dev: driver name taken" in plugin.log_text()
    assert not registration_socket(plugin).exists()
    assert not plugin.socket.exists()


def test_sigterm_removes_the_registration_socket(plugin: CsiPlugin) -> None:
    assert registration_socket(plugin).exists()
    assert plugin.stop() == 0
    assert not registration_socket(plugin).exists()
    assert os.listdir(plugin.root / "registry") == []


def test_a_stale_socket_and_a_half_made_one_are_replaced(tmp_path: Path) -> None:
    stale_plugin = registering_plugin(tmp_path)
    path = registration_socket(stale_plugin)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # a socket file nobody serves, as a killed plugin leaves
    half_made = tmp_path / "registry" / ".moorage-reg-abcd1234"
    half_made.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(half_made / "s"))  # killed between bind and rename
    start_registering(stale_plugin)
    try:
        channel, stub = kubelet_stub(stale_plugin)
        with channel:
            assert stub.GetInfo(reg.InfoRequest(), timeout=10).endpoint == HOST_PATH
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert os.listdir(tmp_path / "registry") == [SOCKET_NAME]
    finally:
        stale_plugin.stop()


def test_a_registration_socket_another_plugin_serves_is_refused(
    plugin: CsiPlugin, tmp_path: Path
) -> None:
    second = registering_plugin(tmp_path / "second")
    second.extra_args[1] = str(plugin.root / "registry")  # the first one's registry
    result = subprocess.run(second.argv(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "another process is serving" in result.stderr.strip().splitlines()[-1]
    assert not second.socket.exists()  # what it had started is stopped again
    channel, stub = kubelet_stub(plugin)
    with channel:
        assert stub.GetInfo(reg.InfoRequest(), timeout=10).name == "csi.moorage.dev"


# ------------------------------------------------------------------ healthz


def test_healthz_is_ok_while_the_plugin_serves_and_404_elsewhere(tmp_path: Path) -> None:
    port = free_port()
    node = CsiPlugin(tmp_path, "node", extra_args=["--health-address", f"127.0.0.1:{port}"])
    node.start()
    try:
        assert http_get(port, "/healthz") == (200, "ok")
        assert http_get(port, "/metrics")[0] == 404
        assert http_get(port, "/")[0] == 404
    finally:
        node.stop()
    # the Probe goes through the plugin's socket: the log has the call
    assert "Probe" in node.log_text()


def test_healthz_is_500_with_the_reason_when_the_state_dir_is_unusable(tmp_path: Path) -> None:
    # the node plugin's own state: records cannot be written, so it is not ready
    port = free_port()
    node = CsiPlugin(tmp_path, "node", extra_args=["--health-address", f"127.0.0.1:{port}"])
    node.start()
    state = tmp_path / "state-node"
    moved = tmp_path / "state-node.moved"
    try:
        assert http_get(port, "/healthz") == (200, "ok")
        state.rename(moved)
        state.write_text("not a directory\n")
        status, body = http_get(port, "/healthz")
        assert status == 500
        assert body == f"not ready: state directory {state} is not a directory", body
        state.unlink()
        moved.rename(state)
        assert http_get(port, "/healthz") == (200, "ok")
    finally:
        node.stop()
        if moved.exists():
            state.unlink(missing_ok=True)
            moved.rename(state)


@contextmanager
def silent_storage_node(path: Path) -> Iterator[None]:
    """A socket that takes connections into its backlog and never answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(64)
        yield
    finally:
        sock.close()
        path.unlink(missing_ok=True)


def metric_line(port: int, prefix: str) -> str:
    status, text = http_get(port, "/metrics", timeout=10)
    assert status == 200
    return next((line for line in text.splitlines() if line.startswith(prefix)), "")


def test_a_storage_node_that_does_not_answer_leaves_the_controller_ready(
    tmp_path: Path,
) -> None:
    silent = tmp_path / "silent.sock"
    config = write_config(
        tmp_path / "csi.toml", [{"name": "sn-silent", "address": f"unix:{silent}"}]
    )
    health, metrics = free_port(), free_port()
    args = ["--health-address", f"127.0.0.1:{health}", "--metrics-address", f"127.0.0.1:{metrics}"]
    with silent_storage_node(silent):
        controller = CsiPlugin(tmp_path, "controller", config, extra_args=args)
        controller.start()
        try:
            # Probe (kubelet's default timeout is 1 s) and /healthz: ready, whatever
            # the storage node does; its health call alone takes 5 s to time out
            with controller.channel() as channel:
                stub = pb_grpc.IdentityStub(channel)  # type: ignore[no-untyped-call]
                for _ in range(3):
                    assert stub.Probe(pb.ProbeRequest(), timeout=1).ready.value
            assert http_get(health, "/healthz", timeout=1) == (200, "ok")
            # the storage node's state: the gauge and one log line
            up = 'moorage_csi_storage_node_up{storage_node="sn-silent"} '
            deadline = time.monotonic() + 30
            while metric_line(metrics, up) != up + "0.0":
                assert time.monotonic() < deadline, "the gauge never said the node is down"
                time.sleep(0.2)
            assert controller.log_text().count("down: storage node sn-silent") == 1
            assert http_get(health, "/healthz", timeout=1) == (200, "ok")
        finally:
            controller.stop()
