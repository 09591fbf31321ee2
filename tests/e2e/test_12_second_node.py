"""A second node: an RWX volume shared across nodes; an export refused to another node."""

from __future__ import annotations

import subprocess
from typing import Any

from tests.e2e.conftest import (
    Cluster,
    Namespace,
    each_reads_the_others,
    replicas_ready,
    step,
)

MESSAGE = "Hello, Kubernetes!"
TOLERATE_SECOND_NODE = {"key": "moorage.dev/e2e-second-node", "operator": "Exists"}


def _spread(doc: dict[str, Any]) -> None:
    if doc["kind"] != "Deployment":
        return
    pod = doc["spec"]["template"]["spec"]
    pod["containers"][0]["args"] = [f'echo "{MESSAGE}" > /data/$(hostname) && sleep 3600']
    pod["tolerations"] = [TOLERATE_SECOND_NODE]
    # one replica on each node
    pod["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"app": "moorage-shared-writer"}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }


def test_rwx_volume_shared_by_pods_on_two_nodes(cluster: Cluster, ns: Namespace) -> None:
    ns.example("dynamic-rwx-deployment.yaml", _spread)
    ns.bound("moorage-shared")
    replicas_ready(ns, "moorage-shared-writer", 2)
    pods = ns.pods("app=moorage-shared-writer")
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert nodes == {n.name for n in cluster.layout.nodes}, nodes
    each_reads_the_others(ns, [p["metadata"]["name"] for p in pods], MESSAGE)
    step("replicas on node-a and node-b read each other's files")


def _nbdinfo(netns: str, uri: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nbdinfo", "--size", uri],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_export_published_to_one_node_refused_on_the_other(cluster: Cluster, ns: Namespace) -> None:
    a, b = cluster.layout.nodes
    ns.example("block-pvc.yaml")
    ns.bound("moorage-block")
    pod = ns.pod_running("moorage-block-user")
    assert pod["spec"]["nodeName"] == a.name
    pv = ns.get("pvc", "moorage-block")["spec"]["volumeName"]
    (va,) = [
        v for v in ns.kube.get("volumeattachments")["items"]
        if v["spec"]["source"].get("persistentVolumeName") == pv
    ]  # fmt: skip
    meta = va["status"]["attachmentMetadata"]
    uri = f"nbd://{meta['host']}:{meta['port']}/{meta['exportName']}"
    served = _nbdinfo(a.netns, uri)
    assert served.returncode == 0 and int(served.stdout) == 1 << 30, served.stderr
    step(f"{uri} served to {a.name} ({a.address})")
    refused = _nbdinfo(b.netns, uri)
    assert refused.returncode != 0, refused.stdout
    step(f"{uri} refused to {b.name} ({b.address}): {refused.stderr.strip()[:120]}")
