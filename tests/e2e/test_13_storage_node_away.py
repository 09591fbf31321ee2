"""Scenario 13: the storage node's pod restarted under a running workload.

The workload of scenario 9 (a counter written to a block and an NFS volume
five times a second).  The storage node's pod is deleted: its DaemonSet
starts a new one, which is back well within the volumes' I/O timeout (the
default, 120 s; docs/csi.md, "When a storage node goes away"), and the
counters keep moving, read from the host through the pod's own mounts; a
file written and read through kubectl exec works on both volumes after it.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import Cluster, Namespace, step
from tests.e2e.test_09_restarts import _io, _pod_mounts, _workload, _writing

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
    ns.apply(_workload())
    pod = ns.pod_running("worker")
    uid = pod["metadata"]["uid"]
    assert len(_pod_mounts(uid)) == 2
    _io(ns, "before")
    _writing(uid, "before")
    _restart_storage_node(cluster, ns)
    _writing(uid, "after the storage node's restart")
    _io(ns, "after")
    ns.delete("pod", "worker")
    ns.wait("both volumes unmounted from the pod", lambda: not _pod_mounts(uid), timeout=120)
