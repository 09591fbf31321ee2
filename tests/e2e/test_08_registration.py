"""Scenario 8: CSINode lists the driver with its topology keys; CSIStorageCapacity per segment."""

from __future__ import annotations

from moorage.units import parse_size
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
            assert parse_size(c["capacity"]) > 1 << 30, c  # the 8 GiB loop pool, less in use
