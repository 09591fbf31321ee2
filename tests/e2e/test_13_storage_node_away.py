"""Scenario 13: the storage node's pod restarted under a running workload.

The workload of scenario 9 (a counter written to a block and an NFS volume
five times a second).  The storage node's pod is deleted: its DaemonSet
starts a new one, which is back well within the volumes' I/O timeout (the
default, 120 s; docs/csi.md, "When a storage node goes away"), and the
counters keep moving, read from the host through the pod's own mounts; a
file written and read through kubectl exec works on both volumes after it.

Then the storage node goes and stays away (its DaemonSet selects no node)
under the same workload on classes with a 30 s I/O timeout, and the pod is
deleted: it goes once the bound has passed (the writer's I/O fails, kubelet
kills it and unpublishes both volumes), not stuck Terminating.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.e2e.conftest import Cluster, Namespace, busybox_pod, claim, step
from tests.e2e.workload import WRITER, exec_io, pod_mounts, workload, writing

NAMESPACE = "moorage"
IO_TIMEOUT = 120  # the node plugin's default: the chart's storage classes name none


def _storage_node_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.kube.get("pods", None, NAMESPACE)["items"]
    return [
        p
        for p in pods
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "storage-node"
        and not p["metadata"].get("deletionTimestamp")
    ]


def _ready(pod: dict[str, Any]) -> bool:
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all(s["ready"] for s in statuses)


def _restart_storage_node(cluster: Cluster, ns: Namespace) -> None:
    (old,) = [p["metadata"]["name"] for p in _storage_node_pods(cluster)]
    cluster.kube("delete", "pod", old, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    step(f"storage node pod {old} deleted")

    def back() -> bool:
        pods = _storage_node_pods(cluster)
        return len(pods) == 1 and pods[0]["metadata"]["name"] != old and _ready(pods[0])

    ns.wait("a new storage node pod ready", back, timeout=IO_TIMEOUT)


def test_a_storage_node_restart_is_a_pause_for_the_workload(
    cluster: Cluster, ns: Namespace
) -> None:
    ns.apply(workload())
    pod = ns.pod_running("worker")
    uid = pod["metadata"]["uid"]
    assert len(pod_mounts(uid)) == 2
    exec_io(ns, "before")
    writing(uid, "before")
    _restart_storage_node(cluster, ns)
    writing(uid, "after the storage node's restart")
    exec_io(ns, "after")
    ns.delete("pod", "worker")
    ns.wait("both volumes unmounted from the pod", lambda: not pod_mounts(uid), timeout=120)


AWAY_TIMEOUT = 30  # the classes of the second case: a short bound keeps the run short
STAY_AWAY = {"moorage.dev/e2e-no-such-node": "true"}


def _classes() -> list[dict[str, Any]]:
    """The chart's block and NFS classes, with a 30 s I/O timeout."""

    def one(name: str, parameters: dict[str, str], options: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": "csi.moorage.dev",
            "parameters": {**parameters, "ioTimeout": str(AWAY_TIMEOUT)},
            "mountOptions": options,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }

    return [
        one("moorage-e2e-block-30s", {"type": "nbd", "csi.storage.k8s.io/fstype": "ext4"}, []),
        one("moorage-e2e-nfs-30s", {"type": "nfs", "nfsFsType": "xfs"}, ["nfsvers=4.1"]),
    ]


def _storage_node_set(cluster: Cluster) -> tuple[str, dict[str, str]]:
    sets = cluster.kube.get("daemonsets", None, NAMESPACE)["items"]
    (ds,) = [
        d for d in sets
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "storage-node"
    ]  # fmt: skip
    return ds["metadata"]["name"], dict(ds["spec"]["template"]["spec"].get("nodeSelector") or {})


def _select(cluster: Cluster, ds: str, selector: dict[str, str] | None) -> None:
    patch = json.dumps([{"op": "replace", "path": "/spec/template/spec/nodeSelector",
                         "value": selector}])  # fmt: skip
    cluster.kube("patch", "daemonset", ds, "-n", NAMESPACE, "--type=json", "-p", patch)


def test_a_pod_deleted_while_its_storage_node_is_gone_terminates(
    cluster: Cluster, ns: Namespace
) -> None:
    """The storage node stays away (its DaemonSet selects no node); the workload's
    pod, deleted then, goes once its volumes' I/O timeout has passed: it is not
    stuck Terminating, and nothing of it stays mounted."""
    classes = _classes()
    for doc in classes:
        cluster.kube.run("delete", "storageclass", doc["metadata"]["name"], check=False)
    ns.apply(classes)
    ds, selector = _storage_node_set(cluster)
    try:
        ns.apply([
            claim("block", "moorage-e2e-block-30s"),
            claim("shared", "moorage-e2e-nfs-30s", "ReadWriteMany"),
            busybox_pod("worker", WRITER, {"block": "/block", "shared": "/shared"}),
        ])  # fmt: skip
        uid = ns.pod_running("worker")["metadata"]["uid"]
        writing(uid, "before")
        # the storage node goes and stays away: its DaemonSet selects no node
        _select(cluster, ds, STAY_AWAY)
        ns.wait("the storage node gone", lambda: not _storage_node_pods(cluster), timeout=180)
        step("the storage node is gone; deleting the pod")
        started = time.monotonic()
        ns.delete("pod", "worker", wait=False)
        ns.wait("pod worker gone", lambda: ns.get("pod", "worker") is None, timeout=600)
        took = time.monotonic() - started
        step(f"pod worker went {took:.0f} s after its deletion (I/O timeout {AWAY_TIMEOUT} s)")
        assert not pod_mounts(uid)
    finally:
        _select(cluster, ds, selector)
        ns.wait("the storage node back", lambda: len(_storage_node_pods(cluster)) == 1
                and _ready(_storage_node_pods(cluster)[0]), timeout=300)  # fmt: skip
        for doc in classes:
            cluster.kube.run("delete", "storageclass", doc["metadata"]["name"], check=False)
    # the writer's I/O fails at the bound; kubelet then kills it and unpublishes
    # (31 s for a 30 s bound in the figures of docs/e2e.md)
    assert took <= AWAY_TIMEOUT + 60
