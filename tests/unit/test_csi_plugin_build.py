"""Building the CSI plugin touches nothing on the host; ``start()`` is where it does.

Each test builds under a directory that does not exist, with every way of
running a program or starting a thread made to fail the test: nothing may
be created, run or started until the plugin (or the node service) is told
to start.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from csi.attach import reconnect
from csi.config import NodeConfig, PluginConfig, StorageNodeConfig
from csi.node import NodeService
from csi.plugin import Plugin, ServeConfig, StartError
from nbd import kernel as nbd_kernel


def refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(f"{what} while building")

    return refused


@pytest.fixture(autouse=True)
def no_host_io(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("run", "Popen", "check_output", "check_call", "call"):
        monkeypatch.setattr(subprocess, name, refuse(f"subprocess.{name}"))
    monkeypatch.setattr(threading.Thread, "start", refuse("a thread started"))
    monkeypatch.setattr(nbd_kernel, "probe_kernel_nbd", refuse("the nbd module probed"))
    monkeypatch.setattr(reconnect, "LinkDeadMonitor", refuse("a netlink socket opened"))


def serve_config(missing: Path, **changes: Any) -> ServeConfig:
    storage_node = StorageNodeConfig(name="sn-a", address="127.0.0.1:7443")
    values: dict[str, Any] = {
        "endpoint": f"unix://{missing}/csi.sock",
        "file": PluginConfig(storage_nodes=(storage_node,)),
        "node_id": "node-a",
        "node_address": "127.0.0.1",
        "state_dir": missing / "state",
        "kubelet_dir": missing / "kubelet",
        "registration_dir": missing / "registry",
        "kubelet_registration_path": "/var/lib/kubelet/plugins/csi.moorage.dev/csi.sock",
        "health_address": "127.0.0.1:9808",
        "metrics_address": "127.0.0.1:9809",
    }
    return ServeConfig(**{**values, **changes})


def test_a_node_service_is_built_without_its_state_directory_or_a_probe(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet"
    node = NodeService("node-a", "127.0.0.1", NodeConfig(), missing / "state")
    assert node.node_id == "node-a@127.0.0.1"
    assert not missing.exists()
    with pytest.raises(RuntimeError, match="recover"):
        node.plan  # noqa: B018 - known only once recover() has probed the host


@pytest.mark.parametrize("mode", ["controller", "node", "all"])
def test_a_plugin_is_built_without_a_file_a_socket_or_a_thread(mode: str, tmp_path: Path) -> None:
    missing = tmp_path / "not-yet"
    changes = {} if mode != "controller" else {"registration_dir": None}
    plugin = Plugin(serve_config(missing, **changes), mode)
    assert (plugin.controller is not None) == (mode != "node")
    assert (plugin.node is not None) == (mode != "controller")
    assert not missing.exists()
    plugin.stop()  # never started: nothing to stop


def test_a_reconnector_opens_nothing_until_told(tmp_path: Path) -> None:
    reconnector = reconnect.Reconnector(tmp_path / "attach")
    reconnector.close()
    assert not (tmp_path / "attach").exists()


@pytest.mark.parametrize(
    ("mode", "changes", "message"),
    [
        ("sideways", {}, "--mode must be one of controller, node, all, not 'sideways'"),
        (
            "controller",
            {"file": PluginConfig(storage_nodes=()), "registration_dir": None},
            "needs a --config naming",
        ),
        ("controller", {}, "--registration-dir is for the node plugin"),
        ("node", {"node_id": None}, "--mode node needs --node-id and --node-address"),
        ("all", {"node_address": None}, "--mode all needs --node-id and --node-address"),
        ("node", {"kubelet_dir": Path("kubelet")}, "--kubelet-dir 'kubelet' is not an absolute"),
        ("node", {"node_id": "no spaces"}, "node id from name 'no spaces'"),
    ],
)
def test_a_configuration_that_cannot_serve_is_refused_when_built(
    mode: str, changes: dict[str, Any], message: str, tmp_path: Path
) -> None:
    missing = tmp_path / "not-yet"
    with pytest.raises(StartError, match=message):
        Plugin(serve_config(missing, **changes), mode)
    assert not missing.exists()
