"""The chart's alerts and dashboard in a real Prometheus (Debian's, on loopback,
file_sd targets, a data directory of its own) scraping a real storage node and
real controller and node plugins, each with the job label the rules select by.

The rules Prometheus loads are the chart's file with every ``for`` read in
seconds instead of minutes (2m: 2s), and nothing else changed, so an alert
that waits minutes in a cluster fires in seconds here.  The storage node
stopped, "storage node down" fires, as Prometheus sees it and as the
controller's health check sees it; started again, both resolve.  A volume
published to two pods on the node plugin, one of whose mounts goes away
behind its back, is reported abnormal at that path to kubelet's
NodeGetVolumeStats and normal at the other, is counted abnormal however the
calls alternate, and "volumes abnormal" fires until that path is
unpublished.  Every dashboard query returns a number once the node has
served NBD and CSI calls.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from backend.api.proto import backend_pb2 as bpb
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.backend_node import BackendNode, make_node
from tests.conftest import free_port
from tests.csi_plugin import CsiPlugin, Kubelet, write_config
from tests.fuse_block_stack import fuse_processes, leftovers
from tests.prometheus_server import (
    PrometheusServer,
    alert_rules,
    as_prometheus_reads_it,
    dashboard_queries,
    fast_rules,
)
from tests.prometheus_text import scrape, value

STORAGE_NODE_JOB = "moorage-storage-node"
# Prometheus' rules on its 1 s evaluations: an alert firing, or resolved, shows
# within a few evaluations of its condition changing; a storage node restarts
# (ganesha included) in well under the bound
ALERT_WAIT = 60
# PromQL words that are not metric names
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (no functions, labels or keywords)."""
    text = re.sub(r'"[^"]*"', "", expr)  # label values
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text)
    return {n for n in names if n not in _KEYWORDS}


@dataclass
class Monitored:
    node: BackendNode
    controller: CsiPlugin
    node_plugin: CsiPlugin
    prometheus: PrometheusServer
    storage_node_target: str
    node_metrics_port: int

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return self.prometheus.alerts(name)

    def firing(self, name: str) -> list[dict[str, str]]:
        return [a["labels"] for a in self.alerts(name) if a["state"] == "firing"]

    def volumes_abnormal(self) -> float:
        """The node plugin's moorage_csi_volumes_abnormal, scraped now."""
        return value(scrape(self.node_metrics_port), "moorage_csi_volumes_abnormal")


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    root = tmp_path_factory.mktemp("monitoring")
    ports = {job: free_port() for job in ("sn", "controller", "node")}
    node = make_node(root / "sn", extra_args=["--metrics-listen", f"127.0.0.1:{ports['sn']}"])
    plugins: list[CsiPlugin] = []
    prometheus: PrometheusServer | None = None
    try:
        node.start()
        config = write_config(root / "csi.toml", [{"name": "sn-a", "address": node.address}])
        for mode in ("controller", "node"):
            extra = ["--metrics-address", f"127.0.0.1:{ports[mode]}"]
            if mode == "controller":
                extra += ["--storage-node-check-interval", "0.5"]
            plugins.append(CsiPlugin(root / mode, mode, config, extra_args=extra).start())
        storage_node_target = f"127.0.0.1:{ports['sn']}"
        prometheus = PrometheusServer(
            root / "prometheus",
            jobs={
                STORAGE_NODE_JOB: [storage_node_target],
                "moorage-csi-controller": [f"127.0.0.1:{ports['controller']}"],
                "moorage-csi-node": [f"127.0.0.1:{ports['node']}"],
            },
            rule_files=[fast_rules(root / "rules.yaml")],
        )
        # held before it starts, so that the finally stops it whatever start() raises
        prometheus.start()
        yield Monitored(
            node, plugins[0], plugins[1], prometheus, storage_node_target, ports["node"]
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        for plugin in plugins:
            plugin.stop()
        node.teardown()
        # a test that failed to unstage leaves its mount, loop device and FUSE
        # process: taken down here, and then a failure
        left = leftovers(root)
        if left:
            take_down(root)
        assert not left, "left behind:\n" + "\n".join(left)


def take_down(root: Path) -> None:
    """Unmount, detach and kill whatever of this module is left under ``root``."""
    marker = str(root)
    with open("/proc/mounts") as mounts:
        targets = [line.split()[1] for line in mounts if marker in line]
    for target in reversed(targets):
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=60)
    for line in fuse_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    for line in subprocess.run(
        ["losetup", "-a"], capture_output=True, text=True, timeout=60
    ).stdout.splitlines():
        if marker in line:
            subprocess.run(["losetup", "-d", line.split(":")[0]], capture_output=True, timeout=60)


def scraped(m: Monitored, job: str, times: int) -> bool:
    """Prometheus has scraped every target of ``job`` successfully ``times`` times."""
    result = m.prometheus.query(f'sum_over_time(up{{job="{job}"}}[1m])')
    return bool(result) and all(float(r["value"][1]) >= times for r in result)


