"""Scenarios 3 and 4: the attach-required block path, and raw block."""

from __future__ import annotations

import hashlib
from typing import Any

from tests.e2e.conftest import Cluster, Namespace, host_mounts, step

DRIVER = "csi.moorage.dev"


def _attachments(ns: Namespace, pv: str) -> list[dict[str, Any]]:
    return [
        va
        for va in ns.kube.get("volumeattachments")["items"]
        if va["spec"]["source"].get("persistentVolumeName") == pv
    ]


def _publications(cluster: Cluster, handle: str) -> list[Any]:
    volume_id = handle.split(":", 1)[1]
    for v in cluster.volumes():
        if v["id"] == volume_id:
            return list(v.get("publications", []))
    raise AssertionError(f"volume {handle} not on the storage node")


def test_block_volume_attach_stage_publish_and_back(cluster: Cluster, ns: Namespace) -> None:
    ns.example("block-pvc.yaml", lambda d: None)
    claim = ns.bound("moorage-block")
    pod = ns.pod_running("moorage-block-user")
    pv_name = claim["spec"]["volumeName"]
    pv = ns.kube.get("pv", pv_name)
    handle = pv["spec"]["csi"]["volumeHandle"]
    node = pod["spec"]["nodeName"]

    # the attach/detach controller made the VolumeAttachment, the attacher attached it
    (va,) = _attachments(ns, pv_name)
    expected = "csi-" + hashlib.sha256((handle + DRIVER + node).encode()).hexdigest()
    assert va["metadata"]["name"] == expected
    assert va["spec"]["attacher"] == DRIVER and va["spec"]["nodeName"] == node
    assert va["status"]["attached"] is True
    assert "external-attacher/csi-moorage-dev" in va["metadata"]["finalizers"]
    assert va["status"]["attachmentMetadata"]["type"] == "nbd"
    step(
        f"VolumeAttachment {va['metadata']['name']} attached: {va['status']['attachmentMetadata']}"
    )
    assert _publications(cluster, handle), "ControllerPublish left no publication"

    kubelet = cluster.layout.kubelet_dir
    digest = hashlib.sha256(handle.encode()).hexdigest()
    staging = f"{kubelet}/plugins/kubernetes.io/csi/{DRIVER}/{digest}/globalmount"
    target = f"{kubelet}/pods/{pod['metadata']['uid']}/volumes/kubernetes.io~csi/{pv_name}/mount"
    points = {point: fstype for _, point, fstype in host_mounts()}
    assert points.get(staging) == "ext4", f"no global mount at {staging}"
    assert points.get(target) == "ext4", f"no bind at {target}"
    step("global mount and the pod's bind are in the host's mount table")
    assert ns.exec("moorage-block-user", "cat", "/data/hello").strip() == "hello"

    ns.delete("pod", "moorage-block-user")
    ns.wait(
        "unpublished and unstaged",
        lambda: not ({staging, target} & {p for _, p, _ in host_mounts()}),
        timeout=120,
    )
    ns.wait("VolumeAttachment gone", lambda: not _attachments(ns, pv_name), timeout=180)
    ns.wait("NBD export withdrawn", lambda: not _publications(cluster, handle), timeout=60)


def test_raw_block_device_written_and_read_with_dd(ns: Namespace) -> None:
    def edit(doc: dict[str, Any]) -> None:
        if doc["kind"] == "Pod":
            doc["spec"]["containers"][0]["command"] = [
                "/bin/sh", "-c",
                "printf moorage-raw-block | dd of=/dev/xvda conv=fsync && sleep 3600",
            ]  # fmt: skip

    ns.example("raw-block-pvc.yaml", edit)
    ns.bound("moorage-raw")
    ns.pod_running("moorage-raw-user")
    out = ns.exec(
        "moorage-raw-user",
        "dd",
        "if=/dev/xvda",
        "bs=4096",
        "count=1",
        "iflag=direct",
        "status=none",
    )
    assert out.startswith("moorage-raw-block")
    size = ns.exec("moorage-raw-user", "blockdev", "--getsize64", "/dev/xvda").strip()
    assert int(size) == 1 << 30
    step("dd wrote and read the raw device in the pod (1 GiB)")
