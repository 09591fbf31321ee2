"""Scenario 9: the node plugin's pod killed, and kubelet restarted, under a running workload."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from moorage_dev.devcluster import node as nodes
from moorage_dev.devcluster import procs
from tests.e2e.conftest import Cluster, Namespace, busybox_pod, claim, host_mounts, step

WRITER = (
    "i=0; while true; do i=$((i+1)); "
    "echo $i > /block/counter; echo $i > /shared/counter; sleep 0.2; done"
)


def _workload() -> list[dict[str, Any]]:
    return [
        claim("block", "moorage-block"),
        claim("shared", "moorage-nfs", "ReadWriteMany"),
        # the workload: a counter written to both volumes, 5 times a second
        busybox_pod("worker", WRITER, {"block": "/block", "shared": "/shared"}),
    ]


def _io(ns: Namespace, tag: str) -> None:
    """Write and read a file on each volume through kubectl exec."""
    for d in ("/block", "/shared"):
        ns.exec("worker", "sh", "-c", f"echo {tag} > {d}/{tag} && sync")
        assert ns.exec("worker", "cat", f"{d}/{tag}").strip() == tag


def _counters(uid: str) -> list[int]:
    """The workload's counters, read from the host through the pod's own mounts."""
    values = []
    for point in sorted(_pod_mounts(uid)):
        for _ in range(20):  # the writer truncates, then writes
            text = Path(point, "counter").read_text().strip()
            if text:
                values.append(int(text))
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{point}/counter stays empty")
    return values


def _writing(uid: str, while_: str, hold: float = 0.0) -> None:
    """Both volumes' counters move on, seen from the host (needs no kubelet)."""
    before = _counters(uid)
    time.sleep(hold)
    assert len(before) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = _counters(uid)
        if all(a > b for a, b in zip(after, before, strict=True)):
            step(f"the workload kept writing both volumes {while_}: {before} -> {after}")
            return
    raise AssertionError(f"the workload stopped writing {while_}: {before} -> {_counters(uid)}")


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


def _restart_plugin(cluster: Cluster, ns: Namespace, uid: str) -> None:
    node = cluster.node.name
    old = _plugin_pod(cluster, node)["metadata"]["name"]
    cluster.kube("delete", "pod", old, "-n", "moorage", "--wait=true", "--timeout=120s")
    step(f"node plugin pod {old} deleted (its containers killed)")
    _writing(uid, "while the plugin's pod was replaced", hold=3)

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
        _writing(uid, "while kubelet was stopped", hold=3)
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
    ns.apply(_workload())
    pod = ns.pod_running("worker")
    uid = pod["metadata"]["uid"]
    assert len(_pod_mounts(uid)) == 2
    _io(ns, "before")
    _writing(uid, "before")
    restart(cluster, ns, uid)
    _writing(uid, "after")
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