def test_storage_node_down_fires_when_it_stops_and_resolves_when_it_is_back(
    monitored: Monitored,
) -> None:
    m = monitored
    # up for longer than the alert's for (2 s here), and no alert
    for job in (STORAGE_NODE_JOB, "moorage-csi-controller", "moorage-csi-node"):
        m.prometheus.wait(f"{job} scraped", lambda j=job: scraped(m, j, 5), ALERT_WAIT)  # type: ignore[misc]
    assert m.alerts("MoorageStorageNodeDown") == []
    assert m.alerts("MoorageStorageNodeUnavailable") == []
    assert m.node.stop() == 0
    try:
        m.prometheus.wait(
            "MoorageStorageNodeDown firing",
            lambda: bool(m.firing("MoorageStorageNodeDown")),
            ALERT_WAIT,
        )
        [down] = m.firing("MoorageStorageNodeDown")
        assert down["instance"] == m.storage_node_target
        assert down["job"] == STORAGE_NODE_JOB
        assert down["severity"] == "critical"
        # the controller's health check says the same of the node it knows as sn-a
        m.prometheus.wait(
            "MoorageStorageNodeUnavailable firing",
            lambda: bool(m.firing("MoorageStorageNodeUnavailable")),
            ALERT_WAIT,
        )
        [unavailable] = m.firing("MoorageStorageNodeUnavailable")
        assert unavailable["storage_node"] == "sn-a"
        assert unavailable["job"] == "moorage-csi-controller"
        # the plugins themselves are still scraped: no alert about them
        assert m.alerts("MoorageCsiPluginDown") == []
    finally:
        m.node.start()
    for name in ("MoorageStorageNodeDown", "MoorageStorageNodeUnavailable"):
        m.prometheus.wait(f"{name} resolved", lambda n=name: not m.alerts(n), ALERT_WAIT)  # type: ignore[misc]
    assert m.prometheus.query(f'up{{job="{STORAGE_NODE_JOB}"}}')[0]["value"][1] == "1"


def test_a_volume_abnormal_at_one_of_its_paths_fires_volumes_abnormal_until_unpublished(
    monitored: Monitored,
) -> None:
    m = monitored
    cap = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER
        ),
    )
    kubelet = Kubelet(m.node_plugin.root / "kubelet")
    with (
        grpc.insecure_channel(m.controller.endpoint) as cch,
        grpc.insecure_channel(m.node_plugin.endpoint) as nch,
    ):
        controller = pb_grpc.ControllerStub(cch)  # type: ignore[no-untyped-call]
        node = pb_grpc.NodeStub(nch)  # type: ignore[no-untyped-call]
        node_id = node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=60).node_id
        vol = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=f"pvc-{uuid.uuid4()}",
                capacity_range=pb.CapacityRange(required_bytes=64 << 20),
                volume_capabilities=[cap],
                parameters={"type": "nbd"},
            ),
            timeout=120,
        ).volume
        handle = vol.volume_id
        staging = kubelet.global_mount(handle)
        # two pods on the node using the volume: kubelet asks about each path
        pods = [kubelet.pod_target(pod, "pv-abnormal") for pod in ("pod-a", "pod-b")]

        def abnormal_at(path: Path) -> bool:
            request = pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(path))
            condition = node.NodeGetVolumeStats(request, timeout=60).volume_condition
            return bool(condition.abnormal)

        try:
            ctx = controller.ControllerPublishVolume(
                pb.ControllerPublishVolumeRequest(
                    volume_id=handle, node_id=node_id, volume_capability=cap
                ),
                timeout=120,
            ).publish_context
            staging.mkdir(parents=True, exist_ok=True)
            node.NodeStageVolume(
                pb.NodeStageVolumeRequest(
                    volume_id=handle,
                    publish_context=ctx,
                    staging_target_path=str(staging),
                    volume_capability=cap,
                    volume_context=vol.volume_context,
                ),
                timeout=120,
            )
            for target in pods:
                node.NodePublishVolume(
                    pb.NodePublishVolumeRequest(
                        volume_id=handle,
                        publish_context=ctx,
                        staging_target_path=str(staging),
                        target_path=str(target),
                        volume_capability=cap,
                        volume_context=vol.volume_context,
                    ),
                    timeout=120,
                )
            assert not any(abnormal_at(p) for p in pods)
            assert m.volumes_abnormal() == 0
            # one pod's mount gone (an operator, a runtime bug), the other's fine:
            # however kubelet's calls alternate, the volume counts as abnormal
            subprocess.run(["umount", str(pods[0])], check=True, capture_output=True, timeout=60)
            for _ in range(2):
                assert abnormal_at(pods[0])
                assert m.volumes_abnormal() == 1
                assert not abnormal_at(pods[1])
                assert m.volumes_abnormal() == 1, "abnormal at one path of two: still abnormal"
            m.prometheus.wait(
                "MoorageVolumesAbnormal firing",
                lambda: bool(m.firing("MoorageVolumesAbnormal")),
                ALERT_WAIT,
            )
            [abnormal] = m.firing("MoorageVolumesAbnormal")
            assert abnormal["job"] == "moorage-csi-node"
            # the broken publication unpublished: kubelet asks no more about it,
            # and it is forgotten while the volume stays staged and published
            node.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(pods[0])),
                timeout=120,
            )
            assert not abnormal_at(pods[1])
            assert m.volumes_abnormal() == 0
            m.prometheus.wait(
                "MoorageVolumesAbnormal resolved",
                lambda: not m.alerts("MoorageVolumesAbnormal"),
                ALERT_WAIT,
            )
        finally:
            failed: list[str] = []
            for call, request in (
                *(
                    (
                        node.NodeUnpublishVolume,
                        pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target)),
                    )
                    for target in pods
                ),
                (
                    node.NodeUnstageVolume,
                    pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                ),
            ):
                try:
                    call(request, timeout=120)
                except grpc.RpcError as e:  # the fixture takes down what it left
                    failed.append(f"{type(request).__name__}: {e}")
            with contextlib.suppress(grpc.RpcError):
                controller.ControllerUnpublishVolume(
                    pb.ControllerUnpublishVolumeRequest(volume_id=handle, node_id=node_id),
                    timeout=120,
                )
            controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=handle), timeout=120)
            assert not failed, failed


