"""Scenario 1: the seed's dynamic NFS flow, two replicas sharing one RWX volume."""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import Namespace, each_reads_the_others, replicas_ready, step

MESSAGE = "Hello, Kubernetes!"


def _writers(doc: dict[str, Any]) -> None:
    if doc["kind"] == "Deployment":
        container = doc["spec"]["template"]["spec"]["containers"][0]
        # each replica writes the seed's line into a file named after itself
        container["args"] = [f'echo "{MESSAGE}" > /data/$(hostname) && sleep 3600']


def test_two_replicas_read_each_others_file(ns: Namespace) -> None:
    ns.example("dynamic-rwx-deployment.yaml", _writers)
    claim = ns.bound("moorage-shared")
    step(f"PV {claim['spec']['volumeName']} provisioned by csi-provisioner")
    replicas_ready(ns, "moorage-shared-writer", 2)
    pods = [p["metadata"]["name"] for p in ns.pods("app=moorage-shared-writer")]
    assert len(pods) == 2
    each_reads_the_others(ns, pods, MESSAGE)
    pv = ns.kube.get("pv", claim["spec"]["volumeName"])
    assert pv["spec"]["csi"]["driver"] == "csi.moorage.dev"
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
