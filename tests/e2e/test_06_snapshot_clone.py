"""Scenario 6: a VolumeSnapshot restored into a new claim, and a claim cloned from a claim."""

from __future__ import annotations

from tests.e2e.conftest import Namespace, busybox_pod, claim, step


def test_snapshot_restore_and_clone_hold_the_data(ns: Namespace) -> None:
    ns.example("block-pvc.yaml")
    ns.bound("moorage-block")
    ns.pod_running("moorage-block-user")
    ns.exec("moorage-block-user", "sh", "-c", "echo snapshotted > /data/mark && sync")
    step("wrote /data/mark in the source volume")

    ns.example("snapshot-restore.yaml")
    ns.wait(
        "VolumeSnapshot ready",
        lambda: (
            (ns.get("volumesnapshot", "moorage-block-snap") or {})
            .get("status", {})
            .get("readyToUse")
            is True
        ),
    )
    ns.apply(busybox_pod("restored-reader", "sleep 3600", {"moorage-block-restored": "/data"}))
    ns.bound("moorage-block-restored")
    ns.pod_running("restored-reader")
    assert ns.exec("restored-reader", "cat", "/data/mark").strip() == "snapshotted"
    step("the claim restored from the snapshot holds the data")

    ns.apply(
        claim(
            "moorage-block-clone",
            "moorage-block",
            source={"kind": "PersistentVolumeClaim", "name": "moorage-block"},
        )
    )
    ns.apply(busybox_pod("clone-reader", "sleep 3600", {"moorage-block-clone": "/data"}))
    ns.bound("moorage-block-clone")
    ns.pod_running("clone-reader")
    assert ns.exec("clone-reader", "cat", "/data/mark").strip() == "snapshotted"
    step("the claim cloned from the claim holds the data")