def make_traffic(m: Monitored) -> None:
    """NBD reads and writes on the storage node, and CSI calls on both plugins."""
    with m.node.client() as c:
        v = c.create_volume(
            bpb.CreateVolumeRequest(
                name=f"traffic-{uuid.uuid4().hex[:8]}", type=bpb.NBD, size_bytes=16 << 20
            )
        )
        target = c.publish(v.id, "node-a", "127.0.0.1").nbd
    uri = f"nbd://127.0.0.1:{target.port}/{target.export_name}"
    subprocess.run(
        ["qemu-io", "-f", "raw", "-c", "write -P 0x5a 0 4M", "-c", "read 0 4M", uri],
        check=True,
        capture_output=True,
        timeout=120,
    )
    csi_calls(m)
    # a series first scraped at its first value shows no rate(): once Prometheus
    # has the calls' series, the same calls again move them
    calls = 'csi_plugin_operations_seconds_count{method_name=~".*/(ListVolumes|NodeGetInfo)"}'
    m.prometheus.wait(
        "the CSI calls' series scraped", lambda: len(m.prometheus.query(calls)) >= 2, ALERT_WAIT
    )
    csi_calls(m)


def csi_calls(m: Monitored) -> None:
    with grpc.insecure_channel(m.controller.endpoint) as ch:
        stub = pb_grpc.ControllerStub(ch)  # type: ignore[no-untyped-call]
        stub.ListVolumes(pb.ListVolumesRequest(), timeout=60)
        stub.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest(), timeout=60)
    with grpc.insecure_channel(m.node_plugin.endpoint) as ch:
        node = pb_grpc.NodeStub(ch)  # type: ignore[no-untyped-call]
        node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=60)
        node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(), timeout=60)


def numbers(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]


def test_every_dashboard_query_returns_data(monitored: Monitored) -> None:
    m = monitored
    make_traffic(m)
    for title, expr in dashboard_queries():
        promql = as_prometheus_reads_it(expr)
        m.prometheus.wait(
            f"dashboard panel {title!r}: {promql}",
            lambda q=promql: bool(numbers(m.prometheus.query(q))),  # type: ignore[misc]
            ALERT_WAIT,
        )
    # and the traffic shows where it should: bytes read and written per storage node
    throughput = "sum by (instance) (rate(moorage_nbd_written_bytes_total[5m]))"
    assert numbers(m.prometheus.query(throughput))[0] > 0


def test_every_metric_the_alerts_read_is_one_the_components_export(monitored: Monitored) -> None:
    m = monitored
    # moorage_volumes has a series per type and state of the volumes there are
    with m.node.client() as c:
        c.create_volume(
            bpb.CreateVolumeRequest(
                name=f"exists-{uuid.uuid4().hex[:8]}", type=bpb.NBD, size_bytes=16 << 20
            )
        )
    names = set().union(*(metric_names(rule["expr"]) for rule in alert_rules()))
    assert {"up", "moorage_capacity_bytes", "csi_plugin_operations_seconds_count"} <= names
    for job in (STORAGE_NODE_JOB, "moorage-csi-controller", "moorage-csi-node"):
        m.prometheus.wait(f"{job} scraped", lambda j=job: scraped(m, j, 2), ALERT_WAIT)  # type: ignore[misc]

    def missing() -> list[str]:
        return [n for n in sorted(names) if not m.prometheus.query(f"count({n})")]

    try:
        m.prometheus.wait("every metric the alerts read", lambda: not missing(), ALERT_WAIT)
    except AssertionError:
        raise AssertionError(f"the alerts read metrics nothing exports: {missing()}") from None
