"""Scenario 10: a deleted claim takes its PV and the storage node's volume with it."""

from __future__ import annotations

from tests.e2e.conftest import Cluster, Namespace, claim, step


def test_claim_deleted_volume_gone(cluster: Cluster, ns: Namespace) -> None:
    ns.apply(claim("doomed", "moorage-nfs", "ReadWriteMany"))
    pv = ns.bound("doomed")["spec"]["volumeName"]
    volume_id = ns.kube.get("pv", pv)["spec"]["csi"]["volumeHandle"].split(":", 1)[1]
    assert any(v["id"] == volume_id for v in cluster.volumes())
    step(f"volume {volume_id} listed by `moorage volume list`")
    ns.delete("pvc", "doomed")
    ns.wait("PV deleted", lambda: ns.kube.get("pv", pv) is None, timeout=120)
    ns.wait(
        "volume gone from the storage node",
        lambda: all(v["id"] != volume_id for v in cluster.volumes()),
        timeout=60,
    )
