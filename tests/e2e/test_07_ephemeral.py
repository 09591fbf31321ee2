"""Scenario 7: a CSI ephemeral inline volume lives and dies with its pod."""

from __future__ import annotations

from tests.e2e.conftest import Cluster, Namespace, step


def test_inline_volume_made_for_the_pod_and_deleted_after_it(
    cluster: Cluster, ns: Namespace
) -> None:
    assert not ns.kube.get("volumeattachments")["items"]
    before = {v["id"] for v in cluster.volumes()}
    ns.example("ephemeral-inline.yaml")
    pod = ns.pod_running("moorage-scratch")
    made = [v for v in cluster.volumes() if v["id"] not in before]
    assert len(made) == 1 and made[0]["name"].startswith("eph-"), made
    step(f"inline volume {made[0]['name']} made on the storage node")
    ns.exec("moorage-scratch", "sh", "-c", "echo scratch > /scratch/f")
    assert ns.exec("moorage-scratch", "cat", "/scratch/f").strip() == "scratch"
    attached = [va for va in ns.kube.get("volumeattachments")["items"]
                if va["spec"]["nodeName"] == pod["spec"]["nodeName"]]  # fmt: skip
    assert not attached, "an inline volume gets no VolumeAttachment"
    ns.delete("pod", "moorage-scratch")
    ns.wait(
        "inline volume deleted with its pod",
        lambda: all(v["id"] != made[0]["id"] for v in cluster.volumes()),
        timeout=120,
    )
