"""The node plugin's own reconnect thread on the kernel path, under an outage.

The plugin runs in the guest (``--mode all``, against the host's storage node
over the lane's network) and stages an ext4 volume on /dev/nbdN as kubelet
would; the host stops the storage node for less than the volume's
``ioTimeout`` while a pod's write is under way.  The plugin (not
``moorage attach watch``, which test_kernel_nbd_bounds.py runs) hands the
device a new connection when the node is back: the write completes, and what
was written reads back equal after the volume is staged anew.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.csi_plugin import Kubelet
from tests.kernel.conftest import GUEST_TOKEN, Store
from tests.kernel.guest import API_PORT, GUEST_IP, HOST_IP, GuestError, Lane

ROOT = Path("/tmp/csi-reconnect")
ENDPOINT = f"unix://{ROOT}/csi.sock"
LOG = f"{ROOT}/plugin.log"
PYTHON = str(REPO / ".venv/bin/python")
MIB = 1 << 20
CAP = {"mount": {"fsType": "ext4"}, "accessMode": {"mode": "SINGLE_NODE_WRITER"}}


class Plugin:
    def __init__(self, guest: Lane) -> None:
        self.guest = guest

    def call(self, service: str, method: str, request: dict[str, Any]) -> dict[str, Any]:
        out = self.guest.run(PYTHON, "-m", "tests.kernel.csicall", ENDPOINT, service, method,
                             input=json.dumps(request), timeout=360)  # fmt: skip
        answer: dict[str, Any] = json.loads(out.stdout)
        return answer

    def log(self) -> str:
        return self.guest.run("cat", LOG).stdout


@pytest.fixture
def plugin(guest: Lane, store: Store) -> Iterator[Plugin]:
    config = (f'[[storage_nodes]]\nname = "sn-a"\naddress = "{HOST_IP}:{API_PORT}"\n'
              f'token_file = "{GUEST_TOKEN}"\n')  # fmt: skip
    guest.run("sh", "-euc", f"mkdir -p {ROOT}/kubelet && cat > {ROOT}/csi.toml", input=config)
    guest.spawn(
        "plugin", str(REPO / ".venv/bin/moorage"), "-v", "csi", "serve", "--endpoint", ENDPOINT,
        "--mode", "all", "--config", f"{ROOT}/csi.toml", "--node-id", "kernel-lane",
        "--node-address", GUEST_IP, "--state-dir", f"{ROOT}/state",
        "--kubelet-dir", f"{ROOT}/kubelet", "--allow-private-mounts",
        log=LOG,
    )  # fmt: skip
    running = Plugin(guest)
    deadline = time.monotonic() + 120
    while True:
        try:
            running.call("Identity", "GetPluginInfo", {})
            break
        except GuestError:
            assert time.monotonic() < deadline, running.log()
            time.sleep(1)
    try:
        yield running
    finally:
        guest.signal("plugin", signal.SIGTERM)
        assert guest.wait("plugin", 60) == 0, running.log()
        guest.run("rm", "-rf", str(ROOT))


def test_the_plugin_reconnects_its_kernel_nbd_device_after_an_outage(
    guest: Lane, store: Store, plugin: Plugin
) -> None:
    kubelet = Kubelet(ROOT / "kubelet")  # paths in the guest
    volume = plugin.call("Controller", "CreateVolume", {
        "name": f"pvc-{uuid.uuid4()}", "capacityRange": {"requiredBytes": str(256 * MIB)},
        "volumeCapabilities": [CAP], "parameters": {"type": "nbd", "ioTimeout": "120"},
    })["volume"]  # fmt: skip
    handle = volume["volumeId"]
    node_id = plugin.call("Node", "NodeGetInfo", {})["nodeId"]
    staging = str(kubelet.global_mount(handle))
    target = str(kubelet.pod_target(str(uuid.uuid4()), "pv-reconnect"))
    published = False
    try:
        ctx = plugin.call("Controller", "ControllerPublishVolume", {
            "volumeId": handle, "nodeId": node_id, "volumeCapability": CAP,
        })["publishContext"]  # fmt: skip
        published = True
        stage = {"volumeId": handle, "publishContext": ctx, "stagingTargetPath": staging,
                 "volumeCapability": CAP, "volumeContext": volume.get("volumeContext", {}),
                 }  # fmt: skip
        guest.run("mkdir", "-p", staging)  # kubelet makes the staging directory
        plugin.call("Node", "NodeStageVolume", stage)
        plugin.call("Node", "NodePublishVolume", {**stage, "targetPath": target})
        source = guest.run("findmnt", "-n", "-o", "SOURCE", staging).stdout.strip()
        assert source.startswith("/dev/nbd"), source
        guest.sh(f"head -c {8 * MIB} /dev/urandom > {target}/before && sync {target}/before")

        assert store.node.stop() == 0
        guest.spawn("writer", "sh", "-euc",
                    f"head -c {8 * MIB} /dev/urandom > {target}/during && sync {target}/during",
                    log="/tmp/csi-writer.log")  # fmt: skip
        time.sleep(3)
        store.node.start()
        assert guest.wait("writer", 150) == 0, (
            guest.sh("cat /tmp/csi-writer.log; dmesg | tail -30", check=False).stdout + plugin.log()
        )
        assert f"{source} (nbd://" in plugin.log() and "reconnected" in plugin.log()
        sums = guest.sh(f"cd {target} && sha256sum before during").stdout

        # staged anew: what is read comes from the storage node
        plugin.call("Node", "NodeUnpublishVolume", {"volumeId": handle, "targetPath": target})
        plugin.call("Node", "NodeUnstageVolume", {"volumeId": handle,
                                                  "stagingTargetPath": staging})  # fmt: skip
        plugin.call("Node", "NodeStageVolume", stage)
        plugin.call("Node", "NodePublishVolume", {**stage, "targetPath": target})
        assert guest.sh(f"cd {target} && sha256sum before during").stdout == sums
    finally:
        for method, request in (
            ("NodeUnpublishVolume", {"volumeId": handle, "targetPath": target}),
            ("NodeUnstageVolume", {"volumeId": handle, "stagingTargetPath": staging}),
        ):
            with contextlib.suppress(GuestError):
                plugin.call("Node", method, request)
        if published:
            plugin.call("Controller", "ControllerUnpublishVolume",
                        {"volumeId": handle, "nodeId": node_id})  # fmt: skip
        plugin.call("Controller", "DeleteVolume", {"volumeId": handle})
