"""Scenario 6: a VolumeSnapshot restored into a new claim, and a claim cloned from a claim."""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import Namespace, step


def _reader(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "busybox:1.35",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c", "sleep 3600"],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }


def _claim(name: str, source: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "moorage-block",
            "dataSource": source,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }


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
    ns.apply(_reader("restored-reader", "moorage-block-restored"))
    ns.bound("moorage-block-restored")
    ns.pod_running("restored-reader")
    assert ns.exec("restored-reader", "cat", "/data/mark").strip() == "snapshotted"
    step("the claim restored from the snapshot holds the data")

    ns.apply(
        _claim("moorage-block-clone", {"kind": "PersistentVolumeClaim", "name": "moorage-block"})
    )
    ns.apply(_reader("clone-reader", "moorage-block-clone"))
    ns.bound("moorage-block-clone")
    ns.pod_running("clone-reader")
    assert ns.exec("clone-reader", "cat", "/data/mark").strip() == "snapshotted"
    step("the claim cloned from the claim holds the data")
