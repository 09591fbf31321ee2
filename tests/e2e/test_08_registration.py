"""Scenario 8: CSINode lists the driver with its topology keys; CSIStorageCapacity per segment."""

from __future__ import annotations

import functools
import json

from hostio.sizes import parse_size
from moorage_dev.devcluster import cluster as devcluster
from moorage_dev.devcluster.kube import Kube
from moorage_dev.devcluster.layout import NAMESPACE
from tests.e2e.conftest import Cluster


def test_csinode_and_storage_capacity(cluster: Cluster) -> None:
    kube = cluster.kube
    for node in cluster.layout.nodes:
        csinode = kube.get("csinode", node.name)
        (driver,) = [d for d in csinode["spec"]["drivers"] if d["name"] == "csi.moorage.dev"]
        assert driver["nodeID"].startswith(f"{node.name}@{node.address}")
        assert "topology.csi.moorage.dev/node" in driver["topologyKeys"]
        labels = kube.get("node", node.name)["metadata"]["labels"]
        assert labels["topology.csi.moorage.dev/node"] == node.name
    capacities = kube.get("csistoragecapacities", None, "moorage")["items"]
    classes = {c["storageClassName"] for c in capacities}
    # capacity is tracked for every class: the WaitForFirstConsumer ones and the
    # Immediate NFS class (csi-provisioner --capacity-for-immediate-binding)
    assert {"moorage-nfs", "moorage-block", "moorage-block-xfs"} <= classes, classes
    for node in cluster.layout.nodes:
        segment = [
            c for c in capacities
            if c["nodeTopology"]["matchLabels"].get("topology.csi.moorage.dev/node") == node.name
        ]  # fmt: skip
        assert segment, f"no CSIStorageCapacity for {node.name}'s segment"
        for c in segment:
            # the 32 GiB loop pool, less in use
            assert parse_size(c["capacity"], kubernetes=True) > 1 << 30, c


NODE_PODS = "app.kubernetes.io/component=node"
CONTROLLER_PODS = "app.kubernetes.io/component=controller"


def _containers(kube: Kube, selector: str) -> list[set[str]]:
    pods = json.loads(kube("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json"))["items"]
    return [{c["name"] for c in p["spec"]["containers"]} for p in pods]


def _plugin_logs(kube: Kube, node: str) -> str:
    pods = json.loads(
        kube("get", "pods", "-n", NAMESPACE, "-l", NODE_PODS,
             "--field-selector", f"spec.nodeName={node}", "-o", "json")
    )["items"]  # fmt: skip
    (pod,) = pods
    return kube("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "moorage")


def _registered_by_plugin(kube: Kube, node: str) -> bool:
    return "kubelet registered csi.moorage.dev" in _plugin_logs(kube, node)


def test_the_chart_defaults_run_the_upstream_registrar_and_livenessprobe(
    cluster: Cluster,
) -> None:
    kube = cluster.kube
    node_pods = _containers(kube, NODE_PODS)
    assert len(node_pods) == len(cluster.layout.nodes)
    for containers in node_pods:
        assert containers == {"node-driver-registrar", "liveness-probe", "moorage"}, containers
    for containers in _containers(kube, CONTROLLER_PODS):
        assert "liveness-probe" in containers, containers
    # the upstream registrar registered the driver: the plugin served no registration itself
    for node in cluster.layout.nodes:
        assert "kubelet registered csi.moorage.dev" not in _plugin_logs(kube, node.name)


def test_the_plugin_registers_itself_without_the_registrar(cluster: Cluster) -> None:
    """sidecars.registrar/livenessprobe false: the plugin's own registration and /healthz."""
    kube, layout = cluster.kube, cluster.layout
    try:
        devcluster.install_moorage(layout, kube, sidecars=False)
        kube.wait_until(
            "node pods with the plugin alone",
            lambda: _containers(kube, NODE_PODS) == [{"moorage"}] * len(layout.nodes),
            timeout=300,
        )
        for node in layout.nodes:
            # the registrar's socket went with its container, and kubelet took the
            # driver off the node; the plugin's own registration brought it back
            kube.wait_until(
                f"{node.name}: kubelet registered the plugin itself",
                functools.partial(_registered_by_plugin, kube, node.name),
                timeout=120,
            )
            csinode = kube.get("csinode", node.name)
            assert [d["name"] for d in csinode["spec"]["drivers"]] == ["csi.moorage.dev"]
    finally:
        devcluster.install_moorage(layout, kube)
    kube.wait_until(
        "node pods with the sidecars again",
        lambda: (
            all(len(c) == 3 for c in _containers(kube, NODE_PODS))
            and len(_containers(kube, NODE_PODS)) == len(layout.nodes)
        ),
        timeout=300,
    )
