"""Scenario 14: what Kubernetes' own storage suite found (issue 20).

- A pod with an fsGroup on an NFS claim of the chart's default class (its
  export squashes root): the volume's files are given to the group by the
  storage node, and the pod, running as another user, writes files of that group.
- An xfs claim's snapshot restored into a larger claim, used on the node where
  the source is still mounted: the copy mounts beside its source (same xfs
  UUID) and ``df`` in the pod shows the larger size.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import Namespace, busybox_pod, claim, step

GIB = 1 << 30


def _as_user(pod: dict[str, Any], uid: int, gid: int, fs_group: int) -> dict[str, Any]:
    pod["spec"]["securityContext"] = {"runAsUser": uid, "runAsGroup": gid, "fsGroup": fs_group}
    return pod


def test_a_pods_fs_group_on_an_nfs_claim_that_squashes_root(ns: Namespace) -> None:
    ns.apply(claim("grouped", "moorage-nfs", mode="ReadWriteMany"))
    ns.apply(_as_user(busybox_pod("grouped-writer", "sleep 3600", {"grouped": "/data"}),
                      1000, 1000, 2000))  # fmt: skip
    ns.bound("grouped")
    ns.pod_running("grouped-writer")
    assert "2000" in ns.exec("grouped-writer", "id", "-G").split()
    ns.exec("grouped-writer", "sh", "-c", "echo written > /data/by-the-pod && mkdir /data/sub")
    said = ns.exec("grouped-writer", "stat", "-c", "%n %g %A", "/data", "/data/by-the-pod",
                   "/data/sub").split("\n")  # fmt: skip
    groups = {line.split()[0]: line.split()[1:] for line in said if line.strip()}
    assert groups["/data"][0] == "2000" and groups["/data"][1][6] == "s", said
    assert groups["/data/by-the-pod"][0] == "2000", said
    assert groups["/data/sub"][0] == "2000" and groups["/data/sub"][1][6] == "s", said
    step("the pod (uid 1000, fsGroup 2000) writes files of group 2000 on a root-squashed export")


def test_an_xfs_snapshot_restored_larger_beside_its_source(ns: Namespace) -> None:
    ns.apply(claim("xfs-source", "moorage-block-xfs"))
    ns.apply(busybox_pod("xfs-source-user", "sleep 3600", {"xfs-source": "/data"}))
    ns.bound("xfs-source")
    source = ns.pod_running("xfs-source-user")
    ns.exec("xfs-source-user", "sh", "-c", "echo snapshotted > /data/mark && sync")
    ns.apply({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": "xfs-source-snap"},
        "spec": {"volumeSnapshotClassName": "moorage-snapshots",
                 "source": {"persistentVolumeClaimName": "xfs-source"}},
    })  # fmt: skip
    ns.wait(
        "VolumeSnapshot ready",
        lambda: (
            (ns.get("volumesnapshot", "xfs-source-snap") or {}).get("status", {}).get("readyToUse")
            is True
        ),
    )
    ns.apply(claim("xfs-restored", "moorage-block-xfs", size="2Gi", source={
        "kind": "VolumeSnapshot", "name": "xfs-source-snap",
        "apiGroup": "snapshot.storage.k8s.io",
    }))  # fmt: skip
    reader = busybox_pod("xfs-restored-user", "sleep 3600", {"xfs-restored": "/data"})
    # beside the mounted source; through the scheduler (a pod's nodeName skips it, and a
    # WaitForFirstConsumer claim is provisioned only once the scheduler picks a node)
    node = source["spec"]["nodeName"]
    reader["spec"]["nodeSelector"] = {"topology.csi.moorage.dev/node": node}
    ns.apply(reader)
    ns.bound("xfs-restored")
    assert ns.pod_running("xfs-restored-user")["spec"]["nodeName"] == node
    assert ns.exec("xfs-restored-user", "cat", "/data/mark").strip() == "snapshotted"
    df = ns.exec("xfs-restored-user", "df", "-P", "-k", "/data").split("\n")
    size = 1024 * int(df[1].split()[1])
    assert size > 3 * GIB // 2, size
    step(f"the restored 2Gi xfs claim mounts beside its source; df shows {size} bytes")
