"""Scenario 2: the seed's static flows: a PV by volumeHandle, and a PV of an existing NFS share."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.conftest import Cluster, Namespace, busybox_pod, step


def test_static_pv_by_volume_handle(cluster: Cluster, ns: Namespace) -> None:
    name = f"static-{ns.name}"
    created = cluster.moorage("volume", "create", name, "--type=nbd", "--size=1G", "--json")
    volume = json.loads(created)
    handle = f"sn-0:{volume['id']}"
    step(f"moorage volume create {name} -> {handle}")

    def edit(doc: dict[str, Any]) -> None:
        if doc["kind"] == "PersistentVolume":
            doc["metadata"]["name"] = name
            doc["spec"]["csi"]["volumeHandle"] = handle
            doc["spec"]["persistentVolumeReclaimPolicy"] = "Delete"
        else:
            doc["spec"]["volumeName"] = name

    ns.example("static-pv-by-handle.yaml", edit)
    claim_name = ns.get("pvc")["items"][0]["metadata"]["name"]
    claim = ns.bound(claim_name)
    assert claim["spec"]["volumeName"] == name
    ns.apply(
        busybox_pod("static-user", "echo static > /data/f && sleep 3600", {claim_name: "/data"})
    )
    ns.pod_running("static-user")
    assert ns.exec("static-user", "cat", "/data/f").strip() == "static"
    step("the pod wrote and read the statically provisioned volume (formatted at first stage)")
    ns.delete("pod", "static-user")
    ns.delete("pvc", claim_name)
    # reclaim policy Delete: the volume goes with the PV
    ns.wait(
        "the volume deleted with its PV",
        lambda: all(v["id"] != volume["id"] for v in cluster.volumes()),
        timeout=180,
    )


def test_static_pv_of_an_existing_nfs_share(cluster: Cluster, ns: Namespace) -> None:
    # an NFS share that exists outside Kubernetes: a moorage export made by hand
    sn = cluster.layout.storage_node
    name = f"share-{ns.name}"
    volume = json.loads(
        cluster.moorage("volume", "create", name, "--type=nfs", "--size=1G", "--json")
    )
    try:
        published = json.loads(
            cluster.moorage(
                "volume",
                "publish",
                volume["id"],
                "--node=by-hand",
                f"--address={sn.address}",
                "--json",
            )
        )
        share = published["nfs"]["export_path"] if "nfs" in published else published["export_path"]
        step(f"share {sn.address}:{share} exported by hand")

        def edit(doc: dict[str, Any]) -> None:
            if doc["kind"] == "PersistentVolume":
                attrs = doc["spec"]["csi"]["volumeAttributes"]
                attrs["server"], attrs["share"] = sn.address, share
                doc["spec"]["csi"]["volumeHandle"] = f"{sn.address}{share}"
                doc["metadata"]["name"] = name
                # the FUSE NFS client speaks v3 (docs/csi.md)
                doc["spec"]["mountOptions"] = ["nfsvers=3"]
            else:
                doc["spec"]["volumeName"] = name

        ns.example("static-pv-nfs-share.yaml", edit)
        claim = ns.bound("moorage-existing-share")
        assert claim["spec"]["volumeName"] == name
        ns.apply(
            busybox_pod(
                "share-user",
                "echo shared > /data/f && sleep 3600",
                {"moorage-existing-share": "/data"},
            )
        )
        ns.pod_running("share-user")
        assert ns.exec("share-user", "cat", "/data/f").strip() == "shared"
        step("the pod wrote and read the existing share")
    finally:
        ns.kube.run("delete", "pod", "share-user", "-n", ns.name, "--timeout=120s", check=False)
        ns.kube.run("delete", "pvc", "--all", "-n", ns.name, "--timeout=120s", check=False)
        ns.kube.run("delete", "pv", name, "--timeout=120s", check=False)
        cluster.moorage("volume", "unpublish", volume["id"], "--node=by-hand")
        cluster.moorage("volume", "delete", volume["id"])
