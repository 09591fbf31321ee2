"""Scenario 9: the node plugin's pod killed, and kubelet restarted, under a running workload."""

from __future__ import annotations

from typing import Any

import pytest

from moorage.devcluster import node as nodes
from moorage.devcluster import procs
from tests.e2e.conftest import Cluster, Namespace, host_mounts, step


def _workload() -> list[dict[str, Any]]:
    claims = [
        ("block", "moorage-block", "ReadWriteOnce"),
        ("shared", "moorage-nfs", "ReadWriteMany"),
    ]
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": [mode],
                "storageClassName": sc,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        for name, sc, mode in claims
    ]
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "worker"},
            "spec": {
                "containers": [
                    {
                        "name": "app",
                        "image": "busybox:1.35",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["/bin/sh", "-c", "sleep 3600"],
                        "volumeMounts": [
                            {"name": "block", "mountPath": "/block"},
                            {"name": "shared", "mountPath": "/shared"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": n, "persistentVolumeClaim": {"claimName": n}} for n, _, _ in claims
                ],
            },
        }
    )
    return docs


def _io(ns: Namespace, tag: str) -> None:
    for d in ("/block", "/shared"):
        ns.exec("worker", "sh", "-c", f"echo {tag} > {d}/{tag} && sync")
        assert ns.exec("worker", "cat", f"{d}/{tag}").strip() == tag
        assert ns.exec("worker", "sh", "-c", f"ls {d} | wc -l").strip() != "0"


def _pod_mounts(uid: str) -> set[str]:
    return {p for _, p, _ in host_mounts() if f"/pods/{uid}/volumes/kubernetes.io~csi/" in p}


def _plugin_pod(cluster: Cluster, node: str) -> dict[str, Any]:
    pods = cluster.kube.get("pods", None, "moorage")["items"]
    (pod,) = [
        p for p in pods
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "node"
        and p["spec"].get("nodeName") == node
        and not p["metadata"].get("deletionTimestamp")
    ]  # fmt: skip
    return dict(pod)


def _restart_plugin(cluster: Cluster, ns: Namespace) -> None:
    node = cluster.node.name
    old = _plugin_pod(cluster, node)["metadata"]["name"]
    cluster.kube("delete", "pod", old, "-n", "moorage", "--wait=true", "--timeout=120s")
    step(f"node plugin pod {old} deleted (its containers killed)")
    _io(ns, "while-the-plugin-is-gone")
    step("the workload read and wrote while the plugin was gone")

    def back() -> bool:
        pod = _plugin_pod(cluster, node)
        statuses = pod["status"].get("containerStatuses") or []
        return pod["metadata"]["name"] != old and bool(statuses) and all(
            s["ready"] for s in statuses
        )  # fmt: skip

    ns.wait("a new node plugin pod ready", back, timeout=180)


def _restart_kubelet(cluster: Cluster, ns: Namespace) -> None:
    node = cluster.node
    procs.stop(cluster.layout, f"kubelet-{node.name}")
    step("kubelet stopped")
    _io(ns, "while-kubelet-is-gone")
    step("the workload read and wrote while kubelet was gone")
    nodes.start_kubelet(cluster.layout, node, cluster.tools)

    def ready() -> bool:
        n = cluster.kube.get("node", node.name)
        since = next(c for c in n["status"]["conditions"] if c["type"] == "Ready")
        return bool(since["status"] == "True")

    ns.wait("kubelet back, node Ready", ready, timeout=180)


@pytest.mark.parametrize("restart", [_restart_plugin, _restart_kubelet], ids=["plugin", "kubelet"])
def test_workload_survives_and_tears_down_cleanly(
    cluster: Cluster, ns: Namespace, restart: Any
) -> None:
    ns.apply(_workload())
    pod = ns.pod_running("worker")
    uid = pod["metadata"]["uid"]
    assert len(_pod_mounts(uid)) == 2
    _io(ns, "before")
    restart(cluster, ns)
    _io(ns, "after")
    ns.delete("pod", "worker")
    ns.wait("both volumes unmounted from the pod", lambda: not _pod_mounts(uid), timeout=120)
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
