"""Scenario 9: the node plugin's pod killed, and kubelet restarted, under a running workload."""

from __future__ import annotations

from typing import Any

import pytest

from moorage_dev.devcluster import node as nodes
from moorage_dev.devcluster import procs
from tests.e2e.conftest import Cluster, Namespace, step
from tests.e2e.workload import exec_io, pod_mounts, workload, writing


def _plugin_pod(cluster: Cluster, node: str) -> dict[str, Any]:
    pods = cluster.kube.get("pods", None, "moorage")["items"]
    (pod,) = [
        p for p in pods
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "node"
        and p["spec"].get("nodeName") == node
        and not p["metadata"].get("deletionTimestamp")
    ]  # fmt: skip
    return dict(pod)


def _restart_plugin(cluster: Cluster, ns: Namespace, uid: str) -> None:
    node = cluster.node.name
    old = _plugin_pod(cluster, node)["metadata"]["name"]
    cluster.kube("delete", "pod", old, "-n", "moorage", "--wait=true", "--timeout=120s")
    step(f"node plugin pod {old} deleted (its containers killed)")
    writing(uid, "while the plugin's pod was replaced", hold=3)

    def back() -> bool:
        pod = _plugin_pod(cluster, node)
        statuses = pod["status"].get("containerStatuses") or []
        return pod["metadata"]["name"] != old and bool(statuses) and all(
            s["ready"] for s in statuses
        )  # fmt: skip

    ns.wait("a new node plugin pod ready", back, timeout=180)


def _restart_kubelet(cluster: Cluster, ns: Namespace, uid: str) -> None:
    node = cluster.node
    procs.stop(cluster.layout, f"kubelet-{node.name}")
    step("kubelet stopped")
    try:
        writing(uid, "while kubelet was stopped", hold=3)
    finally:
        nodes.start_kubelet(cluster.layout, node, cluster.tools)
        step("kubelet started again")

    def ready() -> bool:
        n = cluster.kube.get("node", node.name)
        since = next(c for c in n["status"]["conditions"] if c["type"] == "Ready")
        return bool(since["status"] == "True")

    ns.wait("node Ready", ready, timeout=180)

    def serves_the_pod() -> bool:
        return (
            ns.kube.run("exec", "-n", ns.name, "worker", "--", "true", check=False).returncode == 0
        )

    ns.wait("kubelet has the pod again (exec works)", serves_the_pod, timeout=120)


@pytest.mark.parametrize("restart", [_restart_plugin, _restart_kubelet], ids=["plugin", "kubelet"])
def test_workload_survives_and_tears_down_cleanly(
    cluster: Cluster, ns: Namespace, restart: Any
) -> None:
    ns.apply(workload())
    pod = ns.pod_running("worker")
    uid = pod["metadata"]["uid"]
    assert len(pod_mounts(uid)) == 2
    exec_io(ns, "before")
    writing(uid, "before")
    restart(cluster, ns, uid)
    writing(uid, "after")
    exec_io(ns, "after")
    ns.delete("pod", "worker")
    ns.wait("both volumes unmounted from the pod", lambda: not pod_mounts(uid), timeout=120)
    ns.wait(
        "both volumes detached",
        lambda: (
            not [
                va
                for va in ns.kube.get("volumeattachments")["items"]
                if va["spec"]["source"].get("persistentVolumeName")
                in {ns.get("pvc", c)["spec"]["volumeName"] for c in ("block", "shared")}
            ]
        ),
        timeout=180,
    )
